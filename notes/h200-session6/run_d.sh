#!/bin/bash
# Session 6, run D (nvidia-h200-x2), issue 4, after the KLA layer's input projection was padded to a multiple
# of 8 outputs (3468 -> 3472). GPU 0: prefill rows compiled with the forward's output fused (default) and
# split (--fuse_o=0), the 128K prefill profile, then test_gpu.py's decoding checks (the fused decoding kernel
# now reads the padded projection). GPU 1: training at 2048 and 8192, attention and KLA, compiled.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=/tmp/d; mkdir -p $R; T0=$(date +%s); END=330
left() { echo $(( END - ($(date +%s) - T0) )); }
stamp() { echo "$1 $2 at $(( $(date +%s) - T0 ))" >> $R/gpus.txt; }
nvidia-smi -L > $R/gpus.txt
(CUDA_VISIBLE_DEVICES=1 timeout $(left) python3 bench.py --section=train --lengths=2048,8192 --mixers=attn,kla \
    --compile=1 --fla_lm=0 --out=$R/tr > $R/tr.txt 2>&1; stamp tr $?) &
export CUDA_VISIBLE_DEVICES=0
timeout 90 python3 bench.py --section=prefill --compile_infer=1 --out=$R/pre1 > $R/pre1.txt 2>&1; stamp pre1 $?
timeout 90 python3 bench.py --section=prefill --compile_infer=1 --fuse_o=0 --out=$R/pre0 > $R/pre0.txt 2>&1; stamp pre0 $?
timeout 40 python3 bench.py --section=prefill_profile --mixers=kla --out=$R/pp > $R/pp.txt 2>&1; stamp pp $?
timeout $(left) python3 test_gpu.py --cases=1 --out=$R/tg > $R/tg.txt 2>&1; stamp tg $?
wait
echo "done after $(( $(date +%s) - T0 )) s" >> $R/gpus.txt
tar czf $OUT/d.tgz -C /tmp d
cat $R/gpus.txt; grep -h "all passed\|FAILED\|decode mixer\|CUDA graph" $R/tg.txt | head; grep -h "^|" $R/pre1/bench.md $R/pre0/bench.md $R/pp/bench.md $R/tr/bench.md 2>/dev/null | head -80
