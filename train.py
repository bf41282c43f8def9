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

Nothing is lost and nothing fails late: every setting is checked before any work, a run from scratch
never writes over another run's results in its out_dir (a checkpoint, an eval.json, an evaluated log), and a
failed or interrupted save leaves the last checkpoint.
"""

import os

# libgomp's threads spin while they wait; on a machine whose cores are shared with other processes
# that makes PyTorch's CPU ops up to ~10x slower. Passive waiting costs little on an idle machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import errno
import json
import math
import random
import signal
import sys
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import prepare_data
from model import GPT, GPTConfig, STEP_RULES, doc_seqlens, read_checkpoint

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
mixer = "kla"  # 'kla' | 'gdn' | 'attn'
step_rule = ""  # KLA / GDN's step size: 'kaczmarz', 'unit', 'raw', 'scalar', 'longhorn' (model.STEP_RULES);
                #  '': the mixer's own ('kaczmarz' for kla, 'unit' for gdn)
decay = True  # KLA / GDN's learned decay of the state; False: none (step_rule 'unit' without decay is DeltaNet)
dropout = 0.2 if _gpu else 0.0  # on the embeddings and each residual branch; may change when resuming
expand_k = 0.75
expand_v = 1.5
conv_size = 4
mlp_hidden = 0  # SwiGLU width; 0: 8/3 n_embd rounded up to a multiple of 64
chunk_size = 64
backend = "auto"  # 'auto' (Triton on CUDA, else the PyTorch chunkwise path), 'triton', 'chunkwise', 'recurrent'
# memory: at GPT-2 small's size, 32 x 2048 tokens, compiled on an H200, KLA with both peaks at 42.0 GiB against 54.8
# at 1.016x the tokens/s (BENCHMARKS.md); they change how the step is computed, not what, and may change on resuming
recompute_elementwise = False  # KLA / GDN: the layer's elementwise work recomputed in the backward, not kept
fused_loss = False  # the loss and its gradient computed in the forward in chunks of rows: no logits kept
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


NOTHING_LEFT = 3  # the exit status of a resume with nothing left to train (experiments.py then evaluates the run)


def fail(msg, status=1):
    """Bad input or a broken run: one line on stderr and a non-zero exit, never a traceback. The folders of out_dir
    that this run made are removed again while nothing is in them (a setting refused once the data is read)."""
    print(f"error: {msg}", file=sys.stderr)
    unlock_out_dir()
    for path in made_dirs:
        try:
            os.rmdir(path)  # only an empty folder
        except OSError:
            pass
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)


out_dir_lock = []  # the file descriptor that holds out_dir's lock while this run trains (lock_out_dir)
made_dirs = []  # the folders that this run made for out_dir, innermost first


def lock_out_dir(path):
    """Hold an exclusive lock on the folder out_dir while this run trains, so that a second train.py into it (a
    command typed twice, two experiments.py over one --root) stops at once instead of writing over this run's
    checkpoint and log. The OS drops the lock when the process ends, by a kill too: nothing is left to clean up.
    No lock where the OS or the file system has none (Windows, some network file systems)."""
    fd, busy = prepare_data.lock_folder(path)
    if busy:
        fail(f"{path} is in use by another train.py that has not ended: wait for it, or train into another "
             "--out_dir", os.EX_TEMPFAIL)  # the status tells experiments.py that the run is not its own
    if fd is not None:
        out_dir_lock.append(fd)


def unlock_out_dir():
    """Let go of out_dir's lock at the end of the run (for a script run again in the same process, as the tests do)."""
    while out_dir_lock:
        os.close(out_dir_lock.pop())


def run_end(path):
    """The record that a run ended with, if it is the last of its log (path: out_dir/log.jsonl), else None:
    {"iter": where it ended, "end": "early stop" or "max_iters", "patience": the patience it ran with}."""
    try:
        with open(path) as f:
            last = json.loads(f.read().splitlines()[-1])
    except (OSError, IndexError, ValueError):
        return None
    return last if isinstance(last, dict) and "end" in last else None


def last_evaluated(path):
    """The last iteration that the log at path (out_dir/log.jsonl) holds an evaluation of; 0 if none."""
    last = 0
    try:
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                    last = max(last, record["iter"] if "val_loss" in record else 0)
                except (ValueError, KeyError, TypeError):  # a line cut short by a kill
                    pass
    except OSError:
        pass
    return last


