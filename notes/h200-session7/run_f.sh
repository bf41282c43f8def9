#!/bin/bash
# Session 7, run F (nvidia-h200, one call, ~260 s): after run E, the mixer kernel back to V in blocks of 64
# (its one-tile variant was slower) and the block check's projections at unit gain (run E's bf16 block check
# compared the block's output less its input, whose bf16 rounding alone is 1.4e-2 off float64 on the PyTorch
# path). The decoding checks against float64 (test_gpu.py case 1 and the decoding sections), the KLA decoding
# rows compiled, the decoding step's profile.
R=/tmp/f; mkdir -p $R; T0=$(date +%s)
stamp() { echo "$1 $2 at $(( $(date +%s) - T0 ))" >> $R/gpus.txt; }
nvidia-smi -L > $R/gpus.txt
timeout 130 python3 test_gpu.py --cases=1 --out=$R/tg > $R/tg.txt 2>&1; stamp tg $?
timeout 80 python3 bench.py --section=generate --compile_infer=1 --mixers=kla --out=$R/gen > $R/gen.txt 2>&1; stamp gen $?
timeout 50 python3 bench.py --section=decode_profile --batch=1,64 --out=$R/dp > $R/dp.txt 2>&1; stamp dp $?
tar czf $OUT/f.tgz -C /tmp f
cat $R/gpus.txt; grep -h "all passed\|FAILED\|decode mixer\|decode block\|CUDA graph\|step B\|^| 2 | 1 " $R/tg.txt | head -24
grep -h "^|" $R/gen/bench.md $R/dp/bench.md 2>/dev/null | head -40
