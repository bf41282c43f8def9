#!/bin/bash
# For the next session, after `git am -3 notes/decode-split.mbox` (branch decode-split): batch-1 decoding with
# the mixer in three kernels (input projection + short convolutions; the state step over value blocks, 36
# programs instead of 6; the heads' RMSNorm and gate + output projection + residual) and decode_linear
# requesting its weights before its input. One call on nvidia-h200, about 330 s. Merge if the checks pass and
# batch 1 is faster than run F's 2,328 tokens/s (0.430 ms). Then the decode_linear sweep for its config.
R=/tmp/d; mkdir -p $R; T0=$(date +%s)
stamp() { echo "$1 $2 at $(( $(date +%s) - T0 ))" >> $R/gpus.txt; }
nvidia-smi -L > $R/gpus.txt
timeout 200 python3 test_gpu.py --cases=1 --out=$R/tg > $R/tg.txt 2>&1; stamp tg $?
timeout 60 python3 bench.py --section=decode_profile --batch=1,64 --out=$R/dp > $R/dp.txt 2>&1; stamp dp $?
timeout 100 python3 bench.py --section=generate --compile_infer=1 --mixers=kla --out=$R/gen > $R/gen.txt 2>&1; stamp gen $?
timeout 150 python3 bench.py --section=tune_decode --out=$R/td > $R/td.txt 2>&1; stamp td $?
tar czf $OUT/d.tgz -C /tmp d
cat $R/gpus.txt; grep -h "all passed\|FAILED\|decode block\|CUDA graph" $R/tg.txt | head -16
grep -h "^|" $R/dp/bench.md | head -14; grep -h "^\[" $R/gen.txt; grep -h "^\[" $R/td.txt | head -130
