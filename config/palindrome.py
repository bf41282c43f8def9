# The palindrome task of the KLA paper (prepare_data.palindrome_examples): `src SEP reverse(src)` over a
# vocabulary of 128, trained at 1024 tokens (512 to reverse), accuracy on the reversed half at 256, 512, 1024
# and 2048 tokens. The synthetic model and training of config/mqar.py (2 layers, width 256, 4 heads, d_k 48 /
# d_v 96 a head, SwiGLU 1024; AdamW at a constant 1e-3, batch 32, at most 10k steps, early stopping).
# $ python prepare_data.py --dataset=palindrome
# $ python train.py config/palindrome.py --mixer=kla --out_dir=out-palindrome-kla     # or --mixer=gdn / attn
# $ python evaluate.py --out_dir=out-palindrome-kla

import os

exec(open(os.path.join(os.path.dirname(__file__), "mqar.py")).read())  # the rest as for MQAR
out_dir = "out-palindrome"
dataset = "palindrome"
block_size = 1024
