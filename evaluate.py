"""
Evaluate a trained model (train.py's out_dir/ckpt.pt) at and beyond its training length.

Synthetic tasks (mqar, sniah, stack, palindrome): accuracy at the scored positions (MQAR's queries, the
stack's popped values, the palindrome's reversed half), the argmax over the whole vocabulary against the label,
on every test set prepare_data.py wrote (e.g. 1x, 2x, 4x, 8x the training length).
Language modelling: the loss on the held-out test split, and beside it on the validation split (which chose
the learning rate and the checkpoint), at several multiples of the training context, on random windows of
each split (the same windows for every model, by seed). A dataset without a test split, or split otherwise
than the data the model was trained on, is refused: its test documents may have been trained on.

Sequences are read in segments of the training context with the state carried across them (the recurrent
state of KLA / GDN; attention's KV cache; in a hybrid each layer its own), which computes exactly what one pass over
the whole sequence would, with the memory of one segment's logits. With --documents=True (the BPE datasets) each window is read
as its documents instead, as train.py --documents=True trains: in one pass, the state and the attention of
each document its own, the token after an end-of-text not predicted.

$ python evaluate.py --out_dir=out-mqar-kla
$ python evaluate.py --out_dir=out --factors=1,2,4,8,16 --eval_batches=20
Prints a table and writes it to out_dir/eval.json, the run's result (experiments.py takes it as such); for a
run that a train.py is still training, whose checkpoint is not its last, it only prints the table.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train.py

import json
import sys
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from model import GPT, doc_seqlens
from prepare_data import lock_folder, write_file
from run_safety import read_checkpoint

# -----------------------------------------------------------------------------
out_dir = "out"
data_dir = ""  # default: the data_dir the model was trained with
batch_size = 32
factors = "1,2,4,8,16"  # language modelling: multiples of the training context
eval_batches = 10  # language modelling: batches of windows at each length
max_examples = 0  # synthetic recall: at most this many test examples at each length; 0 for all
documents = False  # language modelling: each window read as its documents (see train.py), one window per pass
padded = False  # language modelling: also each test document alone, padded with end-of-text tokens (lm_padded)
seed = 1337
device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
# -----------------------------------------------------------------------------


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


def in_training(path):
    """Whether a train.py holds the lock on the folder path that it holds while it trains (train.py's lock_out_dir).
    The probe takes a shared lock, which train.py's exclusive one excludes, and lets go of it at once."""
    fd, busy = lock_folder(path, exclusive=False)
    if fd is not None:
        os.close(fd)
    return busy


# every setting checked before any work: one line naming the value and what it may be (configurator.py)
device_type = check_device(device, dtype)
check("batch_size", batch_size >= 1, ">= 1")
check("factors", all(f.strip().isdecimal() and int(f) >= 1 for f in factors.split(",")),
      "integers >= 1 separated by commas, e.g. 1,2,4,8")
check("eval_batches", eval_batches >= 1, ">= 1")
check("max_examples", max_examples >= 0, ">= 0 (0: all)")
check("seed", seed >= 0, ">= 0")
check_run_folder()
check("data_dir", not os.path.isfile(data_dir), "a folder ('': the one the model was trained with), not a file")
settings_checked()
quit_on_ctrl_c()

ckpt_path = os.path.join(out_dir, "ckpt.pt")
eval_path = os.path.join(out_dir, "eval.json")
training = in_training(out_dir)  # its checkpoint is evaluated, but it is not the run's result
if training:
    print(f"{out_dir} is in use by a train.py that has not ended: the results are printed, {eval_path} is not written",
          flush=True)
try:
    checkpoint = read_checkpoint(ckpt_path, device, needs=("model", "model_args", "meta", "config", "iter_num"))
    model = GPT.from_checkpoint(checkpoint, backend="auto").to(device).eval()  # the fastest path here
except ValueError as err:
    fail(f"{ckpt_path}: {err}" if ckpt_path not in str(err) else str(err))
ctx = nullcontext() if dtype == "float32" else torch.autocast(device_type=device_type, dtype=getattr(torch, dtype))
model.set_backend(device_type)
meta, config = checkpoint["meta"], checkpoint["config"]
block_size = checkpoint["model_args"]["block_size"]
data_path = os.path.join(data_dir or config["data_dir"], config["dataset"])
PREPARE = f"python prepare_data.py --dataset={config['dataset']}"  # what makes the data again
PREPARE_AGAIN = f"prepare the data again ({PREPARE})"
if documents or padded:  # the end-of-text token of the data read here
    try:
        with open(os.path.join(data_path, "meta.json")) as f:
            eot = json.load(f).get("eot")
    except (OSError, ValueError, AttributeError):
        eot = None
    if eot is None:
        given = " and ".join(f"{k}=True" for k, v in (("documents", documents), ("padded", padded)) if v)
        fail(f"{given} need{'' if documents and padded else 's'} the end-of-text token that ends each document, and "
             f"{data_path}/meta.json names none: {PREPARE_AGAIN}; shakespeare_char and the synthetic tasks have none")
if "test_lengths" not in meta:  # language modelling: the numbers reported come from the test split
    if not os.path.exists(os.path.join(data_path, "test.bin")):
        fail(f"{data_path} has no test split (test.bin): prepare it again ({PREPARE}), which splits it by document "
             "into train, val and test, then train again")
    if "test_tokens" not in meta:
        fail(f"{ckpt_path} was trained on data without a test split, whose training split may hold the test "
             "documents: train it again on the data as prepare_data.py splits it")
    try:
        with open(os.path.join(data_path, "meta.json")) as f:
            data_meta = json.load(f)
        there = [data_meta[f"{split}_tokens"] for split in ("train", "val", "test")]
    except (OSError, ValueError, KeyError, TypeError) as err:
        fail(f"{data_path}/meta.json is missing or damaged ({type(err).__name__}: {err}); {PREPARE_AGAIN}")
    trained_on = [meta[f"{split}_tokens"] for split in ("train", "val", "test")]
    if there != trained_on:
        fail(f"{data_path} is not split as the data {ckpt_path} was trained on (train / val / test tokens "
             f"{' / '.join(map(str, there))} against {' / '.join(map(str, trained_on))}): evaluate it on that data "
             "(--data_dir)")


def read(name, dtype, length):
    """The data file name mapped: (examples, length) for length > 0, else its tokens. A file that is missing, empty
    or cut short (not a whole number of tokens or examples) is one line naming it."""
    path = os.path.join(data_path, name)
    if not os.path.exists(path):
        fail(f"{path} not found; prepare the data first ({PREPARE})")
    dtype, size = np.dtype(dtype), os.path.getsize(path)
    unit = dtype.itemsize * max(length, 1)
    if size == 0 or size % unit:
        what = f"examples of {length} {dtype.name} values" if length else f"{dtype.name} tokens"
        held = "is empty" if not size else f"holds {size} bytes, not a whole number of {what} ({unit} bytes each)"
        fail(f"{path} {held}: a damaged file; {PREPARE_AGAIN}")
    data = np.memmap(path, dtype=dtype, mode="r")
    return data.reshape(-1, length) if length else data


if "test_lengths" not in meta:  # every window against every split it is drawn from, before any evaluation
    for split in ("test", "val"):
        tokens = len(read(f"{split}.bin", np.dtype(meta["dtype"]), 0))
        too_long = [int(f) for f in factors.split(",") if int(f) * block_size >= tokens]
        if too_long:
            fail(f"factors = {factors!r}: the {split} split holds {tokens} tokens, too few for windows of "
                 f"{too_long[0] * block_size} (factor {too_long[0]} x block_size {block_size}); the factors it allows "
                 f"are 1 to {(tokens - 1) // block_size}")
else:  # every test set and its labels, before the first is evaluated
    test_sets = {}
    for length in meta["test_lengths"]:
        x, y = read(f"test_{length}.bin", np.uint16, length), read(f"test_{length}_labels.bin", np.int16, length)
        if len(x) != len(y):
            fail(f"{data_path}/test_{length}_labels.bin holds the labels of {len(y)} examples, and test_{length}.bin "
                 f"{len(x)} examples: a damaged file; {PREPARE_AGAIN}")
        test_sets[length] = x, y


@torch.no_grad()
def segments(x, y):
    """(logits, mean loss, targets) of consecutive block_size segments of the sequences x, y (B, T), the state
    carried from one segment to the next."""
    X, Y = (torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device) for a in (x, y))
    cache = model.new_cache()
    for s in range(0, X.shape[1], block_size):
        with ctx:
            logits, loss = model(X[:, s:s + block_size], Y[:, s:s + block_size], cache=cache)
        yield logits, loss, Y[:, s:s + block_size]


