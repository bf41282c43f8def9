#!/bin/bash
# Session 8, run B (nvidia-h200-x2, one call, ~450 s), after run A: decode_linear's config from run A's sweep
# (2 rows a program, 4 / 8 warps) in the three batch-1 projection kernels, and norm_f + lm_head as one
# decode_linear kernel at batch 1.
# GPU 0: the float64 checks (test_gpu.py cases 0 and 1: the chunk kernel bf16 forward and every gradient, the
# step kernel, the decoding mixer / block, the whole model decoding, plain and compiled, batch 1 and 2), the
# decoding step's profile, the whole decoding table (KLA compiled / CUDA graph / eager, attention).
# GPU 1: the kernel's anchor rows against fla (bench.py --section=kernel), then the profile of a compiled
# training step at 2048 (KLA and attention).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=/tmp/b; mkdir -p $R; T0=$(date +%s); END=560
left() { echo $(( END - ($(date +%s) - T0) )); }
stamp() { echo "$1 $2 at $(( $(date +%s) - T0 ))" >> $R/gpus.txt; }
nvidia-smi -L > $R/gpus.txt
(export CUDA_VISIBLE_DEVICES=1
 timeout 200 python3 bench.py --section=kernel --out=$R/k > $R/k.txt 2>&1; stamp k $?
 timeout $(left) python3 bench.py --section=train_profile --lengths=2048 --out=$R/tp > $R/tp.txt 2>&1; stamp tp $?) &
export CUDA_VISIBLE_DEVICES=0
timeout 150 python3 test_gpu.py --cases=0,1 --out=$R/tg > $R/tg.txt 2>&1; stamp tg $?
timeout 60 python3 bench.py --section=decode_profile --batch=1,64 --out=$R/dp > $R/dp.txt 2>&1; stamp dp $?
timeout $(left) python3 bench.py --section=generate --compile_infer=0,1 --out=$R/gen > $R/gen.txt 2>&1; stamp gen $?
wait
tar czf $OUT/b.tgz -C /tmp b
cat $R/gpus.txt; grep -h "all passed\|FAILED\|decode block\|decode mixer\|CUDA graph\|^| 2 | 1" $R/tg.txt | head -24
grep -h "^|" $R/dp/bench.md | head -12; grep -h "^\[" $R/gen.txt; grep -h "^|" $R/k/bench.md; grep -h "^|" $R/tp/bench.md | head -40
