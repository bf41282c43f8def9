#!/bin/bash
# Session 5, run C (nvidia-h200-x2), issue 3. GPU 1: bench.py tune_seq at (1, 32768, 16, 128), restarted after a
# variant that faults the GPU. GPU 0: more test_gpu.py cases on this kernel.py (O0 written into o), then the
# kernel rows against fla (the anchor) and the decode step, in the same run.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=/tmp/c; mkdir -p $R; T0=$(date +%s)
nvidia-smi -L > $R/gpus.txt
(S=0
 while [ -n "$S" ] && [ $(( $(date +%s) - T0 )) -lt 520 ]; do
   CUDA_VISIBLE_DEVICES=1 timeout $(( 560 - ($(date +%s) - T0) )) python3 bench.py --section=tune_seq --shapes=0 --start=$S --out=$R/ts_$S > $R/ts_$S.txt 2>&1
   S=$(grep -o "RESTART_AT=[0-9]*" $R/ts_$S.txt | tail -1 | cut -d= -f2)
 done) &
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 test_gpu.py --cases=1,5,8,9,10,11,12,23 --out=$R/tg > $R/tg.txt 2>&1
CUDA_VISIBLE_DEVICES=0 timeout $(( 565 - ($(date +%s) - T0) )) python3 bench.py --section=kernel,decode --out=$R/k > $R/k.txt 2>&1
wait
echo "done after $(( $(date +%s) - T0 )) s" >> $R/gpus.txt
tar czf $OUT/c.tgz -C /tmp c
cat $R/gpus.txt; grep -h "^\['\|RESTART" $R/ts_*.txt | head -60; grep "^\['" $R/k.txt; grep "^| \|all passed\|FAILED" $R/tg.txt | tail -12
