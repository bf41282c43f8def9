# Language modelling at GPT-2 small's size (12 layers, width 768; 6 heads: KLA / GDN d_k 96, d_v 192 a head) on
# the largest corpus this project builds offline: the standard library's and every installed package's Python
# sources, GPT-2 BPE, split by file (96.4M / 5.4M / 5.4M train / val / test tokens next to torch 2.13 and
# Python 3.11; meta.json records the numbers of the machine it ran on). One pass at most: 1500 iterations x 32 x
# 1024 = 49.2M tokens, each window of the training split used once (single_pass), so that no token is trained
# on twice; train.py refuses a max_iters that would need more.
# $ python prepare_data.py --dataset=python_code
# $ python train.py config/python_code.py --mixer=kla --seed=1 --out_dir=out-code-kla-1
# $ python evaluate.py --out_dir=out-code-kla-1 --factors=1,2,4,8
# $ python experiments.py --tasks=lm_large --mixers=kla,gdn,attn --seeds=1,2,3 --jobs=3   # the three, 3 seeds

out_dir = "out-code"
dataset = "python_code"
block_size = 1024
batch_size = 32
gradient_accumulation_steps = 1
single_pass = True

n_layer = 12
n_head = 6
n_embd = 768
mixer = "kla"
dropout = 0.0  # one pass over the data: nothing is seen twice to overfit

learning_rate = 1e-3  # choose it per mixer on val (--learning_rate): 350-iteration runs chose KLA 2e-3, GDN 4e-3,
#                        attention 5e-4 (the lowest tried) on an H200's corpus (results/lm_large/)
min_lr = 1e-4
warmup_iters = 100
max_iters = 1500
lr_decay_iters = 1500
beta2 = 0.95
weight_decay = 0.1
eval_interval = 250
eval_iters = 40
always_save_checkpoint = False
sample_tokens = 300
compile = True
