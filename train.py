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
"""

import os

# libgomp's threads spin while they wait; on a machine whose cores are shared with other processes
# that makes PyTorch's CPU ops up to ~10x slower. Passive waiting costs little on an idle machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json
import math
import random
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import prepare_data
from model import GPT, GPTConfig, read_checkpoint

# -----------------------------------------------------------------------------
# default config values: a KLA model on shakespeare_char, sized for the device found.
# On CPU ~1M parameters and 64-token contexts, so that the default run ends in minutes.
device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
_gpu = device == "cuda"
# I/O
out_dir = "out"
eval_interval = 250
eval_iters = 100 if _gpu else 20
log_interval = 10
always_save_checkpoint = False  # if False, save only when the val loss improves
patience = 0  # stop after this many evaluations in a row without a better val loss; 0: never stop early
init_from = "scratch"  # 'scratch' or 'resume' (from out_dir/ckpt.pt)
sample_tokens = 500  # printed at the end of training by the master process; 0 for none
# data
dataset = "shakespeare_char"
data_dir = "data"
gradient_accumulation_steps = 1  # micro-batches per optimizer step, over all processes
batch_size = 64 if _gpu else 32
block_size = 256 if _gpu else 64
# model
n_layer = 6 if _gpu else 4
n_head = 6 if _gpu else 4
n_embd = 384 if _gpu else 128
mixer = "kla"  # 'kla' | 'gdn' | 'attn'
expand_k = 0.75
expand_v = 1.5
conv_size = 4
mlp_hidden = 0  # SwiGLU width; 0: 8/3 n_embd rounded up to a multiple of 64
chunk_size = 64
backend = "auto"  # 'auto' (Triton on CUDA, else the PyTorch chunkwise path), 'triton', 'chunkwise', 'recurrent'
# AdamW optimizer
learning_rate = 1e-3 if _gpu else 2e-3
max_iters = 5000 if _gpu else 500
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99  # nanoGPT's choice for small batches: few tokens per step make the second moment noisy
grad_clip = 1.0  # 0 disables
skip_nonfinite = False  # a non-finite loss or gradient: False stops the run, True skips that batch
# learning rate schedule: linear warmup, then cosine decay to min_lr
decay_lr = True
warmup_iters = 100
lr_decay_iters = 0  # 0: decay until max_iters
min_lr = learning_rate / 10
# system
seed = 1337
dtype = "bfloat16" if _gpu and torch.cuda.is_bf16_supported() else "float16" if _gpu else "float32"
compile = False  # torch.compile the model
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))]
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
config = {k: globals()[k] for k in config_keys}  # the resolved config, printed and saved in checkpoints
# -----------------------------------------------------------------------------


def fail(msg):
    """Bad input or a broken run: one line on stderr and a non-zero exit, never a traceback."""
    print(f"error: {msg}", file=sys.stderr)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(1)


if init_from not in ("scratch", "resume"):
    fail(f"init_from must be 'scratch' or 'resume', got {init_from!r}")
if dtype not in ("float32", "bfloat16", "float16"):
    fail(f"dtype must be 'float32', 'bfloat16' or 'float16', got {dtype!r}")

# DDP: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; a plain `python train.py` is one process
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    if gradient_accumulation_steps % world_size:
        fail(f"gradient_accumulation_steps ({gradient_accumulation_steps}) must be a multiple of the "
             f"number of processes ({world_size})")
    gradient_accumulation_steps //= world_size
else:
    rank, local_rank, world_size = 0, 0, 1
master_process = rank == 0  # logs, evaluates, writes checkpoints
device_type = "cuda" if device.startswith("cuda") else device.split(":")[0]
tokens_per_iter = gradient_accumulation_steps * world_size * batch_size * block_size
if master_process:
    print(f"tokens per iteration: {tokens_per_iter:,} "
          f"({gradient_accumulation_steps} x {world_size} x {batch_size} x {block_size})")
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(seed + rank)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.autocast(device_type=device_type, dtype=ptdtype)

# data: prepared on first use for the built-in datasets; meta.json marks a complete dataset
data_path = os.path.join(data_dir, dataset)
if not os.path.exists(os.path.join(data_path, "meta.json")) and dataset in prepare_data.DATASETS:
    if master_process:
        print(f"{data_path} not found, preparing it")
        prepare_data.prepare(dataset, data_dir)
    if ddp:
        dist.barrier()
for name in ("meta.json", "train.bin", "val.bin"):
    if not os.path.exists(os.path.join(data_path, name)):
        fail(f"{os.path.join(data_path, name)} not found; prepare the data first "
             "(python prepare_data.py --dataset=...)")
with open(os.path.join(data_path, "meta.json")) as f:
    meta = json.load(f)
data_dtype = np.dtype(meta["dtype"])
example_length = meta.get("example_length")  # the synthetic tasks: whole examples with their own labels
if example_length and block_size != example_length:
    fail(f"{data_path} holds examples of {example_length} tokens: set --block_size={example_length}")
for split in ("train", "val"):
    n_tokens = os.path.getsize(os.path.join(data_path, f"{split}.bin")) // data_dtype.itemsize
    if example_length and n_tokens < example_length:
        fail(f"{os.path.join(data_path, split + '.bin')} holds no complete example of {example_length} tokens")
    if not example_length and n_tokens <= block_size:
        fail(f"{os.path.join(data_path, split + '.bin')} holds {n_tokens} tokens, "
             f"fewer than block_size + 1 = {block_size + 1}")


def get_batch(split, key):
    """A batch of random windows (whole examples for the synthetic tasks), drawn by a generator seeded by
    (seed, split, key): training passes key = (0, iter_num, global micro-batch index) and evaluation (1, k),
    so batches never depend on the history of the run and a resumed run sees exactly the batches the
    uninterrupted run would."""
    # a fresh memmap per batch: a long-lived one keeps every page it touched resident (nanoGPT #19)
    path = os.path.join(data_path, f"{split}.bin")
    data = np.memmap(path, dtype=data_dtype, mode="r")
    rng = np.random.default_rng([seed, split == "val", *key])
    if example_length:  # whole examples; the labels say what to predict where (-1: nothing)
        ix = rng.integers(len(data) // example_length, size=batch_size)
        labels = np.memmap(os.path.join(data_path, f"{split}_labels.bin"), dtype=np.int16, mode="r")
        x = np.stack([data[i * example_length:(i + 1) * example_length] for i in ix]).astype(np.int64)
        y = np.stack([labels[i * example_length:(i + 1) * example_length] for i in ix]).astype(np.int64)
    else:  # random windows of the token stream; the labels are the next tokens
        ix = rng.integers(len(data) - block_size, size=batch_size)
        batch = np.stack([data[i:i + block_size + 1] for i in ix]).astype(np.int64)  # (B, block_size + 1)
        x, y = batch[:, :-1].copy(), batch[:, 1:].copy()
    if max(x.max(), y.max()) >= meta["vocab_size"]:  # an embedding lookup out of range is a CUDA assert
        fail(f"{path} holds token id {max(x.max(), y.max())}, but meta.json's vocabulary has "
             f"{meta['vocab_size']} ids; was it prepared with another tokenizer?")
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    if device_type == "cuda":  # pinned memory lets the copy overlap with compute
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# model
model_args = dict(block_size=block_size, vocab_size=meta["vocab_size"], n_layer=n_layer, n_head=n_head,
                  n_embd=n_embd, mixer=mixer, expand_k=expand_k, expand_v=expand_v, conv_size=conv_size,
                  mlp_hidden=mlp_hidden, chunk_size=chunk_size, backend=backend)
iter_num, best_val_loss, evals_since_best = 0, float("inf"), 0
ckpt_path = os.path.join(out_dir, "ckpt.pt")
if init_from == "resume":
    try:
        checkpoint = read_checkpoint(ckpt_path)  # on the CPU (RNG states there; weights moved below)
    except ValueError as err:
        fail(str(err))
    # the backend is how the mixer is computed, not what it computes: it may change between runs
    differ = [f"{k}={checkpoint['model_args'].get(k)!r} (this run: {v!r})" for k, v in model_args.items()
              if k != "backend" and checkpoint["model_args"].get(k) != v]
    if differ:
        fail(f"{ckpt_path} is a checkpoint of another model: {', '.join(differ)}")
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    evals_since_best = checkpoint.get("evals_since_best", 0)
try:
    gptconf = GPTConfig(**model_args)
except ValueError as err:
    fail(str(err))
try:
    model = GPT.from_checkpoint(checkpoint, backend=backend) if init_from == "resume" else GPT(gptconf)
except ValueError as err:
    fail(f"{ckpt_path}: {err}")
model.to(device)
try:
    backend_used = model.set_backend(device_type)
except (ValueError, RuntimeError) as err:
    fail(str(err))
if master_process:
    print(f"{gptconf.mixer} model, {model.get_num_params() / 1e6:.2f}M parameters, backend {backend_used}, "
          f"device {device}, dtype {dtype}")

scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")  # float16 needs loss scaling; bf16 does not
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if init_from == "resume":
    optimizer.load_state_dict(checkpoint["optimizer"])
    for p in model.parameters():  # AdamW's moments in a checkpoint from before the input projection's padding
        for k, t in optimizer.state.get(p, {}).items():
            if torch.is_tensor(t) and t.dim() == p.dim() == 2 and t.shape[1:] == p.shape[1:] and t.shape[0] < p.shape[0]:
                optimizer.state[p][k] = torch.cat([t, t.new_zeros(p.shape[0] - t.shape[0], *t.shape[1:])])
    scaler.load_state_dict(checkpoint["scaler"])
    rng = checkpoint["rng"]
    random.setstate((rng["python"][0], tuple(rng["python"][1]), rng["python"][2]))
    np.random.set_state(("MT19937", rng["numpy"][0].numpy().astype(np.uint32), *rng["numpy"][1:]))
    torch.set_rng_state(rng["torch"].cpu())
    if torch.cuda.is_available() and rng.get("cuda"):
        torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])
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
            X, Y = get_batch(split, (1, k))
            with ctx:
                _, loss = raw_model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    raw_model.train()
    return out


def get_lr(it):
    decay_iters = lr_decay_iters or max_iters
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > decay_iters:
        return min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup_iters) / max(1, decay_iters - warmup_iters)))
    return min_lr + coeff * (learning_rate - min_lr)


def save_checkpoint():
    """Write ckpt.pt atomically: a complete temporary file is fsynced and renamed over the old one,
    and the directory is fsynced, so a crash at any moment leaves the last good checkpoint intact.
    Only tensors, dicts, lists, numbers and strings, so that torch.load(weights_only=True) reads it."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    obj = {
        "model": raw_model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "model_args": model_args,
        "config": config,
        "meta": meta,  # the tokenizer, so that sample.py needs no data directory
        "iter_num": iter_num,
        "best_val_loss": best_val_loss,
        "evals_since_best": evals_since_best,
        # the data loader's state is (seed, iter_num): see get_batch
        "rng": {"python": [py_state[0], list(py_state[1]), py_state[2]],
                "numpy": [torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]),
                          float(np_state[4])],
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
    }
    tmp = ckpt_path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, ckpt_path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    dir_fd = os.open(out_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # makes the rename itself durable
    finally:
        os.close(dir_fd)


log_path = os.path.join(out_dir, "log.jsonl")
if master_process and init_from == "scratch":
    open(log_path, "w").close()  # a new run starts a new log; a resumed one appends to its own


def log(record):
    """Append one record to out_dir/log.jsonl, the machine-readable twin of the printed lines."""
    with open(log_path, "a") as f:
        f.write(json.dumps(record) + "\n")


# MFU is measured against the bf16 dense peak of the GPU found; unknown GPUs and CPUs print n/a
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12,
              "4090": 165e12}
