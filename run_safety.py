"""
What keeps a run of train.py from losing work or failing late, kept out of train.py's reading path: the lock on
out_dir, the checks of the data and of a resume, the checkpoint (read as data only, written whole or not at all),
log.jsonl, and Ctrl-C / out-of-memory handling, each failure one line on stderr and an exit status below, never a
traceback. docs/robustness.md lists every case and the test that holds it.

Nothing heavy is imported at the top, so that train.py can make Ctrl-C one line (start) before it imports torch,
and experiments.py, which takes its exit statuses from here, stays quick to start: torch, numpy and prepare_data
are imported where they are used.
"""
import errno
import json
import math
import os
import random
import signal
import sys
from contextlib import contextmanager

# exit statuses, besides 0, 1 (an error) and configurator.py's 2 (a setting)
NOTHING_LEFT = 3  # a resume with nothing left to train: experiments.py then evaluates the run
IN_USE = 75  # EX_TEMPFAIL: out_dir is in use by another train.py, which experiments.py leaves to train it
INTERRUPTED = 130  # 128 + SIGINT, a shell's status for a command stopped by Ctrl-C

# the entries of train.py's checkpoints and their types; read_checkpoint checks those that its caller reads
CHECKPOINT_FIELDS = {"model": dict, "model_args": dict, "meta": dict, "config": dict, "optimizer": dict, "rng": dict,
                     "iter_num": int, "best_val_loss": (int, float)}

_lock = []  # the file descriptor that holds out_dir's lock while the run trains
_made_dirs = []  # the folders that the run made for out_dir, innermost first
_held = []  # non-empty while a file is being replaced: a Ctrl-C then waits for the end of the write
_run = {}  # what the Ctrl-C and out-of-memory lines say of the run (watch); saved: the checkpoint's iteration


def start():
    """Called by train.py first thing, before it imports torch: from here on a Ctrl-C is one line (on_sigint), while
    torch is imported and the model built too. Forgets a run made earlier in the same process (as the tests do)."""
    _run.clear()
    _made_dirs.clear()
    unlock_out_dir()
    signal.signal(signal.SIGINT, on_sigint)


def fail(msg, status=1):
    """Bad input or a broken run: one line on stderr and a non-zero exit, never a traceback. The folders of out_dir
    that this run made are removed again while nothing is in them (a setting refused once the data is read)."""
    print(f"error: {msg}", file=sys.stderr)
    _release(status)


def _release(status):
    """Let go of out_dir (its lock, the empty folders this run made, the process group) and exit with status."""
    unlock_out_dir()
    for path in _made_dirs:
        try:
            os.rmdir(path)  # only an empty folder
        except OSError:
            pass
    dist = sys.modules.get("torch.distributed")
    if dist and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)


def claim_out_dir(out_dir, init_from):
    """Make out_dir and lock it, so that a second train.py into it (a command typed twice, two experiments.py over one
    --root) stops at once instead of writing over this run's checkpoint and log; the OS drops the lock when the
    process ends, by a kill too (no lock where the OS or the file system has none). A run still training there is
    named before anything about its files. A run from scratch then refuses to write over another run's results: its
    checkpoint, its eval.json or a log with an evaluation past iteration 0 (a run that failed or was killed before
    evaluating a trained model is started again)."""
    missing = os.path.abspath(out_dir)
    while not os.path.exists(missing):
        _made_dirs.append(missing)
        missing = os.path.dirname(missing)
    fd, busy = _make_and_lock(out_dir, "out_dir ")
    if busy:
        fail(f"{out_dir} is in use by another train.py that has not ended: wait for it, or train into another "
             "--out_dir", IN_USE)
    if fd is not None:
        _lock.append(fd)
    ckpt_path, log_path = os.path.join(out_dir, "ckpt.pt"), os.path.join(out_dir, "log.jsonl")
    if init_from == "scratch":
        evaluated = max((r["iter"] for r in read_log(log_path) if "val_loss" in r), default=0)
        found = [path for path in (ckpt_path, os.path.join(out_dir, "eval.json")) if os.path.exists(path)]
        found += [log_path] * (evaluated > 0)
        if found:
            what = " and ".join(map(os.path.basename, found))
            what += f", evaluated up to iteration {evaluated}" if evaluated else ""
            held = (f"{ckpt_path} holds a trained model: continue it with --init_from=resume, or train from scratch"
                    if os.path.exists(ckpt_path) else
                    f"{out_dir} holds another run's results ({what}) but no checkpoint: train from scratch")
            fail(f"{held} into another --out_dir (or delete {', '.join(found)} first)")


