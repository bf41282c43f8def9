# The S-NIAH proxy of the KLA paper: MQAR with one pair (key at 0, value at 1, one query later), trained
# at 1024 tokens, evaluated at 1024, 2048, 4096 and 8192. Everything else as config/mqar.py.
# $ python prepare_data.py --dataset=sniah
# $ python train.py config/sniah.py --mixer=kla --out_dir=out-sniah-kla
# $ python evaluate.py --out_dir=out-sniah-kla

import os

exec(open(os.path.join(os.path.dirname(__file__), "mqar.py")).read())  # the rest as for MQAR
out_dir = "out-sniah"
dataset = "sniah"
block_size = 1024