peak_flops = None
if device_type == "cuda":
    gpu_name = torch.cuda.get_device_name()
    peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in gpu_name), None)

# training loop
# micro-batch m of process r is global micro-batch r * gradient_accumulation_steps + m: one process with
# 8 micro-batches and 8 processes with one each train on the same batches
X, Y = get_batch("train", (0, iter_num, rank * gradient_accumulation_steps))
t0 = time.time()
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    if iter_num % eval_interval == 0 or iter_num == max_iters:
        if master_process:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
            log({"iter": iter_num, "train_loss": losses["train"], "val_loss": losses["val"]})
            if not (math.isfinite(losses["train"]) and math.isfinite(losses["val"])):
                fail(f"the evaluation loss is not finite at iteration {iter_num}; the checkpoint was not overwritten")
            evals_since_best = 0 if losses["val"] < best_val_loss else evals_since_best + 1
            if losses["val"] < best_val_loss or always_save_checkpoint:
                best_val_loss = min(best_val_loss, losses["val"])
                if iter_num > 0:
                    save_checkpoint()
                    print(f"saved checkpoint to {ckpt_path}")
        if patience:  # early stopping: the master decides, every process stops
            stop = torch.tensor(int(evals_since_best >= patience), device=device)
            if ddp:
                dist.broadcast(stop, 0)
            if stop.item():
                if master_process:
                    print(f"no better val loss in {patience} evaluations: stopping at iteration {iter_num}; "
                          f"{ckpt_path} holds the best model (val loss {best_val_loss:.4f})")
                break
        t0 = time.time()  # the evaluation is not part of the next iteration's time
    if iter_num >= max_iters:
        break

    # forward/backward over the micro-batches; DDP syncs the gradients only on the last one
    loss_sum = torch.zeros((), device=device)
    for micro_step in range(gradient_accumulation_steps):
        last = micro_step == gradient_accumulation_steps - 1
        with model.no_sync() if ddp and not last else nullcontext(), ctx:
            _, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        loss_sum += loss.detach()
        # the next batch is fetched while the GPU works on this one
        X, Y = get_batch("train", (0, iter_num + last, rank * gradient_accumulation_steps + (0 if last else micro_step + 1)))
        scaler.scale(loss).backward()
    if ddp:  # every process must see the same loss, or one stops on a NaN while the others wait
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
    lossf = loss_sum.item()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf")).item()
    # (float16's loss scaler expects inf gradients now and then: it skips those steps and lowers its scale)
    if not math.isfinite(lossf) or (not math.isfinite(grad_norm) and not scaler.is_enabled()):
        what = f"the loss is {lossf}" if not math.isfinite(lossf) else f"the gradient norm is {grad_norm}"
        if not skip_nonfinite:
            fail(f"{what} at iteration {iter_num}; stopping without saving these weights ({ckpt_path} keeps "
                 "the last good ones; --skip_nonfinite=True would skip such batches)")
        if master_process:
            print(f"warning: {what} at iteration {iter_num}; skipping this batch", flush=True)
            log({"iter": iter_num, "skipped": what})
        optimizer.zero_grad(set_to_none=True)
        scaler.update()
        iter_num += 1
        continue
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0 and master_process:
        mfu = raw_model.estimate_mfu(tokens_per_iter, dt, peak_flops) if peak_flops else None
        mfu_str = f"{mfu * 100:.1f}%" if mfu is not None else "n/a"
        print(f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}, {dt * 1000:.1f} ms/iter, "
              f"{tokens_per_iter / dt:,.0f} tok/s, mfu {mfu_str}", flush=True)
        log({"iter": iter_num, "loss": lossf, "lr": lr, "ms": dt * 1000, "tok_s": tokens_per_iter / dt, "mfu": mfu})
    iter_num += 1

if master_process and sample_tokens > 0 and meta["tokenizer"] != "none":
    encode, decode = prepare_data.get_tokenizer(meta)
    start = torch.tensor([encode("\n")], dtype=torch.long, device=device)
    with ctx:
        y = raw_model.generate(start, sample_tokens, temperature=0.8, top_k=200)
    print(f"---------------\n{decode(y[0].tolist())}\n---------------")
if ddp:
    dist.destroy_process_group()
