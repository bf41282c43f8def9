#!/bin/bash
# Session 5, run A (nvidia-h200-x2): issue 5's tuned LM rerun, 3 mixers x 3 seeds at lr 2e-3 for the full
# 1000 iterations (9 processes over both GPUs), and beside it the learning-rate grid's next point, 4e-3
# (seed 1, 500 iterations, as session 4's sweep), 3 more processes. Outputs tarred into $OUT/a.tgz.
R=/tmp/a; mkdir -p $R; T0=$(date +%s)
nvidia-smi -L > $R/gpus.txt
SW="--tasks=lm --seeds=1 --jobs=3 --deadline=470 --eval_args=--factors=1"
ARGS="--max_iters=500 --lr_decay_iters=500 --eval_interval=100 --learning_rate=4e-3"
python3 experiments.py $SW --root=$R/lr4e-3 --results_dir=$R/lr4e-3 "--train_args=$ARGS" > $R/lr4e-3.txt 2>&1 &
python3 experiments.py --tasks=lm --jobs=9 --deadline=470 --root=$R/lr2e-3 --results_dir=$R/lm_lr2e-3 \
    --train_args=--learning_rate=2e-3 > $R/lm.txt 2>&1
wait
echo "done after $(( $(date +%s) - T0 )) s" >> $R/gpus.txt
find $R -name "ckpt.pt*" -delete
tar czf $OUT/a.tgz -C /tmp a
cat $R/gpus.txt; tail -n 25 $R/lm.txt; tail -n 8 $R/lr4e-3.txt
