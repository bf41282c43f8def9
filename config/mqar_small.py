# A CPU-sized MQAR to check the recall pipeline in minutes: 8 pairs in 128 tokens, vocabulary 256 (keys from
# [0, 128), values from [128, 256)), a 2-layer model of width 64; otherwise the protocol of config/mqar.py.
# $ python prepare_data.py --dataset=mqar_small
# $ python train.py config/mqar_small.py --mixer=kla --out_dir=out-mqar-small-kla
# $ python evaluate.py --out_dir=out-mqar-small-kla                 # accuracy at 128, 256, 512, 1024

import os

exec(open(os.path.join(os.path.dirname(__file__), "mqar.py")).read())  # the rest as for MQAR
out_dir = "out-mqar-small"
dataset = "mqar_small"
block_size = 128
n_head = 2
n_embd = 64  # d_k = 24, d_v = 48 per head
mlp_hidden = 256
max_iters = 3000
eval_interval = 250
eval_iters = 20
