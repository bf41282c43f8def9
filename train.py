"""
Train a KLA language model (or its GDN / attention baselines). With no arguments this is the main job:
it prepares shakespeare_char if it is missing, trains a small KLA model sized for the device found
(a few minutes on a laptop CPU; a larger model on a GPU) and prints a sample.

$ python train.py
$ python train.py config/train_shakespeare_char.py --mixer=gdn --max_iters=1000
$ python train.py --init_from=resume                       # continue from out_dir/ckpt.pt
$ torchrun --standalone --nproc_per_node=8 train.py config/train_fineweb_edu.py   # DDP, one node

Resuming is exact: the batches of iteration i are a function of (seed, i, rank), and the checkpoint
holds everything else (weights, optimizer, RNG states), so on CPU in float32 an interrupted and
resumed run reproduces the uninterrupted run's losses bit for bit.

Nothing is lost and nothing fails late (run_safety.py): every setting is checked before any work, a run from
scratch never writes over another run's results, and a failed or interrupted save leaves the last checkpoint.
"""

import os

import run_safety

run_safety.start()  # from here on Ctrl-C is one line and exit status 130, also while torch is imported
# libgomp's threads spin while they wait; on a machine whose cores are shared with other processes
# that makes PyTorch's CPU ops up to ~10x slower. Passive waiting costs little on an idle machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import math
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import prepare_data
from model import GPT, GPTConfig, STEP_RULES, doc_seqlens, mixer_layers
from run_safety import fail, read_checkpoint

# -----------------------------------------------------------------------------
# default config values: a KLA model on shakespeare_char, sized for the device found (also when --device
# names another: give the sizes and --dtype with it). On CPU ~1M parameters and 64-token contexts, so that
# the default run ends in minutes. On a GPU 12.5M parameters, dropout 0.2 and 2,000 iterations: without
# dropout the validation loss was best at iteration 750 (1.41 on an H200) and then rose as the model memorised
# the 4.3M training characters; with it, best 1.394 at 1,750 and 1.401 at 2,000 (results/default_run/).
device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
_gpu = device == "cuda"
# I/O
out_dir = "out"
eval_interval = 250
eval_iters = 100 if _gpu else 20
log_interval = 10
always_save_checkpoint = False  # if False, save only when the val loss improves
patience = 0  # stop after this many evaluations in a row without a better val loss; 0: never stop early
init_from = "scratch"  # 'scratch' (refused if out_dir holds another run's results) or 'resume' (from out_dir/ckpt.pt)
sample_tokens = 500  # printed at the end of training by the master process; 0 for none
# data
dataset = "shakespeare_char"
data_dir = "data"
documents = False  # True: each batch row read as its documents (the BPE sets end each with an end-of-text token):
                   # KLA / GDN states and convolutions reset at each, attention within each; the same tokens per step
single_pass = False  # True: training windows are the train split cut end to end, each used once, in an order
                     # shuffled by seed (no token trained on twice); max_iters must fit in the split
gradient_accumulation_steps = 1  # micro-batches per optimizer step, over all processes
batch_size = 64 if _gpu else 32
block_size = 256 if _gpu else 64
# model
n_layer = 6 if _gpu else 4
n_head = 6 if _gpu else 4
n_embd = 384 if _gpu else 128
mixer = "kla"  # 'kla' | 'gdn' | 'attn', or a pattern per layer repeated to n_layer: 'kla,kla,kla,attn'
step_rule = ""  # KLA / GDN's step size: 'kaczmarz', 'unit', 'raw', 'scalar', 'longhorn' (model.STEP_RULES);
                #  '': the mixer's own ('kaczmarz' for kla, 'unit' for gdn)
