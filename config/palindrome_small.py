# A CPU-sized palindrome task to check the pipeline in minutes: vocabulary 32 (SEP 31), trained at 64 tokens
# (32 to reverse), accuracy at 16 .. 128; the model of config/mqar_small.py.
# $ python prepare_data.py --dataset=palindrome_small
# $ python train.py config/palindrome_small.py --mixer=kla --out_dir=out-palindrome-small-kla
# $ python evaluate.py --out_dir=out-palindrome-small-kla

import os

exec(open(os.path.join(os.path.dirname(__file__), "mqar_small.py")).read())  # the rest as for the small MQAR
out_dir = "out-palindrome-small"
dataset = "palindrome_small"
block_size = 64
