#!/bin/bash
# For the next session (issue 5): S-NIAH with 200k examples to its full 10,000 steps, compiled, 9 runs over
# both GPUs of nvidia-h200-x2. Run this same command in two (or three) back-to-back calls on one warm machine
# (the helper must start the next call within the 30 s idle release): out-exp-sniah200k/ is ignored by git,
# so the machine keeps it between calls; runs stopped by the deadline are left unevaluated
# (--eval_stopped=False) and the next call resumes them from their checkpoints. An estimate from MQAR's
# compiled speed-up: ~13 minutes of training in all.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=/tmp/s; mkdir -p $R; T0=$(date +%s)
python3 experiments.py --tasks=sniah --jobs=9 --data_dir=data-200k --n_train=200000 --deadline=480 \
    --eval_stopped=False --root=out-exp-sniah200k --results_dir=$R/sniah_200k_full \
    "--train_args=--compile=True" > $R/sniah.txt 2>&1
echo "done after $(( $(date +%s) - T0 )) s" >> $R/sniah.txt
mkdir -p $R/logs; for d in out-exp-sniah200k/*; do n=$(basename $d); mkdir -p $R/logs/$n
  cp $d/log.jsonl $d/eval.json $R/logs/$n/ 2>/dev/null; done
tar czf $OUT/s.tgz -C /tmp s
tail -n 16 $R/sniah.txt