def _make_and_lock(path, name=""):
    """Make the folder path (name: what it is, for the error) and try to lock it: (its file descriptor, held until
    closed, or None, whether another process holds it: prepare_data.lock_folder)."""
    import prepare_data
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        fail(f"cannot make {name}{path}: {err.strerror or err}")
    return prepare_data.lock_folder(path)


def unlock_out_dir():
    """Let go of out_dir's lock at the end of the run (for a script run again in the same process, as the tests do)."""
    while _lock:
        os.close(_lock.pop())


def open_output(path, append=False):
    """path (a run's stdout.txt or eval.txt) opened for the output of the process about to be started there, with an
    exclusive lock that the process keeps while it runs (its stdout is the same open file), also when the script that
    started it is killed: None while another process holds it (the same run started by another experiments.py over
    the same --root), whose file is then left untouched. Emptied first unless append; no lock where the OS or the
    file system has none."""
    f = open(path, "a")
    try:
        import fcntl
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    except (ImportError, OSError):
        pass
    if not append:
        f.truncate(0)
    return f


def read_log(path):
    """The records of a log.jsonl ([] without one); a line cut short by a kill is left out."""
    records = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if line.endswith("\n") and isinstance(record, dict) and isinstance(record.get("iter"), int):
                    records.append(record)
    except OSError:
        pass
    return records


# -----------------------------------------------------------------------------
# data


def read_data(config, tokens_per_iter, master, ddp):
    """The dataset of the settings config (dataset, data_dir, ...), prepared if it is a built-in one that is missing:
    its meta.json and the number of tokens of its training split, once its files are whole and fit the settings;
    one line naming the file otherwise."""
    c = config
    prepare_data_once(c["dataset"], c["data_dir"], master, ddp)
    data_path = os.path.join(c["data_dir"], c["dataset"])
    meta = read_meta(data_path, c["dataset"], c["block_size"], c["documents"], c["sample_tokens"], master)
    n_tokens = [count_tokens(os.path.join(data_path, f"{split}.bin"), meta, c["block_size"],
                             c["single_pass"] and split == "train", c["max_iters"], tokens_per_iter)
                for split in ("train", "val")]
    return meta, n_tokens[0]


