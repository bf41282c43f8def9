#!/bin/bash
# Session 8, run D (nvidia-h200-x2, one call, ~270 s), after run C: the split mixer's epilogues cheaper:
# _decode_in_proj_kernel finds each row's convolution buffer and weights by pointer (one convolution step,
# its loads requested with the weights before the PDL wait) and the state kernel writes each value block's
# sum of squares, from which _decode_out_proj_kernel takes each head's RMSNorm (no per-head reductions).
# GPU 0: the KLA decoding rows (compiled + CUDA graph), then the float64 checks (test_gpu.py cases 0 and 1).
# GPU 1: the CUDA-graph rows without compile, the step's profile, the kernel's anchor rows against fla.
# Results are written straight under $OUT, so that a cut call still returns what finished.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=$OUT/d; mkdir -p $R; T0=$(date +%s); END=420
left() { echo $(( END - ($(date +%s) - T0) )); }
stamp() { echo "$1 $2 at $(( $(date +%s) - T0 ))" >> $R/gpus.txt; }
nvidia-smi -L > $R/gpus.txt
(export CUDA_VISIBLE_DEVICES=1
 timeout 60 python3 bench.py --section=generate --compile_infer=0 --mixers=kla --out=$R/gen0 > $R/gen0.txt 2>&1; stamp gen0 $?
 timeout 60 python3 bench.py --section=decode_profile --batch=1 --out=$R/dp > $R/dp.txt 2>&1; stamp dp $?
 timeout $(left) python3 bench.py --section=kernel --out=$R/k > $R/k.txt 2>&1; stamp k $?) &
export CUDA_VISIBLE_DEVICES=0
timeout 120 python3 bench.py --section=generate --compile_infer=1 --mixers=kla --out=$R/gen1 > $R/gen1.txt 2>&1; stamp gen1 $?
timeout 200 python3 test_gpu.py --cases=0,1 --out=$R/tg > $R/tg.txt 2>&1; stamp tg $?
wait
cat $R/gpus.txt; grep -h "all passed\|FAILED\|decode block\|decode mixer\|CUDA graph\|^| 2 | 1" $R/tg.txt | head -24
grep -h "^\[" $R/gen1.txt $R/gen0.txt; grep -h "^|" $R/dp/bench.md | head -12; grep -h "^|" $R/k/bench.md
