#!/bin/bash
# Session 8, run A (nvidia-h200-x2, one call, ~540 s).
# GPU 0: branch decode-split (batch-1 decoding's mixer as three kernels: input projection + short convolutions,
# the state step over value blocks, the heads' RMSNorm and gate + output projection + residual): the float64
# checks (test_gpu.py case 0: the chunk kernel bf16, forward and every gradient; case 1: T = 1; then the step
# kernel, the decoding mixer / block, the whole model decoding), the decoding step's profile, the KLA decoding
# rows, then decode_linear's sweep (bench.py --section=tune_decode) for its config.
# GPU 1: a compiled run resumed on a GPU after session 7's fix (train.py reads the checkpoint on the CPU), then
# the compiled training rows of attention, KLA, GDN and fla's GatedDeltaNet LM after session 6's padding.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=/tmp/a; mkdir -p $R; T0=$(date +%s); END=570
left() { echo $(( END - ($(date +%s) - T0) )); }
stamp() { echo "$1 $2 at $(( $(date +%s) - T0 ))" >> $R/gpus.txt; }
nvidia-smi -L > $R/gpus.txt
(export CUDA_VISIBLE_DEVICES=1
 python3 prepare_data.py --dataset=sniah --data_dir=/tmp/d --n_train=2000 > /dev/null 2>&1
 A="config/sniah.py --mixer=kla --out_dir=/tmp/r --data_dir=/tmp/d --eval_interval=50 --eval_iters=4 --always_save_checkpoint=True"
 timeout 100 python3 train.py $A --compile=True --max_iters=100 > $R/resume1.txt 2>&1; echo "exit $?" >> $R/resume1.txt
 timeout 100 python3 train.py $A --compile=True --max_iters=150 --init_from=resume > $R/resume2.txt 2>&1; echo "exit $?" >> $R/resume2.txt
 stamp resume 0
 timeout $(left) python3 bench.py --section=train --compile=1 --out=$R/train > $R/train.txt 2>&1; stamp train $?) &
export CUDA_VISIBLE_DEVICES=0
timeout 200 python3 test_gpu.py --cases=0,1 --out=$R/tg > $R/tg.txt 2>&1; stamp tg $?
timeout 60 python3 bench.py --section=decode_profile --batch=1,64 --out=$R/dp > $R/dp.txt 2>&1; stamp dp $?
timeout 100 python3 bench.py --section=generate --compile_infer=1 --mixers=kla --out=$R/gen > $R/gen.txt 2>&1; stamp gen $?
timeout $(left) python3 bench.py --section=tune_decode --out=$R/td > $R/td.txt 2>&1; stamp td $?
wait
tar czf $OUT/a.tgz -C /tmp a
cat $R/gpus.txt; grep -h "all passed\|FAILED\|decode block\|decode mixer\|CUDA graph\|^| 2 | 1" $R/tg.txt | head -24
grep -h "^|" $R/dp/bench.md | head -14; grep -h "^\[" $R/gen.txt; grep -h "^\[" $R/train.txt
tail -n 3 $R/resume1.txt; tail -n 6 $R/resume2.txt; grep -h "^\[" $R/td.txt | head -150
