# Multi-query associative recall with the KLA authors' protocol (see prepare_data.recall_examples):
# sequences of 256 tokens, 32 key-value pairs, vocabulary 8192; a 2-layer model of width 256 (4 heads,
# SwiGLU 1024); AdamW at a constant 1e-3, betas (0.9, 0.95), weight decay 0.1, clip 1.0, batch 32, at most
# 10k steps, validation every 200, early stop after 10 validations without improvement; seed 42.
# $ python prepare_data.py --dataset=mqar
# $ python train.py config/mqar.py --mixer=kla --out_dir=out-mqar-kla     # or --mixer=gdn / attn
# $ python evaluate.py --out_dir=out-mqar-kla                            # accuracy at 1x, 2x, 4x, 8x

out_dir = "out-mqar"
dataset = "mqar"
block_size = 256  # the examples' length
batch_size = 32
gradient_accumulation_steps = 1

n_layer = 2
n_head = 4
n_embd = 256  # d_k = 0.75 * 256 / 4 = 48 and d_v = 96 per head
mlp_hidden = 1024
mixer = "kla"

learning_rate = 1e-3
decay_lr = False  # constant
warmup_iters = 0
beta1 = 0.9
beta2 = 0.95
weight_decay = 0.1
grad_clip = 1.0

max_iters = 10_000
eval_interval = 200
eval_iters = 63  # ~2000 validation examples (batches of 32 drawn at random)
patience = 10
always_save_checkpoint = False  # ckpt.pt is the best model by validation loss
log_interval = 50
sample_tokens = 0
seed = 42