def prepare_data_once(dataset, data_dir, master, ddp):
    """Prepare a built-in dataset that is missing (meta.json marks a complete one). Two train.py that find it missing
    at once (two experiments.py, two terminals) take turns on a lock of its folder: the second waits, then finds it
    prepared. A Ctrl-C meanwhile is prepare_data's one line, with its exit status."""
    import prepare_data
    data_path = os.path.join(data_dir, dataset)
    if os.path.exists(os.path.join(data_path, "meta.json")) or dataset not in prepare_data.DATASETS:
        return
    if master:
        fd, busy = _make_and_lock(data_path)
        if busy:
            print(f"{data_path} is being prepared by another process: waiting for it", flush=True)
            import fcntl
            fd = os.open(data_path, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if not os.path.exists(os.path.join(data_path, "meta.json")):
                print(f"{data_path} not found, preparing it")
                signal.signal(signal.SIGINT, signal.default_int_handler)  # prepare_data's own Ctrl-C line
                prepare_data.prepare(dataset, data_dir)
        except SystemExit as err:  # prepare_data's one line (e.g. offline), given as this run's error
            if isinstance(err.code, int):  # its Ctrl-C, said already
                _release(err.code)
            fail(str(err.code).removeprefix("error: "))
        finally:
            signal.signal(signal.SIGINT, on_sigint)
            if fd is not None:
                os.close(fd)
    if ddp:
        import torch.distributed as dist
        dist.barrier()


def read_meta(data_path, dataset, block_size, documents, sample_tokens, master):
    """The dataset's meta.json, once its files are there and fit the settings; one line naming the file otherwise."""
    for name in ("meta.json", "train.bin", "val.bin"):
        if not os.path.exists(os.path.join(data_path, name)):
            fail(f"{os.path.join(data_path, name)} not found; prepare the data first "
                 "(python prepare_data.py --dataset=...)")
    try:
        with open(os.path.join(data_path, "meta.json")) as f:
            meta = json.load(f)
        import numpy as np
        np.dtype(meta["dtype"]), int(meta["vocab_size"]), meta.get("example_length")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        fail(f"{os.path.join(data_path, 'meta.json')} is damaged ({type(err).__name__}: {err}); prepare the data "
             f"again (python prepare_data.py --dataset={dataset})")
    example_length = meta.get("example_length")  # the synthetic tasks: whole examples with their own labels
    if documents and meta.get("eot") is None:
        fail(f"documents=True needs the end-of-text token that ends each document, and {data_path}/meta.json names "
             f"none: prepare the data again (python prepare_data.py --dataset={dataset}); shakespeare_char and the "
             "synthetic tasks have none")
    if example_length and block_size != example_length:
        fail(f"{data_path} holds examples of {example_length} tokens: set --block_size={example_length}")
    # the closing sample is decoded with the data's BPE encoding: one that cannot be loaded (not cached, and offline)
    # stops the run here, not after training
    if master and sample_tokens > 0 and meta.get("tokenizer") == "tiktoken":
        try:
            import tiktoken
            tiktoken.get_encoding(meta["encoding"])
        except Exception as err:  # ImportError, KeyError, or the BPE file neither cached nor downloadable
            fail(f"sample_tokens = {sample_tokens} needs the tiktoken encoding {meta.get('encoding')!r} of "
                 f"{data_path}, which cannot be loaded ({type(err).__name__}: {(str(err).splitlines() or [''])[0]}); "
                 "set --sample_tokens=0, or make the encoding available (pip install tiktoken; offline, set "
                 "TIKTOKEN_CACHE_DIR to a cache that holds it)")
    if not example_length and not os.path.exists(os.path.join(data_path, "test.bin")):  # evaluate.py reports test
        fail(f"{data_path} has no test split (test.bin): prepare it again (python prepare_data.py "
             f"--dataset={dataset}), which splits it by document into train, val and test")
    return meta


def count_tokens(path, meta, block_size, single_pass, max_iters, tokens_per_iter):
    """The number of tokens of a split's file (train.bin, val.bin), once it is whole and large enough for the
    settings (and its labels, for the synthetic tasks); one line naming the file otherwise."""
    import numpy as np
    dtype, example_length = np.dtype(meta["dtype"]), meta.get("example_length")
    if os.path.getsize(path) % dtype.itemsize:
        fail(f"{path} holds {os.path.getsize(path)} bytes, not a whole number of {dtype.name} tokens "
             f"({dtype.itemsize} bytes each): a damaged file; prepare the data again")
    n_tokens = os.path.getsize(path) // dtype.itemsize
    labels = path.removesuffix(".bin") + "_labels.bin"
    if example_length and n_tokens < example_length:
        fail(f"{path} holds no complete example of {example_length} tokens")
    if example_length and not (os.path.exists(labels) and os.path.getsize(labels) == 2 * n_tokens):
        fail(f"{labels} is missing or does not hold one int16 label for each of the {n_tokens} tokens of {path}; "
             "prepare the data again")
    if not example_length and n_tokens <= block_size:
        fail(f"{path} holds {n_tokens} tokens, fewer than block_size + 1 = {block_size + 1}")
    if single_pass:
        if example_length:
            fail("single_pass = True: the synthetic tasks' examples are drawn at random; use it with a language "
                 "dataset")
        n_windows = (n_tokens - 1) // block_size  # window w: tokens w * block_size .. (w + 1) * block_size
        if max_iters * tokens_per_iter > n_windows * block_size:
            fail(f"single_pass = True: max_iters = {max_iters} takes {max_iters * tokens_per_iter:,} tokens, more "
                 f"than the {n_windows * block_size:,} of {path} in windows of {block_size}: at most "
                 f"{n_windows * block_size // tokens_per_iter} iterations")
    return n_tokens


# -----------------------------------------------------------------------------
# checkpoints


def read_checkpoint(path, device="cpu", needs=("model", "model_args")):
    """The dict that train.py saved, read as data only (weights_only=True: nothing in the file runs).
    A missing or damaged file raises ValueError naming it, as does a file that torch.load reads but that lacks an
    entry of needs (CHECKPOINT_FIELDS), or holds one of another type: a tensor saved by other code, a dict of weights
    alone, a hand-edited checkpoint."""
    import torch
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist; train a model first (python train.py "
                         f"--out_dir={os.path.dirname(path) or '.'})")
    try:
        checkpoint = torch.load(path, map_location=device, weights_only=True)
    except Exception as err:
        lines = str(err).splitlines() or [""]
        detail = lines[0]
        if "weights_only" in detail:  # PyTorch's advice to load with weights_only=False: never for an untrusted file
            detail = next((line.strip() for line in lines[1:] if line.strip() and "weights_only" not in line
                           and "WeightsUnpickler" not in line),
                          "not a checkpoint written by train.py, or a damaged one")
        raise ValueError(f"cannot load {path}: {type(err).__name__}: {detail}") from None
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path} holds a {type(checkpoint).__name__}, not the dict of a checkpoint that train.py "
                         "writes (the weights, model_args, meta, ...)")
    missing = [k for k in needs if k not in checkpoint]
    wrong = [f"{k} is a {type(checkpoint[k]).__name__}" for k in needs
             if k in checkpoint and not isinstance(checkpoint[k], CHECKPOINT_FIELDS[k])]
    if "model" in needs and not wrong and "model" in checkpoint and not all(
            isinstance(v, torch.Tensor) for v in checkpoint["model"].values()):
        wrong.append("model holds other things than tensors")
    if missing or wrong:
        raise ValueError(f"{path} is not a checkpoint that train.py writes, or a damaged one: "
                         + "; ".join(([f"it has no {', '.join(map(repr, missing))}"] if missing else []) + wrong))
    return checkpoint