# every setting checked before any work: one line naming the value and what it may be (configurator.py)
device_type = check_device(device, dtype)
check("out_dir", out_dir and not os.path.isfile(out_dir), "a directory (made if missing), not a file")
check("data_dir", data_dir and not os.path.isfile(data_dir), "a directory (made if missing), not a file")
check("eval_interval", eval_interval >= 1, ">= 1")
check("log_interval", log_interval >= 1, ">= 1")
check("eval_iters", eval_iters >= 1, ">= 1")
check("patience", patience >= 0, ">= 0 (0: never stop early)")
check("init_from", init_from in ("scratch", "resume"), "'scratch' or 'resume'")
check("sample_tokens", sample_tokens >= 0, ">= 0 (0: no sample)")
check("gradient_accumulation_steps", gradient_accumulation_steps >= 1, ">= 1")
check("batch_size", batch_size >= 1, ">= 1")
check("block_size", block_size >= 1, ">= 1")
check("n_layer", n_layer >= 1, ">= 1")
check("n_head", n_head >= 1, ">= 1")
check("n_embd", n_embd >= 1, ">= 1")
check("mixer", mixer in ("kla", "gdn", "attn"), "'kla', 'gdn' or 'attn'")
check("step_rule", step_rule in ("", *STEP_RULES) and not (step_rule and mixer == "attn"),
      f"'' (the mixer's own) or, with --mixer=kla or gdn, one of {', '.join(STEP_RULES)}")
check("decay", decay or mixer != "attn", "True with --mixer=attn (attention has no decay to turn off)")
check("expand_k", 0 < expand_k < math.inf, "a finite number > 0")
check("expand_v", 0 < expand_v < math.inf, "a finite number > 0")
check("conv_size", conv_size >= 2, ">= 2 (the current token and at least one before it)")
check("mlp_hidden", mlp_hidden >= 0, ">= 0 (0: 8/3 n_embd)")
check("chunk_size", chunk_size >= 1, ">= 1")
check("backend", backend in ("auto", "triton", "chunkwise", "recurrent"), "'auto', 'triton', 'chunkwise' or 'recurrent'")
check("backend", backend != "triton" or device_type == "cuda",
      f"'auto', 'chunkwise' or 'recurrent' on device {device!r} (the Triton kernel needs a CUDA GPU)")
check("learning_rate", 0 <= learning_rate < math.inf, "a finite number >= 0")
check("max_iters", max_iters >= 1, ">= 1")
check("weight_decay", 0 <= weight_decay < math.inf, "a finite number >= 0")
check("beta1", 0 <= beta1 < 1, "in [0, 1)")
check("beta2", 0 <= beta2 < 1, "in [0, 1)")
check("grad_clip", 0 <= grad_clip < math.inf, "a finite number >= 0 (0: no clipping)")
check("warmup_iters", warmup_iters >= 0, ">= 0")
check("lr_decay_iters", lr_decay_iters >= 0, ">= 0 (0: max_iters)")
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
# out_dir, which the master alone writes, is made and locked first: a run still training there is named before
# anything about its files. A run from scratch then refuses to write over another run's results: its checkpoint,
# its eval.json or a log with an evaluation past iteration 0 (a run that failed or was killed before evaluating a
# trained model is started again)
if master_process:
    missing = os.path.abspath(out_dir)
    while not os.path.exists(missing):
        made_dirs.append(missing)
        missing = os.path.dirname(missing)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as err:
        fail(f"cannot make out_dir {out_dir}: {err.strerror}")
    lock_out_dir(out_dir)
    if init_from == "scratch":
        evaluated = last_evaluated(log_path)
        found = [path for path in (ckpt_path, os.path.join(out_dir, "eval.json")) if os.path.exists(path)]
        found += [log_path] * (evaluated > 0)
        if found:
            what = " and ".join(map(os.path.basename, found))
            what += f", evaluated up to iteration {evaluated}" if evaluated else ""
            held = (f"{ckpt_path} holds a trained model: continue it with --init_from=resume, or train from scratch"
                    if os.path.exists(ckpt_path) else
                    f"{out_dir} holds another run's results ({what}) but no checkpoint: train from scratch")
            fail(f"{held} into another --out_dir (or delete {', '.join(found)} first)")
