#!/bin/bash
# Session 5, run D (nvidia-h200-x2), the last device time. GPU 1 (issue 3): test_gpu.py on the final kernel.py
# (3 pipeline stages and the split output for few programs, 1-warp prep at K = 128), then the kernel rows
# against fla in the same run. GPU 0: the compiled training profile at 2048 (issue 4), then tune_seq at
# (8, 4096, 16, 128) for the next session (restarted after a variant that faults).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=/tmp/d; mkdir -p $R; T0=$(date +%s); END=325
nvidia-smi -L > $R/gpus.txt
(CUDA_VISIBLE_DEVICES=1 timeout 100 python3 test_gpu.py --cases=0,2,6,1,5,10 --out=$R/tg > $R/tg.txt 2>&1
 CUDA_VISIBLE_DEVICES=1 timeout $(( END - ($(date +%s) - T0) )) python3 bench.py --section=kernel --out=$R/k > $R/k.txt 2>&1) &
CUDA_VISIBLE_DEVICES=0 timeout 110 python3 bench.py --section=train_profile --out=$R/tp > $R/tp.txt 2>&1
S=0
while [ -n "$S" ] && [ $(( $(date +%s) - T0 )) -lt $(( END - 30 )) ]; do
  CUDA_VISIBLE_DEVICES=0 timeout $(( END - ($(date +%s) - T0) )) python3 bench.py --section=tune_seq --shapes=1 --start=$S --out=$R/ts_$S > $R/ts_$S.txt 2>&1
  S=$(grep -o "RESTART_AT=[0-9]*" $R/ts_$S.txt | tail -1 | cut -d= -f2)
done
wait
echo "done after $(( $(date +%s) - T0 )) s" >> $R/gpus.txt
tar czf $OUT/d.tgz -C /tmp d
cat $R/gpus.txt; grep "^\['" $R/k.txt; grep "all passed\|FAILED" $R/tg.txt; grep -h "^\['\|RESTART" $R/ts_*.txt | head -40; grep "^\[" $R/tp.txt | head -40