@torch.no_grad()
def packed(x, y):
    """(logits, mean loss, targets) of each sequence of x, y (B, T) read in one pass as its documents (train.py's
    documents=True): a document starts at the sequence's start and after each end-of-text token, whose
    target (the next document's first token) is not predicted (-1)."""
    for row_x, row_y in zip(x, y):
        X, Y = torch.tensor(row_x[None]), torch.tensor(row_y[None])  # (1, T), copies: x and y share their memory
        cu_seqlens = doc_seqlens(X, eot).to(device)
        Y[X == eot] = -1
        X, Y = X.to(device), Y.to(device)
        with ctx:
            logits, loss = model(X, Y, cu_seqlens=cu_seqlens)
        yield logits, loss, Y


def recall_accuracy(length):
    x, y = test_sets[length]
    n = min(len(x), max_examples or len(x))
    correct = total = 0
    for i in range(0, n, batch_size):
        for logits, _, Y in segments(x[i:min(i + batch_size, n)], y[i:min(i + batch_size, n)]):
            asked = Y != -1
            correct += (logits.argmax(-1)[asked] == Y[asked]).sum().item()
            total += asked.sum().item()
    return {"length": length, "accuracy": correct / total, "queries": total, "examples": n}


def lm_loss(split, length):
    """The mean loss on eval_batches batches of random windows of split, and the number of tokens predicted."""
    data = read(f"{split}.bin", np.dtype(meta["dtype"]), 0)  # longer than length: checked above
    rng = np.random.default_rng(seed)
    total = count = 0
    for _ in range(eval_batches):
        ix = rng.integers(len(data) - length, size=batch_size)
        batch = np.stack([data[i:i + length + 1] for i in ix]).astype(np.int64)
        for _, loss, Y in (packed if documents else segments)(batch[:, :-1], batch[:, 1:]):
            n = (Y != -1).sum().item()  # the model's mean over them (NaN for none)
            total, count = total + (loss.item() * n if n else 0.0), count + n
    return total / count, count