decay = True  # KLA / GDN's learned decay of the state; False: none (step_rule 'unit' without decay is DeltaNet)
dropout = 0.2 if _gpu else 0.0  # on the embeddings and each residual branch; may change when resuming
expand_k = 0.75
expand_v = 1.5
conv_size = 4
mlp_hidden = 0  # SwiGLU width; 0: 8/3 n_embd rounded up to a multiple of 64
chunk_size = 64
# how a step is computed, not what: the model's switches (GPT(config, **switches)), free to change on resuming
backend = "auto"  # 'auto' (Triton on CUDA, else the PyTorch chunkwise path), 'triton', 'chunkwise', 'recurrent'
# on a GPU both memory switches on: faster and leaner at GPT-2 small's size (results/bench_h200/train_memory.md);
# no-ops where they do not apply (attention layers; evaluation and sampling, which get logits)
recompute_elementwise = _gpu  # KLA / GDN: the layer's elementwise work recomputed in the backward, not kept
fused_loss = _gpu  # training: the loss and its gradient computed in the forward in chunks of rows, no logits kept
# AdamW optimizer
learning_rate = 1e-3 if _gpu else 2e-3
max_iters = 2000 if _gpu else 500
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99  # nanoGPT's choice for small batches: few tokens per step make the second moment noisy
grad_clip = 1.0  # 0 disables
skip_nonfinite = False  # a non-finite loss or gradient: False stops the run, True skips that batch
# learning rate schedule: linear warmup, then cosine decay to min_lr
decay_lr = True
warmup_iters = 100
lr_decay_iters = 0  # 0: max_iters
min_lr = -1.0  # -1: learning_rate / 10
# system
seed = 1337
dtype = "bfloat16" if _gpu and torch.cuda.is_bf16_supported() else "float16" if _gpu else "float32"
compile = False  # torch.compile the model
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))]
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
# -----------------------------------------------------------------------------


# every setting checked before any work: one line naming the value and what it may be (configurator.py)
device_type = check_device(device, dtype)
check("out_dir", out_dir and not os.path.isfile(out_dir), "a directory (made if missing), not a file")
check("data_dir", data_dir and not os.path.isfile(data_dir), "a directory (made if missing), not a file")
for key in ("eval_interval", "log_interval", "eval_iters", "gradient_accumulation_steps", "batch_size", "block_size",
            "n_layer", "n_head", "n_embd", "chunk_size", "max_iters"):
    check(key, globals()[key] >= 1, ">= 1")
for key, allowed in {"patience": " (0: never stop early)", "sample_tokens": " (0: no sample)", "warmup_iters": "",
                     "lr_decay_iters": " (0: max_iters)", "mlp_hidden": " (0: 8/3 n_embd)"}.items():
    check(key, globals()[key] >= 0, ">= 0" + allowed)
for key, allowed in {"learning_rate": "", "weight_decay": "", "grad_clip": " (0: no clipping)"}.items():
    check(key, 0 <= globals()[key] < math.inf, "a finite number >= 0" + allowed)
check("expand_k", 0 < expand_k < math.inf, "a finite number > 0")
check("expand_v", 0 < expand_v < math.inf, "a finite number > 0")
check("beta1", 0 <= beta1 < 1, "in [0, 1)")
check("beta2", 0 <= beta2 < 1, "in [0, 1)")
check("init_from", init_from in ("scratch", "resume"), "'scratch' or 'resume'")
check("mixer", mixer_layers(mixer, n_layer), "'kla', 'gdn', 'attn' or a per-layer pattern of them whose length divides n_layer")
check("step_rule", step_rule in ("", *STEP_RULES) and not (step_rule and mixer == "attn"),
      f"'' (the mixer's own) or, with --mixer=kla or gdn, one of {', '.join(STEP_RULES)}")
check("decay", decay or mixer != "attn", "True with --mixer=attn (attention has no decay to turn off)")
check("conv_size", conv_size >= 2, ">= 2 (the current token and at least one before it)")
check("backend", backend in ("auto", "triton", "chunkwise", "recurrent"), "'auto', 'triton', 'chunkwise' or 'recurrent'")
check("backend", backend != "triton" or device_type == "cuda",
      f"'auto', 'chunkwise' or 'recurrent' on device {device!r} (the Triton kernel needs a CUDA GPU)")
check("min_lr", min_lr == -1 or 0 <= min_lr and (min_lr <= learning_rate or not decay_lr),
      f"in [0, learning_rate = {learning_rate:g}] (-1: learning_rate / 10)")
check("seed", 0 <= seed < 2**63, ">= 0 and < 2**63")  # torch.manual_seed takes seed + rank below 2**64
# defaults derived from other settings, resolved after the overrides so that they follow them
min_lr = learning_rate / 10 if min_lr == -1 else min_lr
lr_decay_iters = lr_decay_iters or max_iters
config = {k: globals()[k] for k in config_keys}  # the resolved config, saved in checkpoints
# the model's own checks (e.g. n_embd divisible by n_head); the vocabulary comes from the data, below
model_args = dict(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, mixer=mixer,
                  step_rule=step_rule, decay=decay, expand_k=expand_k, expand_v=expand_v, conv_size=conv_size,
                  mlp_hidden=mlp_hidden, chunk_size=chunk_size, dropout=dropout)
try:
    GPTConfig(**model_args)
except ValueError as err:
    fail(str(err))
settings_checked()
ckpt_path = os.path.join(out_dir, "ckpt.pt")
log_path = os.path.join(out_dir, "log.jsonl")

