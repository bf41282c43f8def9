#!/bin/bash
# Session 5, run B (nvidia-h200-x2). GPU 1 (issue 3): test_gpu.py on the changed forward (O0 written into o)
# and on the alternative paths (--paths=alt), then bench.py's tune_seq section at (1, 32768, 16, 128) and
# (8, 4096, 16, 128). GPU 0 (issue 4): the compiled training rows with fla's GatedDeltaNet LM timed first in
# the same run, then the profile of one KLA training step at 2048.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=/tmp/b; mkdir -p $R; T0=$(date +%s)
nvidia-smi -L > $R/gpus.txt
(CUDA_VISIBLE_DEVICES=1 timeout 170 python3 test_gpu.py --cases=0,2,6,3 --paths=default,alt --out=$R/tg > $R/tg.txt 2>&1
 CUDA_VISIBLE_DEVICES=1 timeout 220 python3 bench.py --section=tune_seq --shapes=0 --out=$R/ts0 > $R/ts0.txt 2>&1
 LEFT=$(( 580 - ($(date +%s) - T0) ))
 CUDA_VISIBLE_DEVICES=1 timeout $LEFT python3 bench.py --section=tune_seq --shapes=1 --out=$R/ts1 > $R/ts1.txt 2>&1) &
CUDA_VISIBLE_DEVICES=0 timeout 420 python3 bench.py --section=train --compile=1 --out=$R/train > $R/train.txt 2>&1
LEFT=$(( 575 - ($(date +%s) - T0) ))
CUDA_VISIBLE_DEVICES=0 timeout $LEFT python3 bench.py --section=train_profile --out=$R/tp > $R/tp.txt 2>&1
wait
echo "done after $(( $(date +%s) - T0 )) s" >> $R/gpus.txt
tar czf $OUT/b.tgz -C /tmp b
cat $R/gpus.txt; tail -c 1500 $R/train.txt; tail -c 1200 $R/tp.txt; tail -c 1500 $R/tg.txt; tail -n 40 $R/ts0.txt; tail -n 20 $R/ts1.txt
