# Language modelling on Python's standard library sources (GPT-2 BPE, ~13.8M train tokens, offline), the
# KLA / GDN / attention comparison: the same model, data, token budget and hyper-parameters for each mixer.
# 1000 iterations x 32 x 512 = 16.4M tokens, about 1.2 passes over the training split.
# $ python prepare_data.py --dataset=python_stdlib
# $ python train.py config/python_stdlib.py --mixer=kla --seed=1 --out_dir=out-stdlib-kla-1
# $ python evaluate.py --out_dir=out-stdlib-kla-1 --factors=1,2,4,8,16   # loss beyond the context
# Each file its own document (states, convolutions and attention reset at every file, the same tokens):
# $ python train.py config/python_stdlib.py --mixer=kla --documents=True --out_dir=out-stdlib-kla-docs
# $ python evaluate.py --out_dir=out-stdlib-kla-docs --documents=True --factors=1,2,4

out_dir = "out-stdlib"
dataset = "python_stdlib"
block_size = 512
batch_size = 32
gradient_accumulation_steps = 1

n_layer = 6
n_head = 6
n_embd = 384
mixer = "kla"

learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 100
max_iters = 1000
lr_decay_iters = 1000
beta2 = 0.95
weight_decay = 0.1

eval_interval = 200
eval_iters = 50
always_save_checkpoint = False
sample_tokens = 300
