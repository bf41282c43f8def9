# GPT-2 small width (12 layers, 768 wide, 1024-token context) on the FineWeb-Edu sample, for one node
# of 8 GPUs. Prepare the data first (online):
# $ python prepare_data.py --dataset=fineweb_edu --max_tokens=1000000000
# $ torchrun --standalone --nproc_per_node=8 train.py config/train_fineweb_edu.py

out_dir = "out-fineweb-edu"
dataset = "fineweb_edu"
eval_interval = 500
eval_iters = 100
log_interval = 10
always_save_checkpoint = True

# 16 sequences x 1024 tokens x 32 micro-batches = ~0.5M tokens per iteration, over all processes
batch_size = 16
block_size = 1024
gradient_accumulation_steps = 4 * 8

n_layer = 12
n_head = 6  # per head 96 key and 192 value dimensions (expand_k 0.75, expand_v 1.5)
n_embd = 768
mixer = "kla"

learning_rate = 6e-4
max_iters = 2000  # ~1B tokens
lr_decay_iters = 2000
min_lr = 6e-5
beta2 = 0.95
warmup_iters = 100
weight_decay = 0.1