# DDP: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; a plain `python train.py` is one process
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if gradient_accumulation_steps % world_size:
        fail(f"gradient_accumulation_steps ({gradient_accumulation_steps}) must be a multiple of the "
             f"number of processes ({world_size})")
else:
    rank, local_rank, world_size = 0, 0, 1
master_process = rank == 0  # logs, evaluates, writes checkpoints
if master_process:  # made and locked first: a run still training there is named before anything about its files
    run_safety.claim_out_dir(out_dir, init_from)
if ddp:
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    gradient_accumulation_steps //= world_size
tokens_per_iter = gradient_accumulation_steps * world_size * batch_size * block_size
if master_process:
    print(f"tokens per iteration: {tokens_per_iter:,} ({gradient_accumulation_steps} x {world_size} x {batch_size} x "
          f"{block_size})\nlearning rate {learning_rate:.1e}, " + (f"warmup {warmup_iters} iterations, cosine decay "
          f"to {min_lr:.1e} at iteration {lr_decay_iters}" if decay_lr else "constant"))
torch.manual_seed(seed + rank)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.autocast(device_type=device_type, dtype=ptdtype)

# data: prepared on first use for the built-in datasets, then checked against the settings
data_path = os.path.join(data_dir, dataset)
meta, n_train_tokens = run_safety.read_data(config, tokens_per_iter, master_process, ddp)
data_dtype, model_args["vocab_size"] = np.dtype(meta["dtype"]), int(meta["vocab_size"])
example_length, eot = meta.get("example_length"), meta.get("eot")  # eot: the token that ends each BPE document
if single_pass:  # window w: tokens w * block_size .. (w + 1) * block_size
    window_order = np.random.default_rng([seed, 2]).permutation((n_train_tokens - 1) // block_size)
# the data files stay open for the whole run: prepare_data.py replaces a dataset's files when it prepares it again,
# and the run goes on reading the files it began with
data_names = ["train.bin", "val.bin"] + (["train_labels.bin", "val_labels.bin"] if example_length else [])
data_files = {name: open(os.path.join(data_path, name), "rb") for name in data_names}


def get_batch(split, key):
    """A batch of random windows (whole examples for the synthetic tasks), drawn by a generator seeded by
    (seed, split, key): training passes key = (0, iter_num, global micro-batch index) and evaluation (1, k),
    so batches never depend on the history of the run and a resumed run sees exactly the batches the
    uninterrupted run would. Returns x, y and cu_seqlens: None, or with documents=True the batch as one
    packed row (1, batch_size * block_size) and its documents' boundaries."""
    # a fresh memmap per batch: a long-lived one keeps every page it touched resident (nanoGPT #19)
    path = os.path.join(data_path, f"{split}.bin")
    data = np.memmap(data_files[f"{split}.bin"], dtype=data_dtype, mode="r")
    rng = np.random.default_rng([seed, split == "val", *key])
    if example_length:  # whole examples; the labels say what to predict where (-1: nothing)
        ix = rng.integers(len(data) // example_length, size=batch_size)
        labels = np.memmap(data_files[f"{split}_labels.bin"], dtype=np.int16, mode="r")
        x = np.stack([data[i * example_length:(i + 1) * example_length] for i in ix]).astype(np.int64)
        y = np.stack([labels[i * example_length:(i + 1) * example_length] for i in ix]).astype(np.int64)
    else:  # windows of the token stream; the labels are the next tokens
        ix = rng.integers(len(data) - block_size, size=batch_size)  # random ones
        if single_pass and key[0] == 0:  # training: the next windows of the shuffled order (past its end only
            it, g = key[1:]  # the batch fetched ahead after the last step, never trained on)
            first = (it * gradient_accumulation_steps * world_size + g) * batch_size
            ix = window_order[np.arange(first, first + batch_size) % len(window_order)] * block_size
        batch = np.stack([data[i:i + block_size + 1] for i in ix]).astype(np.int64)  # (B, block_size + 1)
        x, y = batch[:, :-1].copy(), batch[:, 1:].copy()
    if max(x.max(), y.max()) >= meta["vocab_size"]:  # an embedding lookup out of range is a CUDA assert
        fail(f"{path} holds token id {max(x.max(), y.max())}, but meta.json's vocabulary has "
             f"{meta['vocab_size']} ids; was it prepared with another tokenizer?")
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    cu_seqlens = None
    if documents:  # a document starts at each row and after each end-of-text token
        cu_seqlens = doc_seqlens(x, eot)
        y[x == eot] = -1  # a document's first token: nothing of its own document to predict it from
        x, y = x.view(1, -1), y.view(1, -1)
    if device_type == "cuda":  # pinned memory lets the copy overlap with compute
        return [t if t is None else t.pin_memory().to(device, non_blocking=True) for t in (x, y, cu_seqlens)]
    return [t if t is None else t.to(device) for t in (x, y, cu_seqlens)]


# model
iter_num, best_val_loss, evals_since_best = 0, float("inf"), 0
if init_from == "resume":
    checkpoint = run_safety.read_resume(ckpt_path, model_args, config, meta, data_path)
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    evals_since_best = checkpoint.get("evals_since_best", 0)
try:
    switches = dict(backend=backend, recompute_elementwise=recompute_elementwise, fused_loss=fused_loss)
    model = (GPT.from_checkpoint(checkpoint, dropout=dropout, **switches) if init_from == "resume"
             else GPT(GPTConfig(**model_args), **switches))
except ValueError as err:
    fail(f"{ckpt_path}: {err}" if init_from == "resume" else str(err))
try:
    backend_used = model.to(device).set_backend(device_type)
except (ValueError, RuntimeError) as err:
    fail(str(err))
if master_process:
    print(f"{mixer} model{f', step rule {step_rule}' if step_rule else ''}{'' if decay else ', no decay'}, "
          f"{model.get_num_params() / 1e6:.2f}M parameters, backend {backend_used}, device {device}, dtype {dtype}")

scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")  # float16 needs loss scaling; bf16 does not
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if init_from == "resume":
    run_safety.restore(checkpoint, ckpt_path, model, optimizer, scaler)
    checkpoint = None  # free it

raw_model = model  # the plain module: its state_dict keys have no '_orig_mod.' or 'module.' prefix
if compile:
    if master_process:
        print("compiling the model... (takes a minute)")
    model = torch.compile(model)
if ddp:
    model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None)


@torch.no_grad()
def estimate_loss():
    """Mean loss over eval_iters batches of each split; the same batches every time, so that
    evaluations along a run are comparable."""
    out = {}
    raw_model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y, cu_seqlens = get_batch(split, (1, k))
            with ctx:
                _, loss = raw_model(X, Y, cu_seqlens=cu_seqlens)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    raw_model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)))
    return min_lr + coeff * (learning_rate - min_lr)