def lm_padded(length):
    """Each test document from its start in a window of its own, cut at length tokens or padded to length with
    end-of-text tokens, as in validation files whose rows are padded after the end of the text: the mean loss over
    every position (the padding's targets counted, which KLA's paper's 8.09 / 8.50 validation perplexities appear
    to do) and over the document's own targets only (its tokens and the end-of-text that ends it); and the share
    of padding among the targets."""
    data = np.asarray(read("test.bin", np.dtype(meta["dtype"]), 0), dtype=np.int64)
    ends = np.flatnonzero(data == eot)
    starts = np.concatenate([[0], ends + 1])[:len(ends)]  # a document: its tokens and the end-of-text after it
    windows = np.full((len(starts), length + 1), eot, dtype=np.int64)
    real = np.zeros((len(starts), length), dtype=bool)  # the targets that are the document's own
    for i, (s, e) in enumerate(zip(starts, ends)):
        n = min(e + 1 - s, length + 1)
        windows[i, :n] = data[s:s + n]
        real[i, :n - 1] = True
    losses = []
    for i in range(0, len(windows), batch_size):
        w = windows[i:i + batch_size]
        losses.append(torch.cat([F.cross_entropy(logits.float().transpose(1, 2), Y, reduction="none").cpu()
                                 for logits, _, Y in segments(w[:, :-1], w[:, 1:])], 1))
    loss, real = torch.cat(losses), torch.from_numpy(real)
    return {"padded_loss": loss.mean().item(), "document_loss": loss[real].mean().item(),
            "padding_share": 1 - real.float().mean().item(), "documents": len(windows)}


def lm_losses(length):
    (test_loss, tokens), (val_loss, _) = lm_loss("test", length), lm_loss("val", length)
    return {"length": length, "test_loss": test_loss, "val_loss": val_loss, "tokens": tokens,
            **(lm_padded(length) if padded else {})}


if "test_lengths" in meta:
    results = [recall_accuracy(length) for length in meta["test_lengths"]]
    columns = ["accuracy"]
else:
    results = [lm_losses(int(f) * block_size) for f in factors.split(",")]
    columns = ["test_loss", "val_loss"] + ["padded_loss", "document_loss", "padding_share"] * padded
name = f"{config['dataset']}, mixer {checkpoint['model_args']['mixer']}, trained at {block_size} tokens" \
    + (", read as documents" if documents else "")
table = [f"{name}\n\n| length | x train | {' | '.join(c.replace('_', ' ') for c in columns)} |\n|---|---|"
         + "---|" * len(columns)]
table += [f"| {r['length']} | {r['length'] / block_size:g} | " + " | ".join(f"{r[c]:.4f}" for c in columns) + " |"
          for r in results]
unwritten = None
if not training:  # written before the table is printed: a reader of the output that stops early (| head) loses nothing
    try:  # atomically: a write cut short (a full disk) leaves no eval.json half written, and an old one as it was
        write_file(eval_path, {"dataset": config["dataset"], "mixer": checkpoint["model_args"]["mixer"],
                               "seed": config["seed"], "iter_num": checkpoint["iter_num"], "documents": documents,
                               "padded": padded, "results": results})
    except OSError as err:
        unwritten = f"cannot write {eval_path}: {err.strerror}"
print("\n".join(table), flush=True)
if unwritten:
    fail(unwritten)