def read_resume(ckpt_path, model_args, config, meta, data_path):
    """The checkpoint that a run resumes from, read on the CPU (the RNG states stay there; train.py moves the weights)
    with the entries a resume reads. Refused: a resume that would not continue the run of the checkpoint (another
    model, other data, other documents=) or has nothing left to train (NOTHING_LEFT)."""
    try:
        checkpoint = read_checkpoint(ckpt_path, needs=("model", "model_args", "optimizer", "rng", "iter_num",
                                                       "best_val_loss"))
    except ValueError as err:
        fail(str(err))
    # dropout may change between runs; a field the checkpoint lacks (saved before the field existed) has its default
    from model import GPTConfig
    saved = {k: checkpoint["model_args"].get(k, getattr(GPTConfig, k, None)) for k in model_args}
    differ = [f"{k}={saved[k]!r} (this run: {v!r})" for k, v in model_args.items() if k != "dropout" and saved[k] != v]
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
    # documents= changes what a batch is (its rows, or the documents packed in them): the rest would be another run
    saved_config = checkpoint.get("config")
    documents = saved_config.get("documents", False) if isinstance(saved_config, dict) else False
    if documents != config["documents"]:
        fail(f"{ckpt_path} was trained with documents={documents}: resume it with --documents={documents}, or train "
             f"a new run with documents={config['documents']} into another --out_dir")
    iter_num, max_iters, patience = checkpoint["iter_num"], config["max_iters"], config["patience"]
    if iter_num >= max_iters:
        fail(f"{ckpt_path} is at iteration {iter_num}, max_iters = {max_iters}: nothing left to train; "
             "set --max_iters higher", NOTHING_LEFT)
    # a run that ended keeps its best weights, often of an earlier iteration than its end: going on from them
    # would train again what the run has done, so only a higher max_iters or patience continues it. An end record
    # before the checkpoint's iteration is of the run before a resume that saved and was then killed
    out_dir = os.path.dirname(ckpt_path)
    log = read_log(os.path.join(out_dir, "log.jsonl"))
    end = log[-1] if log and "end" in log[-1] and log[-1]["iter"] >= iter_num else None
    best = f"its best weights, of iteration {iter_num}, are in {ckpt_path}"
    if end and end["end"] == "max_iters" and end["iter"] >= max_iters:
        fail(f"{out_dir}: the run ended at max_iters = {end['iter']} ({best}): nothing left to train; "
             "set --max_iters higher", NOTHING_LEFT)
    if end and end["end"] == "early stop" and 0 < patience <= end.get("patience", 0):
        fail(f"{out_dir}: the run stopped early at iteration {end['iter']}, no better val loss in {end['patience']} "
             f"evaluations ({best}): nothing left to train at patience = {patience}; set --patience higher "
             "(0: never stop early)", NOTHING_LEFT)
    _run["saved"] = iter_num
    return checkpoint


