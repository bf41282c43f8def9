#!/bin/bash
# Session 4, last device call (nvidia-h200-x2): issue 4's whole-model rows on the final model code, the
# whole-model decode check of test_gpu.py, then issue 5's learning-rate sweep for the LM runs.
# GPU 0: training rows (bench.py train, eager + compiled + fla's LM). GPU 1: test_gpu.py (one chunk case,
# the decode steps, the whole model decoding), then prefill and decoding rows. Then both GPUs: the sweep.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=/tmp/c; mkdir -p $R; T0=$(date +%s)
nvidia-smi -L > $R/gpus.txt
(CUDA_VISIBLE_DEVICES=1 timeout 150 python3 test_gpu.py --cases=0 --out=$R/tg > $R/tg.txt 2>&1
 CUDA_VISIBLE_DEVICES=1 timeout 240 python3 bench.py --section=prefill,generate --compile_infer=0,1 --out=$R/inf > $R/inf.txt 2>&1) &
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 bench.py --section=train --compile=0,1 --out=$R/train > $R/train.txt 2>&1
wait
echo "benches done after $(( $(date +%s) - T0 )) s" >> $R/gpus.txt
LEFT=$(( 585 - ($(date +%s) - T0) ))   # seconds left for the sweep, its evaluation included
DL=$(( LEFT - 60 ))
SW="--tasks=lm --seeds=1 --jobs=3 --deadline=$DL --eval_args=--factors=1"
ARGS="--max_iters=500 --lr_decay_iters=500 --eval_interval=100"
if [ $DL -gt 90 ]; then
  python3 experiments.py $SW --gpus=0 --root=$R/lr5e-4 --results_dir=$R/lr5e-4 "--train_args=$ARGS --learning_rate=5e-4" > $R/lr5e-4.txt 2>&1 &
  python3 experiments.py $SW --gpus=1 --root=$R/lr2e-3 --results_dir=$R/lr2e-3 "--train_args=$ARGS --learning_rate=2e-3" > $R/lr2e-3.txt 2>&1 &
  python3 experiments.py $SW --gpus=0,1 --root=$R/lr1e-3 --results_dir=$R/lr1e-3 "--train_args=$ARGS --learning_rate=1e-3" > $R/lr1e-3.txt 2>&1 &
  wait
fi
find $R -name "ckpt.pt*" -delete
tar czf $OUT/c.tgz -C /tmp c
tail -c 1500 $R/train.txt; tail -c 2500 $R/inf.txt; tail -c 1200 $R/tg.txt; tail -n 8 $R/lr*.txt
