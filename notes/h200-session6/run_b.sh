#!/bin/bash
# Session 6, run B (nvidia-h200-x2), issue 5. MQAR with 200k training examples to its full 10,000 steps (9 runs
# over both GPUs, compiled: session 4's eager runs reached 5750-6000 steps in 440 s with 18 processes), and
# KLA / GDN at lr 4e-3, seed 3, on GPU 1 (seeds 1 and 2 in run A).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=/tmp/b; mkdir -p $R; T0=$(date +%s)
nvidia-smi -L > $R/gpus.txt
python3 prepare_data.py --dataset=mqar --n_train=200000 --data_dir=data-200k > $R/prep.txt 2>&1
python3 experiments.py --tasks=lm --mixers=kla,gdn --seeds=3 --jobs=2 --gpus=1 --deadline=450 \
    --root=out-exp-lr4e-3 --results_dir=$R/lm_lr4e-3 --train_args=--learning_rate=4e-3 > $R/lm.txt 2>&1 &
python3 experiments.py --tasks=mqar --jobs=9 --deadline=470 --root=out-exp-mqar200k --results_dir=$R/n_train_200k \
    "--train_args=--data_dir=data-200k --compile=True" > $R/mqar.txt 2>&1
wait
echo "done after $(( $(date +%s) - T0 )) s" >> $R/gpus.txt
mkdir -p $R/logs; for d in out-exp-mqar200k/* out-exp-lr4e-3/*; do n=$(basename $d); mkdir -p $R/logs/$n
  cp $d/log.jsonl $d/eval.json $d/stdout.txt $R/logs/$n/ 2>/dev/null; tail -c 3000 $d/eval.txt > $R/logs/$n/eval.txt 2>/dev/null; done
tar czf $OUT/b.tgz -C /tmp b
cat $R/gpus.txt; tail -n 14 $R/mqar.txt; tail -n 10 $R/lm.txt