if ddp:
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    gradient_accumulation_steps //= world_size
tokens_per_iter = gradient_accumulation_steps * world_size * batch_size * block_size
if master_process:
    print(f"tokens per iteration: {tokens_per_iter:,} "
          f"({gradient_accumulation_steps} x {world_size} x {batch_size} x {block_size})")
    print(f"learning rate {learning_rate:.1e}, " + (f"warmup {warmup_iters} iterations, cosine decay to {min_lr:.1e} "
          f"at iteration {lr_decay_iters}" if decay_lr else "constant"))
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
        try:
            prepare_data.prepare(dataset, data_dir)
        except SystemExit as err:  # prepare_data's one line (e.g. offline), given as this run's error
            fail(str(err.code).removeprefix("error: "))
    if ddp:
        dist.barrier()
for name in ("meta.json", "train.bin", "val.bin"):
    if not os.path.exists(os.path.join(data_path, name)):
        fail(f"{os.path.join(data_path, name)} not found; prepare the data first "
             "(python prepare_data.py --dataset=...)")
try:
    with open(os.path.join(data_path, "meta.json")) as f:
        meta = json.load(f)
    data_dtype, model_args["vocab_size"] = np.dtype(meta["dtype"]), int(meta["vocab_size"])
    example_length = meta.get("example_length")  # the synthetic tasks: whole examples with their own labels
except (ValueError, KeyError, TypeError, AttributeError) as err:
    fail(f"{os.path.join(data_path, 'meta.json')} is damaged ({type(err).__name__}: {err}); prepare the data "
         f"again (python prepare_data.py --dataset={dataset})")
eot = meta.get("eot")  # the end-of-text token that ends each document of the BPE datasets
if documents and eot is None:
    fail(f"documents=True needs the end-of-text token that ends each document, and {data_path}/meta.json names "
         f"none: prepare the data again (python prepare_data.py --dataset={dataset}); shakespeare_char and the "
         "synthetic tasks have none")
if example_length and block_size != example_length:
    fail(f"{data_path} holds examples of {example_length} tokens: set --block_size={example_length}")
# the closing sample is decoded with the data's BPE encoding: one that cannot be loaded (not cached, and offline)
# stops the run here, not after training
if master_process and sample_tokens > 0 and meta.get("tokenizer") == "tiktoken":
    try:
        import tiktoken
        tiktoken.get_encoding(meta["encoding"])
    except Exception as err:  # ImportError, KeyError, or the BPE file neither cached nor downloadable
        fail(f"sample_tokens = {sample_tokens} needs the tiktoken encoding {meta.get('encoding')!r} of {data_path}, "
             f"which cannot be loaded ({type(err).__name__}: {(str(err).splitlines() or [''])[0]}); set "
             "--sample_tokens=0, or make the encoding available (pip install tiktoken; offline, set "
             "TIKTOKEN_CACHE_DIR to a cache that holds it)")
if not example_length and not os.path.exists(os.path.join(data_path, "test.bin")):  # evaluate.py reports test
    fail(f"{data_path} has no test split (test.bin): prepare it again (python prepare_data.py --dataset={dataset}), "
         "which splits it by document into train, val and test")
