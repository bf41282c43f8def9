#!/bin/bash
# Session 6, run C (nvidia-h200-x2). GPU 1 (issue 3's anchor, kernel.py changed by the merged decoding
# kernel): the kernel rows against fla in the same run. GPU 0 (issue 4): the split output for forward-only
# calls (test_gpu.py --paths=alt on the 131072-token forward-only cases against float64, then the prefill rows
# with the output fused / split, compiled), the prefill profile at 128K; then (issue 5) the learning-rate
# grid's next point for KLA and GDN, 8e-3 (seed 1, 500 iterations, as the 4e-3 point).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=/tmp/c; mkdir -p $R; T0=$(date +%s); END=540
left() { echo $(( END - ($(date +%s) - T0) )); }
stamp() { echo "$1 $2 at $(( $(date +%s) - T0 ))" >> $R/gpus.txt; }
nvidia-smi -L > $R/gpus.txt
(CUDA_VISIBLE_DEVICES=1 timeout $(left) python3 bench.py --section=kernel --out=$R/k > $R/k.txt 2>&1; stamp k $?) &
export CUDA_VISIBLE_DEVICES=0
timeout 100 python3 test_gpu.py --cases=15,16 --paths=alt --out=$R/tg > $R/tg.txt 2>&1; stamp tg $?
timeout 150 python3 bench.py --section=prefill --compile_infer=1 --out=$R/pre1 > $R/pre1.txt 2>&1; stamp pre1 $?
timeout 150 python3 bench.py --section=prefill --compile_infer=1 --fuse_o=0 --out=$R/pre0 > $R/pre0.txt 2>&1; stamp pre0 $?
timeout 120 python3 bench.py --section=prefill_profile --out=$R/pp > $R/pp.txt 2>&1; stamp pp $?
SW="--tasks=lm --mixers=kla,gdn --seeds=1 --jobs=2 --gpus=0 --deadline=$(( $(left) - 40 )) --eval_args=--factors=1"
ARGS="--max_iters=500 --lr_decay_iters=500 --eval_interval=100 --learning_rate=8e-3"
python3 experiments.py $SW --root=out-exp-lr8e-3 --results_dir=$R/lr8e-3 "--train_args=$ARGS" > $R/lr8e-3.txt 2>&1; stamp lr $?
wait
echo "done after $(( $(date +%s) - T0 )) s" >> $R/gpus.txt
mkdir -p $R/logs; for d in out-exp-lr8e-3/*; do n=$(basename $d); mkdir -p $R/logs/$n; cp $d/log.jsonl $d/eval.json $R/logs/$n/ 2>/dev/null; done
tar czf $OUT/c.tgz -C /tmp c
cat $R/gpus.txt; grep -h "all passed\|FAILED\|^| 1 " $R/tg.txt | head; grep -h "^|" $R/k/bench.md $R/pre1/bench.md $R/pre0/bench.md $R/pp/bench.md 2>/dev/null
tail -n 8 $R/lr8e-3.txt; grep -h val_loss $R/logs/*/log.jsonl | tail -n 12