def nonfinite(loss, grad_norm, scaled):
    """What is wrong with a step's loss and gradient norm, or None. (float16's loss scaler, scaled, expects inf
    gradients now and then: it skips those steps itself and lowers its scale.)"""
    if not math.isfinite(loss):
        return f"the loss is {loss}"
    if not math.isfinite(grad_norm) and not scaled:
        return f"the gradient norm is {grad_norm}"
    return None


def check_steps(steps, scaled, ckpt_path):
    """Read the loss and gradient norm of every step since the last call (steps: (iteration, the two on the device)),
    the one wait for the GPU that logging or evaluating makes anyway, and stop at the first non-finite one: its update
    and those after it are never saved, as saving comes after an evaluation, which calls this first. The last
    step's loss."""
    import torch
    values = torch.stack([s for _, s in steps]).tolist() if steps else []
    for (it, _), (loss, grad_norm) in zip(steps, values):
        what = nonfinite(loss, grad_norm, scaled)
        if what:
            fail(f"{what} at iteration {it}; stopping without saving these weights ({ckpt_path} keeps the last "
                 "good ones; --skip_nonfinite=True would skip such batches)")
    steps.clear()
    return values[-1][0] if values else float("nan")


def restore(checkpoint, ckpt_path, model, optimizer, scaler):
    """The optimizer, the loss scale and the random number generators as the checkpoint saved them."""
    import numpy as np
    import torch
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


def rng_state():
    """The random number generators' states, as tensors, lists and numbers (torch.load(weights_only=True) reads
    them); the data loader's state is (seed, iter_num): see train.py's get_batch."""
    import numpy as np
    import torch
    np_state, py_state = np.random.get_state(), random.getstate()
    return {"python": [py_state[0], list(py_state[1]), py_state[2]],
            "numpy": [torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]),
                      float(np_state[4])],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _write_whole(path, write):
    """write(f) into path + '.tmp', flushed and fsynced: the bytes are on the disk before a rename makes them the
    file. The temporary path."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def save_checkpoint(ckpt_path, checkpoint, log):
    """Write ckpt_path atomically: a complete temporary file is fsynced and renamed over the old one, and the folder
    is fsynced, so a crash at any moment leaves the last good checkpoint. log's records held since a resume (RunLog)
    are written beside it and renamed right after it, so that a save that fails leaves the log as it was too."""
    import torch
    iter_num = checkpoint["iter_num"]
    if not all(torch.isfinite(t).all() for t in checkpoint["model"].values() if t.is_floating_point()):
        fail(f"the weights are not finite at iteration {iter_num}; {ckpt_path} keeps the last good ones")
    tmps, writing = [], ckpt_path
    with uninterrupted():
        try:
            tmps.append(_write_whole(ckpt_path, lambda f: torch.save(checkpoint, f)))
            if log.held is not None:
                writing = log.path
                tmps.append(_write_whole(log.path, lambda f: f.write("".join(log.held).encode())))
            for tmp in tmps:
                os.replace(tmp, tmp.removesuffix(".tmp"))
            _fsync_folder(ckpt_path)
        except BaseException as err:
            _remove(*(path + ".tmp" for path in (ckpt_path, log.path)))
            if not isinstance(err, OSError):
                raise
            if writing == log.path:
                fail(f"cannot write {log.path}: {write_error(err)}")
            fail(f"cannot write {ckpt_path} at iteration {iter_num}: {write_error(err)}; the last checkpoint saved is "
                 "untouched" + ("; free some space, then continue with --init_from=resume" if err.errno == errno.ENOSPC
                                else ""))
        log.held = None
        _run["saved"] = iter_num


def _fsync_folder(path):
    """Make a rename in path's folder durable."""
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(*paths):
    for path in paths:
        if os.path.exists(path):
            os.remove(path)


