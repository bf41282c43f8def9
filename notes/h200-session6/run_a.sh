#!/bin/bash
# Session 6, run A (nvidia-h200-x2). GPU 0 (issue 4): the fused decoding kernel (branch decode-fused, merged
# on trust of the interpreter tests) checked against float64 (test_gpu.py: the chunk kernel bf16 / fp32, the
# step kernel, the fused mixer in the layer, the whole model decoding fused / unfused / compiled), then the
# decoding rows fused and unfused, then the prefill rows with session 5's kernel. GPU 1 (issue 5): KLA and GDN
# at lr 4e-3, seeds 1 and 2 (seed 3 in run B), in out-exp-lr4e-3 (kept on a warm machine).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=/tmp/a; mkdir -p $R; T0=$(date +%s); END=545
left() { echo $(( END - ($(date +%s) - T0) )); }
nvidia-smi -L > $R/gpus.txt
python3 experiments.py --tasks=lm --mixers=kla,gdn --seeds=1,2 --jobs=4 --gpus=1 --deadline=440 \
    --root=out-exp-lr4e-3 --results_dir=$R/lm_lr4e-3 --train_args=--learning_rate=4e-3 > $R/lm.txt 2>&1 &
export CUDA_VISIBLE_DEVICES=0
timeout 200 python3 test_gpu.py --cases=0,3 --out=$R/tg > $R/tg.txt 2>&1; echo "tg $? at $(( $(date +%s) - T0 ))" >> $R/gpus.txt
timeout $(left) python3 bench.py --section=generate --compile_infer=0,1 --out=$R/gen > $R/gen.txt 2>&1
echo "gen $? at $(( $(date +%s) - T0 ))" >> $R/gpus.txt
timeout $(left) python3 bench.py --section=generate --compile_infer=0,1 --mixers=kla --decode_fused=0 --out=$R/gen0 > $R/gen0.txt 2>&1
echo "gen0 $? at $(( $(date +%s) - T0 ))" >> $R/gpus.txt
timeout $(left) python3 bench.py --section=prefill --compile_infer=1,0 --out=$R/pre > $R/pre.txt 2>&1
echo "pre $? at $(( $(date +%s) - T0 ))" >> $R/gpus.txt
wait
echo "done after $(( $(date +%s) - T0 )) s" >> $R/gpus.txt
mkdir -p $R/logs; for d in out-exp-lr4e-3/*; do n=$(basename $d); mkdir -p $R/logs/$n; cp $d/log.jsonl $d/eval.json $d/stdout.txt $R/logs/$n/ 2>/dev/null; done
tar czf $OUT/a.tgz -C /tmp a
cat $R/gpus.txt; grep -h "all passed\|FAILED\|decode mixer\|CUDA graph\|step B" $R/tg.txt | head -20
grep -h "^|" $R/gen/bench.md $R/gen0/bench.md $R/pre/bench.md 2>/dev/null; tail -n 12 $R/lm.txt
