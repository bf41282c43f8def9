# The stack task of the KLA paper (prepare_data.stack_examples): triples `PUSH id val` / `POP id ?` over 64
# stacks, vocabulary 128, trained at 1024 tokens, accuracy at each `?` (the value that POP removes) at 256,
# 512, 1024 and 2048 tokens. The synthetic model and training of config/mqar.py (2 layers, width 256, 4 heads,
# d_k 48 / d_v 96 a head, SwiGLU 1024; AdamW at a constant 1e-3, batch 32, at most 10k steps, early stopping).
# $ python prepare_data.py --dataset=stack
# $ python train.py config/stack.py --mixer=kla --out_dir=out-stack-kla     # or --mixer=gdn / attn
# $ python evaluate.py --out_dir=out-stack-kla

import os

exec(open(os.path.join(os.path.dirname(__file__), "mqar.py")).read())  # the rest as for MQAR
out_dir = "out-stack"
dataset = "stack"
block_size = 1024