# MFU is measured against the bf16 dense peak of the GPU found; unknown GPUs and CPUs print n/a
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12,
              "4090": 165e12}
peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in torch.cuda.get_device_name()), None) \
    if device_type == "cuda" else None

# training loop
run_safety.watch(ckpt_path, lambda: iter_num, master_process, lambda: (
    f"out of memory on {device} at iteration {iter_num} with batch_size = {batch_size}, block_size = {block_size}: "
    f"lower batch_size (raising gradient_accumulation_steps as much keeps the {tokens_per_iter:,} tokens a step"
    f"{'' if recompute_elementwise and fused_loss else '; recompute_elementwise=True and fused_loss=True keep less'})"))
log = run_safety.RunLog(log_path, iter_num if init_from == "resume" else None) if master_process else None
# micro-batch m of process r is global micro-batch r * gradient_accumulation_steps + m: one process with
# 8 micro-batches and 8 processes with one each train on the same batches
X, Y, cu_seqlens = get_batch("train", (0, iter_num, rank * gradient_accumulation_steps))
steps = []  # (iteration, its loss and gradient norm on the device) since the last run_safety.check_steps
t0, n_timed = time.time(), 0  # the time per iteration is measured over the iterations between two log lines
resumed_at = iter_num if init_from == "resume" else None  # the checkpoint's iteration, evaluated before its save
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    # a resumed run evaluates its checkpoint again, also between eval_interval's iterations: the log it continues
    # then has that evaluation whatever its eval_interval (the records from the checkpoint's iteration on are new)
    if iter_num % eval_interval == 0 or iter_num in (max_iters, resumed_at):
        run_safety.check_steps(steps, scaler.is_enabled(), ckpt_path)
        if master_process:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
            record = {"iter": iter_num, "train_loss": losses["train"], "val_loss": losses["val"]}
            if not (math.isfinite(losses["train"]) and math.isfinite(losses["val"])):
                log(record)
                fail(f"the evaluation loss is not finite at iteration {iter_num}; the checkpoint was not overwritten")
            # iteration 0 is the untrained model, and an evaluation at a resumed checkpoint's own iteration
            # re-reads its weights: neither is a new best or a step without one
            if iter_num > 0 and iter_num != resumed_at:
                evals_since_best = 0 if losses["val"] < best_val_loss else evals_since_best + 1
                if losses["val"] < best_val_loss or always_save_checkpoint:
                    best_val_loss = min(best_val_loss, losses["val"])
                    run_safety.save_checkpoint(ckpt_path, {
                        "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "model_args": model_args, "config": config,
                        "meta": meta,  # the tokenizer, so that sample.py needs no data directory
                        "iter_num": iter_num, "best_val_loss": best_val_loss, "evals_since_best": evals_since_best,
                        "rng": run_safety.rng_state()}, log)
                    print(f"saved checkpoint to {ckpt_path}")
            # logged after the save: a run killed between the two resumes from that checkpoint and logs this
            # evaluation again, and a log with an evaluation past iteration 0 always has a checkpoint beside it
            log(record)
        if patience:  # early stopping: the master decides, every process stops
            stop = torch.tensor(int(evals_since_best >= patience), device=device)
            if ddp:
                dist.broadcast(stop, 0)
            if stop.item():
                if master_process:
                    print(f"no better val loss in {patience} evaluations: stopping at iteration {iter_num}; "
                          f"{ckpt_path} holds the best model (val loss {best_val_loss:.4f})")
                    log({"iter": iter_num, "end": "early stop", "patience": patience})
                break
        t0, n_timed = time.time(), 0  # the evaluation is not part of the iterations' time
    if iter_num >= max_iters:
        if master_process:
            log({"iter": iter_num, "end": "max_iters", "patience": patience})
        break

    # forward/backward over the micro-batches; DDP syncs the gradients only on the last one
    loss_sum = torch.zeros((), device=device)
    for micro_step in range(gradient_accumulation_steps):
        last = micro_step == gradient_accumulation_steps - 1
        with model.no_sync() if ddp and not last else nullcontext(), ctx:
            _, loss = model(X, Y, cu_seqlens=cu_seqlens)
            loss = loss / gradient_accumulation_steps
        loss_sum += loss.detach()
        # the next batch is fetched while the GPU works on this one
        X, Y, cu_seqlens = get_batch("train", (0, iter_num + last, rank * gradient_accumulation_steps + (0 if last else micro_step + 1)))
        scaler.scale(loss).backward()
    if ddp:  # every process must see the same loss, or one stops on a NaN while the others wait
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    n_timed += 1
    step = torch.stack([loss_sum.float(), grad_norm.float()])  # stays on the device until run_safety.check_steps
    # skipping needs the answer before the update
    what = run_safety.nonfinite(*step.tolist(), scaler.is_enabled()) if skip_nonfinite else None
    if what:
        if master_process:
            print(f"warning: {what} at iteration {iter_num}; skipping this batch", flush=True)
            log({"iter": iter_num, "skipped": what})
        optimizer.zero_grad(set_to_none=True)
        scaler.update()
        iter_num += 1
        continue
    steps.append((iter_num, step))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    if iter_num % log_interval == 0:
        lossf = run_safety.check_steps(steps, scaler.is_enabled(), ckpt_path)
        t1 = time.time()
        dt, t0, n_timed = (t1 - t0) / n_timed, t1, 0
        if master_process:
            mfu = raw_model.estimate_mfu(tokens_per_iter, dt, peak_flops) if peak_flops else None
            mfu_str = f"{mfu * 100:.1f}%" if mfu is not None else "n/a"
            print(f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}, {dt * 1000:.1f} ms/iter, "
                  f"{tokens_per_iter / dt:,.0f} tok/s, mfu {mfu_str}", flush=True)
            log({"iter": iter_num, "loss": lossf, "lr": lr, "ms": dt * 1000, "tok_s": tokens_per_iter / dt, "mfu": mfu})
    iter_num += 1

# the checkpoint holds the best weights seen (saved only when the val loss improved): end with those
if master_process and not always_save_checkpoint and losses["val"] > best_val_loss and os.path.exists(ckpt_path):
    raw_model.load_state_dict(read_checkpoint(ckpt_path)["model"])
    print(f"restored the best weights (val loss {best_val_loss:.4f}) from {ckpt_path}; "
          f"the last evaluation gave {losses['val']:.4f}")
if master_process and sample_tokens > 0 and meta["tokenizer"] != "none":
    raw_model.eval()
    encode, decode = prepare_data.get_tokenizer(meta)
    start = torch.tensor([encode("\n")], dtype=torch.long, device=device)
    with ctx:
        y = raw_model.generate(start, sample_tokens, temperature=0.8, top_k=200)
    print(f"---------------\n{decode(y[0].tolist())}\n---------------")
run_safety.unlock_out_dir()
if ddp:
    dist.destroy_process_group()