for split in ("train", "val"):
    path = os.path.join(data_path, f"{split}.bin")
    if os.path.getsize(path) % data_dtype.itemsize:
        fail(f"{path} holds {os.path.getsize(path)} bytes, not a whole number of {data_dtype.name} tokens "
             f"({data_dtype.itemsize} bytes each): a damaged file; prepare the data again")
    n_tokens = os.path.getsize(path) // data_dtype.itemsize
    if example_length and n_tokens < example_length:
        fail(f"{path} holds no complete example of {example_length} tokens")
    if example_length and not (os.path.exists(os.path.join(data_path, f"{split}_labels.bin")) and
                               os.path.getsize(os.path.join(data_path, f"{split}_labels.bin")) == 2 * n_tokens):
        fail(f"{os.path.join(data_path, split + '_labels.bin')} is missing or does not hold one int16 label "
             f"for each of the {n_tokens} tokens of {path}; prepare the data again")
    if not example_length and n_tokens <= block_size:
        fail(f"{path} holds {n_tokens} tokens, fewer than block_size + 1 = {block_size + 1}")
    if split == "train" and single_pass:
        if example_length:
            fail("single_pass = True: the synthetic tasks' examples are drawn at random; use it with a language "
                 "dataset")
        n_windows = (n_tokens - 1) // block_size  # window w: tokens w * block_size .. (w + 1) * block_size
        if max_iters * tokens_per_iter > n_windows * block_size:
            fail(f"single_pass = True: max_iters = {max_iters} takes {max_iters * tokens_per_iter:,} tokens, more "
                 f"than the {n_windows * block_size:,} of {path} in windows of {block_size}: at most "
                 f"{n_windows * block_size // tokens_per_iter} iterations")
        window_order = np.random.default_rng([seed, 2]).permutation(n_windows)


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
saved_iter = None  # the iteration whose weights ckpt_path holds; None: no checkpoint yet
if init_from == "resume":
    try:
        # on the CPU (RNG states there; weights moved below), with the entries a resume reads
        checkpoint = read_checkpoint(ckpt_path, needs=("model", "model_args", "optimizer", "rng", "iter_num",
                                                       "best_val_loss"))
    except ValueError as err:
        fail(str(err))
    # the backend is how the mixer is computed, not what it computes: it may change between runs; a field the
    # checkpoint lacks (saved before the field existed) has its default
    saved = {k: checkpoint["model_args"].get(k, getattr(GPTConfig, k, None)) for k in model_args}
    differ = [f"{k}={saved[k]!r} (this run: {v!r})" for k, v in model_args.items()
              if k not in ("backend", "dropout", "recompute_elementwise", "fused_loss") and saved[k] != v]
    if differ:
        fail(f"{ckpt_path} is a checkpoint of another model: {', '.join(differ)}")
    # the same model on other data (another dataset of the same vocabulary, the corpus prepared again on a machine
    # with other files) would go on as if it were the same run: the data's meta.json must be the one it began with
    # (in the fields both have: a field that another version of prepare_data.py adds is not a difference)
    trained_on = checkpoint.get("meta", {})
    differ = [f"{k} {trained_on[k]!r} (here: {meta[k]!r})" for k in sorted(set(trained_on) & set(meta))
              if trained_on[k] != meta[k]]
    if differ:
        fail(f"{ckpt_path} was trained on other data than {data_path}: {', '.join(differ)}; resume it on its own "
             "data (--dataset, --data_dir), or train a new run into another --out_dir")
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    evals_since_best = checkpoint.get("evals_since_best", 0)
    saved_iter = iter_num
    if iter_num >= max_iters:
        fail(f"{ckpt_path} is at iteration {iter_num}, max_iters = {max_iters}: nothing left to train; "
             "set --max_iters higher", NOTHING_LEFT)
    # a run that ended keeps its best weights, often of an earlier iteration than its end: going on from them
    # would train again what the run has done, so only a higher max_iters or patience continues it
    end = run_end(log_path)
    best = f"its best weights, of iteration {iter_num}, are in {ckpt_path}"
    if end and end["end"] == "max_iters" and end["iter"] >= max_iters:
        fail(f"{out_dir}: the run ended at max_iters = {end['iter']} ({best}): nothing left to train; "
             "set --max_iters higher", NOTHING_LEFT)
    if end and end["end"] == "early stop" and 0 < patience <= end["patience"]:
        fail(f"{out_dir}: the run stopped early at iteration {end['iter']}, no better val loss in {end['patience']} "
             f"evaluations ({best}): nothing left to train at patience = {patience}; set --patience higher "
             "(0: never stop early)", NOTHING_LEFT)
try:
    gptconf = GPTConfig(**model_args)
except ValueError as err:
    fail(str(err))
try:
    switches = dict(backend=backend, recompute_elementwise=recompute_elementwise, fused_loss=fused_loss)
    model = GPT.from_checkpoint(checkpoint, dropout=dropout, **switches) if init_from == "resume" else GPT(gptconf, **switches)
except ValueError as err:
    fail(f"{ckpt_path}: {err}")
model.to(device)
try:
    backend_used = model.set_backend(device_type)
except (ValueError, RuntimeError) as err:
    fail(str(err))
