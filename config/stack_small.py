# A CPU-sized stack task to check the pipeline in minutes: 8 stacks, vocabulary 32 (ids 0-7, values 8-28,
# PUSH 29, POP 30, ? 31), trained at 128 tokens, accuracy at 32 .. 256; the model of config/mqar_small.py.
# $ python prepare_data.py --dataset=stack_small
# $ python train.py config/stack_small.py --mixer=kla --out_dir=out-stack-small-kla
# $ python evaluate.py --out_dir=out-stack-small-kla

import os

exec(open(os.path.join(os.path.dirname(__file__), "mqar_small.py")).read())  # the rest as for the small MQAR
out_dir = "out-stack-small"
dataset = "stack_small"
block_size = 128
