#!/bin/bash
# Session 8, run C (nvidia-h200-x2, one call, ~350 s): batch-1 decoding's four kernels (decode_linear and the
# split mixer's three) as programmatic dependent launches (kernel.DECODE_PDL: each requests its weights,
# then waits for the kernel before it, then lets the next one start).
# GPU 0: the float64 checks with PDL on (test_gpu.py cases 0 and 1: the chunk kernel bf16 forward and every
# gradient, T = 1, the step kernel, the decoding mixer / block, the whole model decoding, plain and compiled,
# batch 1 and 2, CUDA graph), the KLA decoding rows with and without PDL, the step's profile with PDL.
# GPU 1: the kernel's anchor rows against fla (bench.py --section=kernel; run B's was cut by its limit).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
R=/tmp/c; mkdir -p $R; T0=$(date +%s); END=560
left() { echo $(( END - ($(date +%s) - T0) )); }
stamp() { echo "$1 $2 at $(( $(date +%s) - T0 ))" >> $R/gpus.txt; }
nvidia-smi -L > $R/gpus.txt
python3 -c "
import torch, triton, triton.language as tl, kernel
from triton.backends.nvidia.compiler import CUDAOptions
print('torch', torch.__version__, 'triton', triton.__version__, 'gdc_wait', hasattr(tl.extra.cuda, 'gdc_wait'),
      'launch_pdl option', 'launch_pdl' in CUDAOptions.__dataclass_fields__, 'PDL used', kernel._pdl_device(0))
" >> $R/gpus.txt 2>&1
(export CUDA_VISIBLE_DEVICES=1
 timeout 330 python3 bench.py --section=kernel --out=$R/k > $R/k.txt 2>&1; stamp k $?
 timeout $(left) python3 bench.py --section=generate --compile_infer=0 --mixers=kla --out=$R/gen0 > $R/gen0.txt 2>&1; stamp gen0 $?) &
export CUDA_VISIBLE_DEVICES=0
timeout 100 python3 bench.py --section=generate --compile_infer=1 --mixers=kla --out=$R/gen1 > $R/gen1.txt 2>&1; stamp gen1 $?
timeout 100 python3 bench.py --section=generate --compile_infer=1 --mixers=kla --pdl=0 --out=$R/gen1n > $R/gen1n.txt 2>&1; stamp gen1n $?
timeout 210 python3 test_gpu.py --cases=0,1 --out=$R/tg > $R/tg.txt 2>&1; stamp tg $?
timeout $(left) python3 bench.py --section=decode_profile --batch=1 --out=$R/dp > $R/dp.txt 2>&1; stamp dp $?
wait
tar czf $OUT/c.tgz -C /tmp c
cat $R/gpus.txt; grep -h "all passed\|FAILED\|decode block\|decode mixer\|CUDA graph\|^| 2 | 1" $R/tg.txt | head -24
grep -h "^\[" $R/gen1.txt $R/gen1n.txt $R/gen0.txt; grep -h "^|" $R/dp/bench.md | head -12; grep -h "^|" $R/k/bench.md
tail -n 5 $R/k.txt $R/tg.txt