if master_process:
    print(f"{gptconf.mixer} model{f', step rule {step_rule}' if step_rule else ''}{'' if decay else ', no decay'}, "
          f"{model.get_num_params() / 1e6:.2f}M parameters, backend {backend_used}, "
          f"device {device}, dtype {dtype}")

scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")  # float16 needs loss scaling; bf16 does not
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if init_from == "resume":
    try:
        optimizer.load_state_dict(checkpoint["optimizer"])
    except (KeyError, ValueError, TypeError, IndexError) as err:
        fail(f"{ckpt_path}: its optimizer state cannot be loaded ({type(err).__name__}: {err}): a damaged file")
    if any(t.dim() and t.shape != p.shape for p in model.parameters() for t in optimizer.state.get(p, {}).values()):
        fail(f"{ckpt_path}: its optimizer state does not match the model's weights (another version of train.py?)")
    if scaler.is_enabled() and checkpoint.get("scaler"):  # empty when saved by a run not in float16: a fresh scale
        scaler.load_state_dict(checkpoint["scaler"])
    rng = checkpoint["rng"]
    try:
        random.setstate((rng["python"][0], tuple(rng["python"][1]), rng["python"][2]))
        np.random.set_state(("MT19937", rng["numpy"][0].numpy().astype(np.uint32), *rng["numpy"][1:]))
        torch.set_rng_state(rng["torch"].cpu())
        if torch.cuda.is_available() and rng.get("cuda"):
            torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])
    except (KeyError, ValueError, TypeError, IndexError, AttributeError, RuntimeError) as err:
        fail(f"{ckpt_path}: its random number generator states cannot be restored ({type(err).__name__}: {err}): "
             "a damaged file")
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
    if not all(torch.isfinite(t).all() for t in obj["model"].values() if t.is_floating_point()):
        fail(f"the weights are not finite at iteration {iter_num}; {ckpt_path} keeps the last good ones")
    global saved_iter
    tmp = ckpt_path + ".tmp"
    with uninterrupted():
        try:
            with open(tmp, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, ckpt_path)
            dir_fd = os.open(out_dir, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # makes the rename itself durable
            finally:
                os.close(dir_fd)
        except BaseException as err:
            if os.path.exists(tmp):
                os.remove(tmp)
            if not isinstance(err, OSError):
                raise
            fail(f"cannot write {ckpt_path} at iteration {iter_num}: {write_error(err)}; the last checkpoint saved is "
                 "untouched" + ("; free some space, then continue with --init_from=resume" if err.errno == errno.ENOSPC
                                else ""))
        saved_iter = iter_num


def log(record):
    """Append one record to out_dir/log.jsonl, the machine-readable twin of the printed lines."""
    try:
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as err:
        fail(f"cannot write {log_path}: {write_error(err)}")


def write_error(err):
    """Why a write failed, for the one-line error."""
    return "no space left on the device" if err.errno == errno.ENOSPC else err.strerror or str(err)


sigint_held = []  # non-empty while a file is being replaced; a Ctrl-C then waits for the end of the write


def checkpoint_held():
    """What ckpt_path holds, for the one line of a run stopped by Ctrl-C or out of memory."""
    return (f"{ckpt_path} holds iteration {saved_iter} (continue with --init_from=resume)" if saved_iter is not None
            else "no checkpoint was saved yet (run it again from scratch)")


def on_sigint(signum, frame):
    """Ctrl-C: one line saying where the run stopped and what its checkpoint holds, and exit status 130 (a
    shell's for an interrupted command), instead of a KeyboardInterrupt traceback. During a checkpoint or log
    write it waits for the write to end (uninterrupted), so that the file is the new one or the old one."""
    if sigint_held:
        sigint_held.append(signum)
        return
    if master_process:
        print(f"interrupted at iteration {iter_num}; {checkpoint_held()}", file=sys.stderr, flush=True)
    unlock_out_dir()
    sys.exit(130)  # 128 + SIGINT


@contextmanager
def uninterrupted():
    """A write that a Ctrl-C does not cut short: the interrupt, if one came, takes effect once it is done."""
    sigint_held.append(None)
    try:
        yield
    finally:
        came = len(sigint_held) > 1
        sigint_held.clear()
    if came:
        on_sigint(signal.SIGINT, None)


signal.signal(signal.SIGINT, on_sigint)
if master_process:
    # a new run starts a new log; a resumed one keeps the records of the iterations before its checkpoint's,
    # so that the log is that of the run it continues (a killed run may have logged past its last checkpoint)
    kept = []
    if init_from == "resume" and os.path.exists(log_path):
        for line in open(log_path, errors="replace"):
            try:
                if line.endswith("\n") and json.loads(line)["iter"] < iter_num:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):  # a line cut short by a kill
                pass
    tmp = log_path + ".tmp"
    try:
        with uninterrupted():
            with open(tmp, "w") as f:
                f.writelines(kept)
            os.replace(tmp, log_path)
    except OSError as err:
        if os.path.exists(tmp):
            os.remove(tmp)
        fail(f"cannot write {log_path}: {write_error(err)}")