def write_error(err):
    """Why a write failed, for the one-line error."""
    return "no space left on the device" if err.errno == errno.ENOSPC else err.strerror or str(err)


class RunLog:
    """out_dir/log.jsonl, the machine-readable twin of the printed lines; log(record) appends one. A new run starts
    a new log. A resumed one keeps the records of the iterations before its checkpoint's, so that the log is that of
    the run it continues (a killed run may have logged past its last checkpoint), and holds its own records in memory
    until it first saves a checkpoint (save_checkpoint writes them with it) or logs its end: a resume that fails before
    (out of memory at once, a full disk at its first save) leaves the log of the run as it was, end record included."""

    def __init__(self, path, resumed_at=None):
        self.path = path
        records = read_log(path) if resumed_at is not None else []
        self.held = [json.dumps(r) + "\n" for r in records if r["iter"] < resumed_at and "end" not in r]
        if len(self.held) == len(records):  # nothing of the log is dropped (a new run, a resume without a log)
            self.commit()

    def __call__(self, record):
        line = json.dumps(record) + "\n"
        if self.held is not None:
            self.held.append(line)
            if "end" in record:
                self.commit()
            return
        try:
            with open(self.path, "a") as f:
                f.write(line)
        except OSError as err:
            fail(f"cannot write {self.path}: {write_error(err)}")

    def commit(self):
        """Replace the log with the records held."""
        with uninterrupted():
            try:
                os.replace(_write_whole(self.path, lambda f: f.write("".join(self.held).encode())), self.path)
            except OSError as err:
                _remove(self.path + ".tmp")
                fail(f"cannot write {self.path}: {write_error(err)}")
        self.held = None


# -----------------------------------------------------------------------------
# Ctrl-C and out of memory


def checkpoint_held():
    """What the checkpoint holds, for the one line of a run stopped by Ctrl-C or out of memory."""
    return (f"{_run['ckpt_path']} holds iteration {_run['saved']} (continue with --init_from=resume)"
            if _run.get("saved") is not None else "no checkpoint was saved yet (run it again from scratch)")


def on_sigint(signum, frame):
    """Ctrl-C: one line and exit status 130 instead of a KeyboardInterrupt traceback; once the run is watched, the
    line says where it stopped and what its checkpoint holds. During a checkpoint or log write it waits for the
    write to end (uninterrupted), so that the file is the new one or the old one."""
    if _held:
        _held.append(signum)
        return
    if "where" not in _run:
        print("interrupted", file=sys.stderr, flush=True)
    elif _run["master"]:
        print(f"interrupted at iteration {_run['where']()}; {checkpoint_held()}", file=sys.stderr, flush=True)
    unlock_out_dir()
    sys.exit(INTERRUPTED)


@contextmanager
def uninterrupted():
    """A write that a Ctrl-C does not cut short: the interrupt, if one came, takes effect once it is done."""
    _held.append(None)
    try:
        yield
    finally:
        came = len(_held) > 1
        _held.clear()
    if came:
        on_sigint(signal.SIGINT, None)


def watch(ckpt_path, where, master, out_of_memory):
    """From here on a Ctrl-C names the iteration where() and what ckpt_path holds, and out of memory while training or
    evaluating (CUDA's error, or an allocation the CPU refuses) is one line, out_of_memory() then what ckpt_path
    holds, exit status 1, instead of a traceback (other errors keep theirs)."""
    import torch
    _run.update(ckpt_path=ckpt_path, where=where, master=master)

    def on_exception(kind, err, tb):
        if not (issubclass(kind, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(err)):
            return sys.__excepthook__(kind, err, tb)
        print(f"error: {out_of_memory()}; {checkpoint_held()}", file=sys.stderr, flush=True)
        unlock_out_dir()
    sys.excepthook = on_exception
