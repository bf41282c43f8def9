#!/bin/bash
# For the next session, after `git am -3 notes/prefill-split.mbox` (branch prefill-split: kernel._fwd_fuse_o
# splits the output for long forward-only calls, N >= 256 chunks, when few programs run). One call on
# nvidia-h200-x2, about 330 s; merge only if the float64 cases pass and the kernel rows stay <= fla:
# GPU 1: the kernel rows against fla (the batch-1 forward-only rows change path) and the forward-only
# 131072-token cases against float64 on both paths; GPU 0: prefill rows (one pass and segments) twice, then
# the decoding step's GPU time by kernel (batch 1 and 64: how many kernels a token is, and which).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=/tmp/p; mkdir -p $R; T0=$(date +%s); END=330
left() { echo $(( END - ($(date +%s) - T0) )); }
stamp() { echo "$1 $2 at $(( $(date +%s) - T0 ))" >> $R/gpus.txt; }
nvidia-smi -L > $R/gpus.txt
(export CUDA_VISIBLE_DEVICES=1
 timeout 60 python3 test_gpu.py --cases=15,16,2 --paths=default,alt --out=$R/tg > $R/tg.txt 2>&1; stamp tg $?
 timeout $(left) python3 bench.py --section=kernel --out=$R/k > $R/k.txt 2>&1; stamp k $?) &
export CUDA_VISIBLE_DEVICES=0
for i in 1 2; do timeout 120 python3 bench.py --section=prefill --compile_infer=1 --out=$R/pre$i > $R/pre$i.txt 2>&1; stamp pre$i $?; done
timeout $(left) python3 bench.py --section=decode_profile --batch=1,64 --out=$R/dp > $R/dp.txt 2>&1; stamp dp $?
wait
tar czf $OUT/p.tgz -C /tmp p
cat $R/gpus.txt; grep -h "^| 1 | 131072\|^| 1 | 65536" $R/tg.txt; grep -h "^|" $R/k/bench.md $R/pre1/bench.md $R/pre2/bench.md $R/dp/bench.md
