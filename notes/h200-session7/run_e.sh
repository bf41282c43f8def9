#!/bin/bash
# Session 7, run E (nvidia-h200-x2, one call, ~450 s).
# GPU 0 (issue 4): the batch-1 fused block (kernel.decode_linear around the mixer kernel) and the mixer kernel's
# one-tile path checked against float64 (test_gpu.py case 0: the chunk kernel bf16, forward and every
# gradient; the step kernel; the fused mixer and block; the whole model decoding, batch 2 and 1, plain and
# compiled), then the KLA decoding rows and the decoding step's profile.
# GPU 1 (issue 5): S-NIAH 200k, the three runs the deadline cut in calls 2-3 (kla 1, kla 3, gdn 2), from scratch;
# beside them a compiled S-NIAH run to a checkpoint and resumed (in call 3 three resumed runs exited with code 1
# within 10 s; their stdout was not kept).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=/tmp/e; mkdir -p $R; T0=$(date +%s); END=440
left() { echo $(( END - ($(date +%s) - T0) )); }
stamp() { echo "$1 $2 at $(( $(date +%s) - T0 ))" >> $R/gpus.txt; }
nvidia-smi -L > $R/gpus.txt
(python3 prepare_data.py --dataset=sniah --data_dir=data-200k --n_train=200000 > $R/prep.txt 2>&1; stamp prep $?
(python3 experiments.py --tasks=sniah --mixers=kla --seeds=1,3 --jobs=2 --gpus=1 --data_dir=data-200k \
    --deadline=$(( $(left) - 40 )) --root=out-exp-sniah200k --results_dir=$R/sniah_kla "--train_args=--compile=True" \
    > $R/sniah_kla.txt 2>&1; stamp sniah_kla $?) &
(python3 experiments.py --tasks=sniah --mixers=gdn --seeds=2 --jobs=1 --gpus=1 --data_dir=data-200k \
    --deadline=$(( $(left) - 40 )) --root=out-exp-sniah200k --results_dir=$R/sniah_gdn "--train_args=--compile=True" \
    > $R/sniah_gdn.txt 2>&1; stamp sniah_gdn $?) &
wait) &
# the resume on GPU 1 beside them: a compiled S-NIAH run to a checkpoint, then resumed (stdout kept)
(export CUDA_VISIBLE_DEVICES=1
 python3 prepare_data.py --dataset=sniah --data_dir=/tmp/d --n_train=2000 > /dev/null 2>&1
 A="config/sniah.py --mixer=kla --out_dir=/tmp/r --data_dir=/tmp/d --eval_interval=50 --eval_iters=4 --always_save_checkpoint=True"
 timeout 120 python3 train.py $A --compile=True --max_iters=100 > $R/resume1.txt 2>&1; echo "exit $?" >> $R/resume1.txt
 timeout 120 python3 train.py $A --compile=True --max_iters=150 --init_from=resume > $R/resume2.txt 2>&1; echo "exit $?" >> $R/resume2.txt
 timeout 90 python3 train.py $A --compile=False --max_iters=200 --init_from=resume > $R/resume3.txt 2>&1; echo "exit $?" >> $R/resume3.txt
 stamp resume 0) &
export CUDA_VISIBLE_DEVICES=0
timeout 170 python3 test_gpu.py --cases=0 --out=$R/tg > $R/tg.txt 2>&1; stamp tg $?
timeout 100 python3 bench.py --section=generate --compile_infer=0,1 --mixers=kla --out=$R/gen > $R/gen.txt 2>&1; stamp gen $?
timeout 60 python3 bench.py --section=decode_profile --batch=1,64 --out=$R/dp > $R/dp.txt 2>&1; stamp dp $?
wait
for d in out-exp-sniah200k/*; do n=$(basename $d); mkdir -p $R/logs/$n
  cp $d/log.jsonl $d/eval.json $d/stdout.txt $R/logs/$n/ 2>/dev/null; done
tar czf $OUT/e.tgz -C /tmp e
cat $R/gpus.txt; grep -h "all passed\|FAILED\|decode mixer\|decode block\|CUDA graph\|step B\|^| 2 | 1000" $R/tg.txt | head -24
grep -h "^|" $R/gen/bench.md $R/dp/bench.md 2>/dev/null | head -40
tail -n 4 $R/resume1.txt; tail -n 12 $R/resume2.txt; tail -n 4 $R/resume3.txt; tail -n 9 $R/sniah_kla.txt $R/sniah_gdn.txt
