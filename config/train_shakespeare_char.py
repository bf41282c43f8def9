# A "baby" KLA model on shakespeare_char: nanoGPT's baby GPT shape (6 layers, 6 heads, 384 wide,
# 256-token context). This is what `python train.py` trains on a GPU; written out here so that the
# same run can be asked for on any device, and the mixers compared:
# $ python train.py config/train_shakespeare_char.py --mixer=gdn --out_dir=out-shakespeare-char-gdn

out_dir = "out-shakespeare-char"
eval_interval = 250  # evaluate often: a small model on a small set overfits
eval_iters = 100
log_interval = 10
always_save_checkpoint = False  # save only when the val loss improves

dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256  # characters of context

n_layer = 6
n_head = 6
n_embd = 384
mixer = "kla"

learning_rate = 1e-3  # small models can take a high learning rate
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4  # learning_rate / 10
beta2 = 0.99  # few tokens per iteration: a longer second-moment average
warmup_iters = 100