# MFU is measured against the bf16 dense peak of the GPU found; unknown GPUs and CPUs print n/a
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12,
              "4090": 165e12}
peak_flops = None
if device_type == "cuda":
    gpu_name = torch.cuda.get_device_name()
    peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in gpu_name), None)


def nonfinite(loss, grad_norm):
    """What is wrong with a step's loss and gradient norm, or None. (float16's loss scaler expects inf
    gradients now and then: it skips those steps itself and lowers its scale.)"""
    if not math.isfinite(loss):
        return f"the loss is {loss}"
    if not math.isfinite(grad_norm) and not scaler.is_enabled():
        return f"the gradient norm is {grad_norm}"
    return None


def check_steps():
    """Read the loss and gradient norm of every step since the last call, the one wait for the GPU that
    logging or evaluating makes anyway, and stop at the first non-finite one: its update and those after it
    are never saved, as saving comes after an evaluation, which calls this first. The last step's loss."""
    values = torch.stack([s for _, s in steps]).tolist() if steps else []
    for (it, _), (loss, grad_norm) in zip(steps, values):
        what = nonfinite(loss, grad_norm)
        if what:
            fail(f"{what} at iteration {it}; stopping without saving these weights ({ckpt_path} keeps the last "
                 "good ones; --skip_nonfinite=True would skip such batches)")
    steps.clear()
    return values[-1][0] if values else float("nan")


def on_out_of_memory(kind, err, tb):
    """Out of memory while training or evaluating: one line naming the settings that size the memory and what the
    checkpoint holds, exit status 1, instead of a traceback (other errors keep theirs)."""
    if not (issubclass(kind, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(err)):
        return sys.__excepthook__(kind, err, tb)
    print(f"error: out of memory on {device} at iteration {iter_num} with batch_size = {batch_size}, block_size = "
          f"{block_size}: lower batch_size (raising gradient_accumulation_steps as much keeps the {tokens_per_iter:,} "
          f"tokens a step; recompute_elementwise=True and fused_loss=True keep less); {checkpoint_held()}",
          file=sys.stderr, flush=True)
    unlock_out_dir()


sys.excepthook = on_out_of_memory

# training loop
# micro-batch m of process r is global micro-batch r * gradient_accumulation_steps + m: one process with
# 8 micro-batches and 8 processes with one each train on the same batches
X, Y, cu_seqlens = get_batch("train", (0, iter_num, rank * gradient_accumulation_steps))
steps = []  # (iteration, its loss and gradient norm on the device) since the last check_steps
t0, n_timed = time.time(), 0  # the time per iteration is measured over the iterations between two log lines
resumed_at = iter_num if init_from == "resume" else None  # the checkpoint's iteration, evaluated before its save
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    # a resumed run evaluates its checkpoint again, also between eval_interval's iterations: the log it continues
    # then has that evaluation whatever its eval_interval (the records from the checkpoint's iteration on are new)
    if iter_num % eval_interval == 0 or iter_num in (max_iters, resumed_at):
        check_steps()
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
                    save_checkpoint()
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
    step = torch.stack([loss_sum.float(), grad_norm.float()])  # stays on the device until check_steps
    what = nonfinite(*step.tolist()) if skip_nonfinite else None  # skipping needs the answer before the update
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
        lossf = check_steps()
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
unlock_out_dir()
if ddp:
    dist.destroy_process_group()
