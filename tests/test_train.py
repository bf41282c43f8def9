"""
train.py, configurator.py and sample.py run as subprocesses on a tiny corpus with a tiny model, as a user runs them:
logs, exact resume, DDP on 2 CPU processes, and the failure cases of docs/robustness.md.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import prepare_data
import run_safety
from model import GPT

from helpers import (
    ROOT, TINY, assert_clean_error, assert_each_is_one_line, run, run_each, tiny_config, tiny_corpus,
    train_in_background, train_log, wait_until,
)


def training(out):
    """Whether the run into out has logged a few iterations."""
    return (out / "log.jsonl").exists() and len(train_log(out)) >= 3


@pytest.mark.slow
def test_single_pass_trains_on_each_window_once(tmp_path):
    """single_pass=True: the training windows are the train split cut end to end, in a seeded order, none used
    twice; a max_iters that needs more windows than the split holds is one line before any work."""
    d = tmp_path / "ids"
    ids = np.arange(1, 3001)  # every token id once: a window's first id says where the window starts
    prepare_data.write_dataset(str(d), np.split(ids, np.arange(100, 3000, 100)), {"vocab_size": 4096, "tokenizer": "none"})
    train = np.fromfile(d / "train.bin", dtype=np.uint16)
    n_windows = (len(train) - 1) // 16  # TINY's block_size
    iters = n_windows * 16 // 64  # 4 x 16 tokens an iteration
    args = [*TINY, f"--data_dir={tmp_path}", "--dataset=ids", "--single_pass=True", f"--out_dir={tmp_path / 'out'}"]
    record = ("import runpy, sys, numpy as np; seen = []\n"  # the windows of every training batch get_batch returns
              "def prof(frame, event, arg):\n"
              "    if event == 'return' and frame.f_code.co_name == 'get_batch' and frame.f_locals['key'][0] == 0:\n"
              "        seen.append(frame.f_locals['ix'].copy())\n"
              "sys.setprofile(prof); sys.argv = sys.argv[1:]\n"
              "try: runpy.run_path(sys.argv[0], run_name='__main__')\n"
              f"finally: np.save({str(tmp_path / 'seen.npy')!r}, np.concatenate(seen))")
    p = run("-c", record, os.path.join(ROOT, "train.py"), *args, f"--max_iters={iters}")
    assert p.returncode == 0, p.stderr
    starts = np.load(tmp_path / "seen.npy")[:iters * 4]  # the prefetched batch after the last step left out
    assert len(starts) == iters * 4 and all(s % 16 == 0 for s in starts) and len(set(starts.tolist())) == len(starts)
    assert sorted(starts.tolist()) != starts.tolist()  # shuffled
    assert_each_is_one_line("train.py", [(f"--max_iters={iters + 1}", f"at most {iters} iterations")], *args,
                            f"--out_dir={tmp_path / 'other'}")
    assert not os.path.exists(tmp_path / "other" / "log.jsonl")


# -----------------------------------------------------------------------------
# train.py and configurator.py


def test_train_logs(trained):
    log = train_log(trained)
    steps = [r for r in log if "loss" in r]
    assert [r["iter"] for r in steps] == list(range(8))
    assert all(r["mfu"] is None and r["tok_s"] > 0 and r["ms"] > 0 for r in steps)  # MFU n/a on CPU
    evals = [r for r in log if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 4, 8]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]


def test_resume_is_exact(trained, tiny_data, tmp_path):
    """4 iterations, then a resume to 8, reproduce the 8-iteration run's losses and weights exactly. What a
    killed run logged after its last checkpoint (a line cut short too) is dropped: the log is the run's."""
    out = str(tmp_path / "half")
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--eval_interval=4", "--lr_decay_iters=8",
            "--always_save_checkpoint=True"]
    assert run("train.py", *args, "--max_iters=4").returncode == 0
    with open(os.path.join(out, "log.jsonl"), "a") as f:  # a run killed after iteration 5, in the middle of a line
        f.write('{"iter": 4, "loss": 9.0}\n{"iter": 5, "loss": 9.0}\n{"iter": 6, "lo')
    p = run("train.py", *args, "--max_iters=8", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    full, resumed = train_log(trained), train_log(out)
    assert [r["iter"] for r in resumed] == [r["iter"] for r in full]
    losses = lambda log: [(r["iter"], r["loss"]) for r in log if "loss" in r]  # noqa: E731
    assert losses(resumed) == losses(full)
    val = lambda log: [(r["iter"], r["val_loss"]) for r in log if "val_loss" in r and r["iter"] == 8]  # noqa: E731
    assert val(resumed) == val(full)
    a = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    b = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert a["iter_num"] == b["iter_num"] == 8
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


@pytest.mark.slow
def test_ddp_cpu_two_processes(tiny_data, tmp_path):
    """torchrun with 2 processes on CPU (gloo); gradient accumulation is split between them."""
    p = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *TINY,
            f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--max_iters=3", "--eval_interval=3",
            "--gradient_accumulation_steps=2", "--always_save_checkpoint=True", timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "tokens per iteration: 128 (1 x 2 x 4 x 16)" in p.stdout
    ddp_losses = [r["loss"] for r in train_log(str(tmp_path)) if "loss" in r]
    assert len(ddp_losses) == 3
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"] == 3
    # one process with both micro-batches trains on the same batches: the same losses, up to the order
    # of the gradient sums
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path / 'one'}", "--max_iters=3",
            "--eval_interval=3", "--gradient_accumulation_steps=2")
    assert p.returncode == 0, p.stdout + p.stderr
    one_losses = [r["loss"] for r in train_log(str(tmp_path / "one")) if "loss" in r]
    assert ddp_losses[0] == one_losses[0]
    assert np.allclose(ddp_losses, one_losses, rtol=1e-5, atol=0), (ddp_losses, one_losses)


@pytest.mark.slow
def test_checkpoint_write_is_atomic(trained, tiny_data, tmp_path):
    """A full disk in the middle of writing a checkpoint leaves the previous one intact, and says so in one line."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(os.path.join(trained, "ckpt.pt"), out / "ckpt.pt")
    before = (out / "ckpt.pt").read_bytes()
    sabotage = ("import errno, os, runpy, sys, torch\n"
                "def save(obj, f):\n"
                "    f.write(b'half a checkpoint')\n"
                "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
                "torch.save = save\n"
                f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    p = run("-c", sabotage, *TINY, f"--data_dir={tiny_data}", f"--out_dir={out}",
            "--max_iters=12", "--eval_interval=4", "--lr_decay_iters=8", "--always_save_checkpoint=True",
            "--init_from=resume")
    assert_clean_error(p, "cannot write", "at iteration 12: no space left on the device", "untouched")
    assert len(p.stderr.splitlines()) == 1, p.stderr
    assert (out / "ckpt.pt").read_bytes() == before
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]  # no temporary file left behind


def test_a_checkpoint_is_on_the_disk_before_it_is_renamed(tmp_path, monkeypatch):
    """run_safety.save_checkpoint flushes and fsyncs each file it writes (the checkpoint, and a resumed run's log held
    until its first save) before it renames it over the old one, and fsyncs the folder after the renames: a crash at
    any moment leaves each file whole, the old one or the new one."""
    log_path = tmp_path / "log.jsonl"
    log_path.write_text("".join(json.dumps({"iter": i, "loss": 1.0}) + "\n" for i in range(8)))
    log = run_safety.RunLog(str(log_path), resumed_at=5)  # holds the records of iterations 0 to 4
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(
        ("fsync", os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size)) or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda src, dst: events.append(("replace", src, dst)) or replace(src, dst))
    ckpt = tmp_path / "ckpt.pt"
    run_safety.save_checkpoint(str(ckpt), {"model": {"w": torch.ones(1000)}, "iter_num": 6}, log)
    renames = [e for e in events if e[0] == "replace"]
    assert [dst for _, _, dst in renames] == [str(ckpt), str(log_path)], events
    for _, src, dst in renames:
        synced = [e for e in events[:events.index(("replace", src, dst))] if e[:2] == ("fsync", os.path.realpath(src))]
        assert synced and synced[-1][2] == os.path.getsize(dst), events  # the whole file, flushed, then fsynced
    assert events[-1][:2] == ("fsync", os.path.realpath(tmp_path)), events  # the renames made durable
    assert len(log_path.read_text().splitlines()) == 5 and torch.load(ckpt, weights_only=True)["iter_num"] == 6


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_nothing(tiny_data, tmp_path):
    """A run killed with SIGKILL at random moments (a checkpoint is written every iteration, so some kills
    land inside a write) and resumed each time from its last checkpoint ends with exactly the weights of
    the uninterrupted run; every checkpoint found between the kills loads."""
    args = [*TINY, f"--data_dir={tiny_data}", "--max_iters=100", "--eval_interval=1", "--eval_iters=1",
            "--always_save_checkpoint=True"]
    p = run("train.py", *args, f"--out_dir={tmp_path / 'ref'}")
    assert p.returncode == 0, p.stderr
    out, rng, seen = tmp_path / "killed", random.Random(0), []
    log_lines = lambda: len(open(out / "log.jsonl").readlines()) if (out / "log.jsonl").exists() else 0
    for _ in range(4):
        init = "resume" if (out / "ckpt.pt").exists() else "scratch"
        before = log_lines() if init == "resume" else 0
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args, f"--out_dir={out}",
                                 f"--init_from={init}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
        deadline = time.time() + 120
        while log_lines() < before + 4 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)  # wait until it is training, however slow the machine
        time.sleep(rng.uniform(0.0, 0.1))  # a few iterations at most: 100 of them take about a second
        proc.kill()
        proc.wait()
        if (out / "ckpt.pt").exists():
            seen.append(torch.load(out / "ckpt.pt", weights_only=True)["iter_num"])
    assert seen and seen == sorted(seen) and seen[-1] < 100, seen  # progress, and the kills hit mid-run
    p = run("train.py", *args, f"--out_dir={out}", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    want = torch.load(tmp_path / "ref" / "ckpt.pt", weights_only=True)
    got = torch.load(out / "ckpt.pt", weights_only=True)
    assert got["iter_num"] == want["iter_num"] == 100
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name


@pytest.mark.slow
def test_a_second_run_into_the_same_out_dir_stops(tiny_data, tmp_path):
    """While a run trains (here before its first checkpoint, when the check for ckpt.pt cannot see it), a second
    train.py into its out_dir stops before any work, from scratch and with --init_from=resume alike, and the
    first run's log stays its own; once the first is killed, the folder is free again."""
    out = tmp_path / "out"
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--eval_iters=1"]
    first = train_in_background(*args, "--max_iters=100000", "--eval_interval=100000")
    try:
        wait_until(lambda: training(out))
        assert first.poll() is None
        for init in ("scratch", "resume"):
            p = run("train.py", *args, "--max_iters=8", f"--init_from={init}")
            assert_clean_error(p, f"{out} is in use by another train.py that has not ended")
        assert first.poll() is None and not (out / "ckpt.pt").exists()
    finally:
        first.kill()
        first.wait()
    iters = [r["iter"] for r in train_log(out) if "loss" in r]
    assert iters == sorted(set(iters)), iters  # one run's training records
    p = run("train.py", *args, "--max_iters=4")
    assert p.returncode == 0, p.stderr


@pytest.mark.slow
def test_data_prepared_again_does_not_change_a_running_run(tiny_data, tmp_path):
    """prepare_data.py run again on the data a run is training on (here with a 21st play) replaces the files; the
    run goes on with the data it began with and ends with exactly the weights of a run left alone."""
    args = [*TINY, "--max_iters=300", "--eval_interval=300", "--eval_iters=1", "--always_save_checkpoint=True"]
    p = run("train.py", *args, f"--data_dir={tiny_data}", f"--out_dir={tmp_path / 'ref'}")
    assert p.returncode == 0, p.stderr
    data, out = tmp_path / "data", tmp_path / "out"
    shutil.copytree(tiny_data, data)
    proc = train_in_background(*args, f"--data_dir={data}", f"--out_dir={out}")
    wait_until(lambda: training(out))
    tiny_corpus(tmp_path, 21)  # prepared again into the same data_dir, from one play more
    assert proc.poll() is None  # it was still training when its data was replaced
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    want = torch.load(tmp_path / "ref" / "ckpt.pt", weights_only=True)["model"]
    got = torch.load(out / "ckpt.pt", weights_only=True)["model"]
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.slow
def test_nothing_is_unpickled():
    """Checkpoints and metadata are untrusted files: every torch.load in the project passes
    weights_only=True, and no file uses pickle."""
    sources = {f: open(os.path.join(ROOT, f)).read() for f in os.listdir(ROOT) if f.endswith(".py")}
    loads = [(f, m.group(0)) for f, src in sources.items() for m in re.finditer(r"torch\.load\(.*", src)]
    assert [f for f, _ in loads if f == "run_safety.py"]  # read_checkpoint, which train.py and sample.py use
    assert all("weights_only=True" in call for _, call in loads), loads
    assert not [f for f, src in sources.items() if re.search(r"^\s*(import|from) pickle", src, re.M)]


POISON = """import runpy, sys, torch, model
class InfGrad(torch.autograd.Function):  # a finite loss whose gradients are not
    forward = staticmethod(lambda ctx, x: x.clone())
    backward = staticmethod(lambda ctx, g: g * float('inf'))
forward, calls = model.GPT.forward, [0]
def poisoned(self, idx, targets=None, cache=None, cu_seqlens=None):
    logits, loss = forward(self, idx, targets, cache, cu_seqlens)
    calls[0] += self.training
    if self.training and calls[0] == 6:  # iteration 5
        loss = loss * float('nan') if MODE == 'loss' else InfGrad.apply(loss)
    return logits, loss
model.GPT.forward = poisoned
sys.argv = [TRAIN] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["loss", "grad"])
def test_nonfinite_stops_or_skips(tiny_data, tmp_path, mode):
    """A non-finite loss or gradient stops the run at the next log line (logging every 3 iterations here),
    naming the iteration, before the weights are saved; with --skip_nonfinite=True that one batch is skipped
    before its update and the run goes on."""
    poison = f"MODE, TRAIN = {mode!r}, {os.path.join(ROOT, 'train.py')!r}\n" + POISON
    args = [*TINY, f"--data_dir={tiny_data}", "--max_iters=8", "--eval_interval=4", "--always_save_checkpoint=True"]
    p = run("-c", poison, *args, f"--out_dir={tmp_path / 'stop'}", "--log_interval=3")
    assert_clean_error(p, "loss is nan" if mode == "loss" else "gradient norm is", "at iteration 5")
    assert torch.load(tmp_path / "stop" / "ckpt.pt", weights_only=True)["iter_num"] == 4
    p = run("-c", poison, *args, f"--out_dir={tmp_path / 'skip'}", "--skip_nonfinite=True")
    assert p.returncode == 0, p.stderr
    assert "at iteration 5; skipping this batch" in p.stdout
    log = train_log(str(tmp_path / "skip"))
    assert [r["iter"] for r in log if "skipped" in r] == [5]
    assert [r["iter"] for r in log if "loss" in r] == [0, 1, 2, 3, 4, 6, 7]
    ckpt = torch.load(tmp_path / "skip" / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 8 and all(torch.isfinite(t).all() for t in ckpt["model"].values())


@pytest.mark.slow
def test_token_ids_beyond_the_vocabulary(tiny_data, tmp_path):
    data = tmp_path / "tiny"
    shutil.copytree(os.path.join(tiny_data, "shakespeare_char"), data)
    meta = json.loads((data / "meta.json").read_text())
    ids = np.fromfile(data / "train.bin", dtype=meta["dtype"])
    ids[::7] = meta["vocab_size"] + 3
    ids.tofile(data / "train.bin")
    p = run("train.py", *TINY, f"--data_dir={tmp_path}", "--dataset=tiny", f"--out_dir={tmp_path / 'out'}",
            "--max_iters=2")
    assert_clean_error(p, f"holds token id {meta['vocab_size'] + 3}", "vocabulary")


@pytest.mark.slow
@pytest.mark.parametrize("args, phrase", [
    (["--n_layers=2"], "unknown config key 'n_layers'"),
    (["--n_layer=2.5"], "n_layer must be of type int"),
    (["--compile=yes"], "compile must be of type bool"),
    (["--max_iters"], "expected --key=value"),
    (["config/does_not_exist.py"], "cannot read config file"),
])
def test_config_errors(args, phrase):
    assert_clean_error(run("train.py", *args), phrase)


@pytest.mark.slow
def test_config_file_and_int_for_float(tiny_data, tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text("import math\nmax_iters = 2\nlearning_rate = 1\nbogus_key = 3\n")
    assert_clean_error(run("train.py", str(cfg)), "unknown config key 'bogus_key'")
    cfg.write_text("import math\nmax_iters = 2\nlearning_rate = 1\n")
    p = run("train.py", str(cfg), *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path / 'o'}")
    assert p.returncode == 0, p.stderr
    assert [r["iter"] for r in train_log(str(tmp_path / "o")) if "loss" in r] == [0, 1]


@pytest.mark.slow
def test_config_file_may_import_and_define_helpers(tiny_data, tmp_path):
    """A config file's imports, functions, classes and _private names are not settings: only its other names are
    (a helper given a setting's name is that setting, of the wrong type)."""
    cfg = tmp_path / "cfg.py"
    cfg.write_text("import math\nfrom os.path import join\n_base = 2\n\n\ndef double(x):\n    return 2 * x\n\n\n"
                   "class Sizes:\n    small = 1\n\n\nmax_iters = double(_base) // 2 + Sizes.small - 1\n")
    p = run("train.py", str(cfg), *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path / 'o'}")
    assert p.returncode == 0, p.stderr
    assert [r["iter"] for r in train_log(str(tmp_path / "o")) if "loss" in r] == [0, 1]
    cfg.write_text("def batch_size():\n    return 4\n")
    assert_clean_error(run("train.py", str(cfg)), "batch_size must be of type int")


@pytest.mark.slow
def test_two_runs_that_prepare_the_same_missing_dataset_take_turns(tmp_path):
    """Two train.py that find the same dataset missing at once (two experiments.py, two terminals): the second waits
    for the first's preparation (slowed down here) and trains on it; both end well."""
    slow = ("import runpy, sys, time, prepare_data\n"
            "commit = prepare_data.NewDataset.commit\n"
            "def slow_commit(self, meta):\n"
            "    time.sleep(5)\n"
            "    commit(self, meta)\n"
            "prepare_data.NewDataset.commit = slow_commit\n"
            f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    args = ["config/mqar_small.py", "--n_layer=1", "--n_head=2", "--n_embd=32", "--mlp_hidden=64", "--batch_size=4",
            "--max_iters=1", "--eval_iters=1", "--device=cpu", "--dtype=float32", "--compile=False",
            "--sample_tokens=0", f"--data_dir={tmp_path / 'data'}"]
    procs = [subprocess.Popen([sys.executable, "-c", slow, *args, f"--out_dir={tmp_path / str(i)}"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1")) for i in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum("is being prepared by another process: waiting for it" in out for out, _ in outs) == 1, outs


@pytest.mark.slow
def test_train_prepares_missing_data(tmp_path):
    """The main job's first step: the default dataset is prepared when it is missing."""
    p = run("train.py", *TINY, f"--data_dir={tmp_path}", f"--out_dir={tmp_path / 'out'}", "--max_iters=1")
    assert p.returncode == 0, p.stderr
    meta = json.loads((tmp_path / "shakespeare_char" / "meta.json").read_text())
    assert meta["tokenizer"] == "char" and meta["train_tokens"] > 4_000_000  # all 38 plays


@pytest.mark.slow
def test_missing_data(tmp_path):
    assert_clean_error(run("train.py", *TINY, f"--data_dir={tmp_path}", "--dataset=custom", f"--out_dir={tmp_path}"),
                       "custom/meta.json not found")


@pytest.mark.slow
def test_empty_data_file(tiny_data, tmp_path):
    shutil.copytree(os.path.join(tiny_data, "shakespeare_char"), tmp_path / "tiny")
    (tmp_path / "tiny" / "val.bin").write_bytes(b"")
    assert_clean_error(run("train.py", *TINY, f"--data_dir={tmp_path}", "--dataset=tiny", f"--out_dir={tmp_path}"),
                       "val.bin holds 0 tokens, fewer than block_size + 1")


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_checkpoint(trained, tiny_data, tmp_path, damage):
    """A damaged ckpt.pt gives one clear message from train.py and sample.py, and is left as it is."""
    good = open(os.path.join(trained, "ckpt.pt"), "rb").read()
    bad = good[:len(good) // 2] if damage == "truncated" else b"not a checkpoint at all" * 100
    (tmp_path / "ckpt.pt").write_bytes(bad)
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--init_from=resume")
    assert_clean_error(p, "cannot load", "ckpt.pt")
    assert_clean_error(run("sample.py", f"--out_dir={tmp_path}", "--device=cpu"), "cannot load", "ckpt.pt")
    assert (tmp_path / "ckpt.pt").read_bytes() == bad


@pytest.mark.slow
def test_missing_checkpoint(tiny_data, tmp_path):
    assert_clean_error(run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--init_from=resume"),
                       "does not exist")
    assert_clean_error(run("sample.py", f"--out_dir={tmp_path}"), "does not exist")


@pytest.mark.slow
def test_checkpoint_of_another_model_version(trained, tiny_data, tmp_path):
    """Weights whose names this model.py does not have (e.g. from before the fused input projection): one
    clear message from train.py, sample.py and evaluate.py."""
    ckpt = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    ckpt["model"] = {k.replace("in_proj", "q_proj"): v for k, v in ckpt["model"].items()}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--init_from=resume",
            "--max_iters=9")
    for p in (p, run("sample.py", f"--out_dir={tmp_path}", "--device=cpu"),
              run("evaluate.py", f"--out_dir={tmp_path}", "--device=cpu", f"--data_dir={tiny_data}")):
        assert_clean_error(p, "does not match this model.py", "blocks.0.mixer.in_proj.weight", "ckpt.pt")


@pytest.mark.slow
def test_checkpoint_with_weights_of_other_shapes(trained, tiny_data, tmp_path):
    """Weights of another shape than this model.py's (the input projection without its unused rows, 148 of
    152): not loaded, one clear message that names them, from train.py too."""
    ckpt = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    name = "blocks.0.mixer.in_proj.weight"
    assert ckpt["model"][name].shape == (152, 32)
    ckpt["model"][name] = ckpt["model"][name][:148]
    with pytest.raises(ValueError, match=re.escape(f"other shapes ['{name}']")):
        GPT.from_checkpoint(ckpt)
    torch.save(ckpt, tmp_path / "ckpt.pt")
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--init_from=resume",
            "--max_iters=9")
    assert_clean_error(p, "does not match this model.py", name, "ckpt.pt")


@pytest.mark.slow
def test_resume_other_config(trained, tiny_data):
    p = run("train.py", *TINY, "--n_embd=64", f"--data_dir={tiny_data}", f"--out_dir={trained}", "--init_from=resume",
            "--max_iters=9")
    assert_clean_error(p, "checkpoint of another model", "n_embd=32 (this run: 64)")


@pytest.mark.slow
def test_resume_on_other_data_is_refused(trained, tmp_path):
    """The same model resumed on other data of the same vocabulary (here the corpus prepared again from 21 plays
    instead of 20, as a corpus prepared on a machine with other files would be) stops before any work, naming
    what differs; the checkpoint and its log stay as they were."""
    other = tiny_corpus(tmp_path, 21)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("ckpt.pt", "log.jsonl"):
        shutil.copy(os.path.join(trained, name), out / name)
    p = run("train.py", *TINY, f"--data_dir={other}", f"--out_dir={out}", "--init_from=resume", "--max_iters=12")
    assert_clean_error(p, "ckpt.pt was trained on other data than", "train_tokens", "resume it on its own data")
    for name in ("ckpt.pt", "log.jsonl"):
        assert (out / name).read_bytes() == open(os.path.join(trained, name), "rb").read(), name


@pytest.mark.slow
def test_optimizer_state_of_another_shape(trained, tiny_data, tmp_path):
    """A checkpoint whose optimizer moments do not have the shapes of its weights (another version of train.py,
    or an edited file) is refused in one line, not converted."""
    ckpt = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    state = ckpt["optimizer"]["state"]
    state[0] = {k: t[:-1] if t.dim() else t for k, t in state[0].items()}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--init_from=resume",
            "--max_iters=10")
    assert_clean_error(p, "ckpt.pt: its optimizer state does not match the model's weights")


@pytest.mark.slow
def test_rerun_keeps_the_trained_model(trained, tiny_data, tmp_path):
    """A run from scratch into an out_dir that holds a checkpoint stops before any work, says how to go on,
    and leaves the checkpoint and its log as they were; so does a resume with nothing left to train."""
    for name in ("ckpt.pt", "log.jsonl"):
        shutil.copy(os.path.join(trained, name), tmp_path / name)
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--max_iters=8")
    assert_clean_error(p, "ckpt.pt holds a trained model: continue it with --init_from=resume", "another --out_dir")
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--max_iters=8", "--init_from=resume")
    assert_clean_error(p, "ckpt.pt is at iteration 8, max_iters = 8: nothing left to train")
    assert p.returncode == 3  # nothing left to train: experiments.py evaluates such a run
    for name in ("ckpt.pt", "log.jsonl"):
        assert (tmp_path / name).read_bytes() == open(os.path.join(trained, name), "rb").read(), name


@pytest.mark.slow
def test_run_ends_at_its_best_weights(tiny_data, tmp_path):
    """When the last evaluation is worse than the best, train.py reloads the best weights (the checkpoint,
    saved only on improvement) before its closing sample, and says so; the sample then comes from them. The run
    gets worse for certain on any machine: it improves at a small rate, then resumes at one that wrecks it."""
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--warmup_iters=0", "--decay_lr=False",
            "--weight_decay=0", "--eval_interval=3"]
    p = run("train.py", *args, "--learning_rate=1e-2", "--max_iters=9")
    assert p.returncode == 0, p.stderr
    p = run("train.py", *args, "--learning_rate=3", "--max_iters=12", "--init_from=resume", "--sample_tokens=20")
    assert p.returncode == 0, p.stderr
    vals = [r["val_loss"] for r in train_log(str(tmp_path)) if "val_loss" in r]
    assert vals[-1] > min(vals[1:]) + 1, vals  # the run got worse after its best (else the test proves nothing)
    assert f"restored the best weights (val loss {min(vals[1:]):.4f})" in p.stdout, p.stdout
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["best_val_loss"] == min(vals[1:])


@pytest.mark.slow
def test_resume_of_an_ended_run(tiny_data, tmp_path):
    """A run that ended keeps its best weights, here of an earlier iteration than its end: a resume with the
    same max_iters, or the same patience after an early stop, stops before any work (where the run ended,
    where its best weights are) and leaves the checkpoint and the log as they were; a higher max_iters or
    patience goes on from the best weights."""
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--warmup_iters=0", "--decay_lr=False",
            "--weight_decay=0", "--eval_interval=3", "--init_from=resume"]
    assert run("train.py", *args[:-1], "--learning_rate=1e-2", "--max_iters=9").returncode == 0
    p = run("train.py", *args, "--learning_rate=3", "--max_iters=12")  # worse after its best (as above)
    assert p.returncode == 0, p.stderr
    best = torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"]
    assert best < 12, best  # else the test proves nothing
    files = lambda: [(tmp_path / name).read_bytes() for name in ("ckpt.pt", "log.jsonl")]  # noqa: E731
    before = files()
    p = run("train.py", *args, "--learning_rate=3", "--max_iters=12")
    assert_clean_error(p, f"the run ended at max_iters = 12 (its best weights, of iteration {best}, are in",
                       "nothing left to train; set --max_iters higher")
    assert p.returncode == 3 and files() == before
    p = run("train.py", *args, "--learning_rate=3", "--max_iters=30", "--patience=1")
    assert p.returncode == 0 and "no better val loss in 1 evaluations" in p.stdout, p.stdout
    end = train_log(str(tmp_path))[-1]
    assert end["end"] == "early stop" and end["iter"] < 30, end
    before = files()
    p = run("train.py", *args, "--learning_rate=3", "--max_iters=30", "--patience=1")
    assert_clean_error(p, f"the run stopped early at iteration {end['iter']}, no better val loss in 1 evaluations",
                       "nothing left to train at patience = 1; set --patience higher")
    assert p.returncode == 3 and files() == before
    p = run("train.py", *args, "--learning_rate=0", "--max_iters=30", "--patience=2")
    assert p.returncode == 0, p.stderr


@pytest.mark.slow
def test_a_resume_that_fails_before_it_saves_keeps_the_log(tiny_data, tmp_path):
    """A run that stopped early, resumed at a higher patience that fails before its first save (out of memory at its
    first step, a full disk at its first save), leaves its checkpoint and its log as they were, the end record
    included: a resume at the old patience is still refused, one at the higher patience trains."""
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--warmup_iters=0", "--decay_lr=False",
            "--weight_decay=0", "--eval_interval=3", "--max_iters=30"]
    assert run("train.py", *args, "--learning_rate=1e-2", "--max_iters=9").returncode == 0
    p = run("train.py", *args, "--learning_rate=3", "--patience=1", "--init_from=resume")  # worse after its best
    assert p.returncode == 0 and train_log(str(tmp_path))[-1]["end"] == "early stop", p.stderr
    files = lambda: [(tmp_path / name).read_bytes() for name in ("ckpt.pt", "log.jsonl")]  # noqa: E731
    before = files()
    train = (f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
             "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    oom = ("import runpy, sys, torch\n"
           "def oom(*args, **kw):\n"
           "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
           "torch.nn.utils.clip_grad_norm_ = oom\n")
    full_disk = ("import errno, os, runpy, sys, torch\n"
                 "def save(obj, f):\n"
                 "    f.write(b'half a checkpoint')\n"
                 "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
                 "torch.save = save\n")
    for sabotage, said in ((oom, "error: out of memory"), (full_disk, "no space left on the device")):
        p = run("-c", sabotage + train, *args, "--learning_rate=3", "--patience=2", "--always_save_checkpoint=True",
                "--init_from=resume")
        assert_clean_error(p, said)
        assert files() == before and sorted(os.listdir(tmp_path)) == ["ckpt.pt", "log.jsonl"]
    p = run("train.py", *args, "--learning_rate=3", "--patience=1", "--init_from=resume")
    assert_clean_error(p, "the run stopped early", "nothing left to train at patience = 1")
    assert p.returncode == 3 and files() == before
    p = run("train.py", *args, "--learning_rate=0", "--patience=2", "--init_from=resume")
    assert p.returncode == 0, p.stderr


@pytest.mark.slow
def test_a_resume_keeps_documents_as_the_run_began(tiny_documents, tmp_path):
    """documents= changes what a batch is (its rows, or the documents packed in them): a resume with the other value
    than its checkpoint's is refused before any work, naming it; the checkpoint and the log are left as they were."""
    args = [*TINY, f"--data_dir={tiny_documents}", "--dataset=docs", "--eval_interval=3",
            "--always_save_checkpoint=True"]
    for documents in (True, False):
        out = tmp_path / str(documents)
        assert run("train.py", *args, "--max_iters=3", f"--documents={documents}", f"--out_dir={out}").returncode == 0
        files = lambda: [(out / name).read_bytes() for name in ("ckpt.pt", "log.jsonl")]  # noqa: E731
        before = files()
        p = run("train.py", *args, "--max_iters=6", f"--documents={not documents}", f"--out_dir={out}",
                "--init_from=resume")
        assert_clean_error(p, f"{out / 'ckpt.pt'} was trained with documents={documents}: resume it with "
                              f"--documents={documents}, or train a new run with documents={not documents}")
        assert len(p.stderr.splitlines()) == 1 and files() == before, p.stderr


@pytest.mark.slow
def test_resume_keeps_patience_and_iteration_0_saves_nothing(tiny_data, tmp_path):
    """A resumed run's first evaluation (the checkpoint's own weights) does not count against patience; the
    untrained model at iteration 0 is never taken as the best, so a run whose later evaluations are worse
    than it still writes its best checkpoint."""
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--eval_interval=5"]
    p = run("train.py", *args, "--max_iters=10")
    assert p.returncode == 0 and (tmp_path / "ckpt.pt").exists(), p.stderr
    p = run("train.py", *args, "--max_iters=20", "--patience=1", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    assert "step 15:" in p.stdout, p.stdout  # trained on past the evaluation that re-read the checkpoint
    out = tmp_path / "zero"
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--eval_interval=5",
            "--max_iters=10", "--learning_rate=0", "--decay_lr=False")
    assert p.returncode == 0 and (out / "ckpt.pt").exists(), p.stdout


@pytest.mark.slow
def test_resume_keeps_the_count_of_evaluations_without_improvement(tiny_data, tmp_path):
    """A run with always_save_checkpoint=True saves the number of evaluations since the best one: stopped after
    some evaluations without improvement and resumed, it stops early at the uninterrupted run's iteration. With a
    learning rate of 0 every evaluation after the first (the best) gives the same val loss, no improvement."""
    args = [*TINY, f"--data_dir={tiny_data}", "--eval_interval=2", "--learning_rate=0", "--decay_lr=False",
            "--always_save_checkpoint=True", "--patience=3"]
    full, half = tmp_path / "full", tmp_path / "half"
    assert run("train.py", *args, f"--out_dir={full}", "--max_iters=20").returncode == 0
    end = train_log(str(full))[-1]
    assert end == {"iter": 8, "end": "early stop", "patience": 3}, end  # evaluations at 4, 6, 8 not better than 2
    p = run("train.py", *args, f"--out_dir={half}", "--max_iters=6")  # two evaluations without improvement
    assert p.returncode == 0, p.stderr
    p = run("train.py", *args, f"--out_dir={half}", "--max_iters=20", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    assert train_log(str(half))[-1] == end, train_log(str(half))[-1]


@pytest.mark.slow
def test_resume_evaluates_past_a_checkpoint_between_evaluations(tiny_data, tmp_path):
    """A checkpoint at an iteration that is not a multiple of eval_interval (a run of 25 iterations evaluated every
    10 ends with one at 25): the resumed run's first evaluation (30) is of new weights and is saved when it is the
    best, so that the checkpoint, the log's end record and a later resume agree; only an evaluation at the
    checkpoint's own iteration re-reads it (here after a change of eval_interval)."""
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--decay_lr=False", "--eval_interval=10"]
    assert run("train.py", *args, "--max_iters=25").returncode == 0
    p = run("train.py", *args, "--max_iters=30", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    log = train_log(str(tmp_path))
    evals = {r["iter"]: r["val_loss"] for r in log if "val_loss" in r}
    assert evals[30] < min(v for it, v in evals.items() if 0 < it < 30), evals  # else the test proves nothing
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert (ckpt["iter_num"], ckpt["best_val_loss"]) == (30, evals[30])
    assert list(evals) == [0, 10, 20, 25, 30] and log[-1] == {"iter": 30, "end": "max_iters", "patience": 0}
    assert_clean_error(run("train.py", *args, "--max_iters=30", "--init_from=resume"),
                       "ckpt.pt is at iteration 30, max_iters = 30: nothing left to train")
    p = run("train.py", *args[:-1], "--eval_interval=15", "--max_iters=45", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    evals = {r["iter"]: r["val_loss"] for r in train_log(str(tmp_path)) if "val_loss" in r}
    assert list(evals) == [0, 10, 20, 25, 30, 45], evals
    best = min((it for it in evals if it > 0), key=evals.get)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert (ckpt["iter_num"], ckpt["best_val_loss"]) == (best, evals[best])


@pytest.mark.slow
def test_closing_sample_checks_its_tokenizer_before_training(tiny_data, tmp_path, monkeypatch):
    """A run on BPE data whose encoding cannot be loaded (not in the cache, no network; here the character data
    labelled as BPE, an empty cache and a proxy that refuses connections) stops before training when it is to end
    with a sample, saying how to go on; with --sample_tokens=0 it trains."""
    shutil.copytree(os.path.join(tiny_data, "shakespeare_char"), tmp_path / "bpe")
    meta = json.loads((tmp_path / "bpe" / "meta.json").read_text())
    (tmp_path / "bpe" / "meta.json").write_text(json.dumps(dict(meta, tokenizer="tiktoken", encoding="r50k_base")))
    (tmp_path / "cache").mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    args = [*TINY, f"--data_dir={tmp_path}", "--dataset=bpe", f"--out_dir={tmp_path / 'out'}", "--max_iters=2"]
    p = run("train.py", *args, "--sample_tokens=5")
    assert_clean_error(p, "sample_tokens = 5 needs the tiktoken encoding 'r50k_base'",
                       "set --sample_tokens=0, or make the encoding available")
    assert len(p.stderr.splitlines()) == 1 and "step 0" not in p.stdout, p.stderr
    assert not (tmp_path / "out" / "ckpt.pt").exists()
    p = run("train.py", *args)
    assert p.returncode == 0 and (tmp_path / "out" / "ckpt.pt").exists(), p.stderr


@pytest.mark.slow
def test_resume_in_another_dtype(tiny_data, tmp_path):
    """A checkpoint trained in float32 (its loss scaler off, its state empty) resumes in float16 with a fresh
    scale, and one trained in float16 resumes in float32, its scale unused."""
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--eval_interval=2",
            "--always_save_checkpoint=True", "--init_from=resume"]
    assert run("train.py", *args[:-1], "--max_iters=2").returncode == 0
    p = run("train.py", *args, "--max_iters=4", "--dtype=float16")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 4 and ckpt["scaler"]["scale"] > 0
    p = run("train.py", *args, "--max_iters=6")
    assert p.returncode == 0, p.stderr
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 6 and ckpt["scaler"] == {}


@pytest.mark.slow
def test_hybrid_trains_resumes_samples_and_evaluates(tiny_data, tmp_path):
    """A hybrid (--mixer=kla,attn: every second layer attention) through the scripts: 3 iterations, then a resume to
    6, give the 6-iteration run's weights exactly; the checkpoint keeps the pattern; sample.py and evaluate.py (its
    segments: KLA's state and attention's keys carried) read it with nothing else given."""
    args = [*TINY, "--n_layer=4", "--mixer=kla,attn", f"--data_dir={tiny_data}", "--eval_interval=3",
            "--lr_decay_iters=6", "--always_save_checkpoint=True"]
    p = run("train.py", *args, f"--out_dir={tmp_path / 'full'}", "--max_iters=6", "--sample_tokens=20")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("---------------") == 2  # train.py's own sample at the end (GPT.generate)
    assert run("train.py", *args, f"--out_dir={tmp_path / 'half'}", "--max_iters=3").returncode == 0
    p = run("train.py", *args, f"--out_dir={tmp_path / 'half'}", "--max_iters=6", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    a, b = (torch.load(tmp_path / name / "ckpt.pt", weights_only=True) for name in ("full", "half"))
    assert a["iter_num"] == b["iter_num"] == 6 and b["model_args"]["mixer"] == "kla,attn"
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    m = GPT.from_checkpoint(b)
    assert [type(block.mixer).__name__ for block in m.blocks] == ["DeltaMixer", "Attention"] * 2
    p = run("sample.py", f"--out_dir={tmp_path / 'half'}", "--device=cpu", "--dtype=float32", "--num_samples=2",
            "--max_new_tokens=12")
    assert p.returncode == 0 and p.stdout.count("---------------") == 2, p.stderr
    p = run("evaluate.py", f"--out_dir={tmp_path / 'half'}", "--device=cpu", "--dtype=float32", "--factors=1,2",
            "--eval_batches=1", "--batch_size=2")
    assert p.returncode == 0, p.stderr
    res = json.loads((tmp_path / "half" / "eval.json").read_text())
    assert res["mixer"] == "kla,attn" and all(0 < r["test_loss"] < 10 for r in res["results"])


@pytest.mark.slow
def test_sample_token_ids_of_a_dataset_without_a_tokenizer(trained, tmp_path):
    """A model of a dataset without a tokenizer (the synthetic tasks: the prompt is token ids): an id outside the
    vocabulary or text is one line naming it; ids in range are sampled from, the new ones apart from the prompt."""
    ckpt = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    vocab = ckpt["model_args"]["vocab_size"]
    ckpt["meta"] = {"vocab_size": vocab, "tokenizer": "none", "dtype": "uint16"}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    cases = [(f"--start={vocab}", f"the prompt holds token id {vocab}; this model's token ids are 0..{vocab - 1}"),
             ("--start=3 -1", "the prompt holds token id -1; this model's token ids are 0.."),
             ("--start=ROMEO", "cannot encode the prompt (this dataset has no tokenizer")]
    assert_each_is_one_line("sample.py", cases, f"--out_dir={tmp_path}", "--device=cpu", "--dtype=float32")
    p = run("sample.py", f"--out_dir={tmp_path}", "--device=cpu", "--dtype=float32", f"--start=3 {vocab - 1}",
            "--num_samples=1", "--max_new_tokens=4")
    assert p.returncode == 0, p.stderr
    ids = p.stdout.split("---------------")[0].splitlines()[-1].split()
    assert ids[:2] == ["3", str(vocab - 1)] and len(ids) == 6 and all(0 <= int(i) < vocab for i in ids), p.stdout


@pytest.mark.slow
def test_bad_files_seeds_and_temperatures_are_one_line(trained, tmp_path):
    """A prompt or config file that is not UTF-8 text, a seed beyond what torch takes (seed + rank < 2**64: seeds
    in [0, 2**63)), a temperature so small that logits / temperature would overflow: one line each, before any
    work (out_dir not made)."""
    bad, cfg = tmp_path / "bad.txt", tmp_path / "bad_config.py"
    bad.write_bytes(b"ROMEO:\xff\xfe\n")
    cfg.write_bytes(b"max_iters = 2  # \xe9t\xe9\n")
    huge = "99999999999999999999"
    cases = [(f"--start=FILE:{bad}", f"cannot read the prompt file {bad}: not UTF-8 text"),
             (str(cfg), f"cannot read config file {cfg}: not UTF-8 text"),
             (f"--seed={huge}", f"seed = {huge}: must be >= 0 and < 2**63"),
             (f"--seed={2**63}", "must be >= 0 and < 2**63"),
             ("--temperature=1e-40", "temperature = 1e-40: must be a finite number >= 0 and, other than 0 (greedy), "
                                     ">= 1e-4")]
    assert_each_is_one_line("sample.py", cases, f"--out_dir={trained}", "--device=cpu", "--dtype=float32")
    cases = [(str(cfg), f"cannot read config file {cfg}: not UTF-8 text"),
             (f"--seed={huge}", f"seed = {huge}: must be >= 0 and < 2**63")]
    assert_each_is_one_line("train.py", cases, *TINY, f"--data_dir={tmp_path / 'none'}", "--dataset=custom",
                            f"--out_dir={tmp_path / 'out'}")
    assert not (tmp_path / "out").exists()
    p = run("sample.py", f"--out_dir={trained}", "--device=cpu", "--dtype=float32", "--temperature=1e-4",
            f"--seed={2**63 - 1}", "--num_samples=1", "--max_new_tokens=8")
    assert p.returncode == 0, p.stderr


@pytest.mark.slow
def test_log_write_failure_at_a_resume(trained, tiny_data, tmp_path):
    """A full disk when a resumed run rewrites its log: one line, and the checkpoint and the log as they were, with
    no temporary file left behind."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("ckpt.pt", "log.jsonl"):
        shutil.copy(os.path.join(trained, name), out / name)
    before = [(out / name).read_bytes() for name in ("ckpt.pt", "log.jsonl")]
    sabotage = ("import builtins, errno, os, runpy, sys\n"
                "real_open = builtins.open\n"
                "def full_disk(file, mode='r', *args, **kw):\n"
                "    f = real_open(file, mode, *args, **kw)\n"
                "    if str(file).endswith('log.jsonl.tmp') and 'w' in mode:  # made, then nothing fits\n"
                "        f.close()\n"
                "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
                "    return f\n"
                "builtins.open = full_disk\n"
                f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    p = run("-c", sabotage, *TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--max_iters=12",
            "--eval_interval=4", "--init_from=resume")
    assert_clean_error(p, f"cannot write {out / 'log.jsonl'}: no space left on the device")
    assert len(p.stderr.splitlines()) == 1, p.stderr
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]
    assert [(out / name).read_bytes() for name in ("ckpt.pt", "log.jsonl")] == before


@pytest.mark.slow
def test_out_of_memory_is_one_line_and_keeps_the_checkpoint(tiny_data, tmp_path):
    """Out of memory in the training loop (raised here at the 7th optimizer step, after the checkpoint of
    iteration 4): one line naming batch_size and block_size and the iteration the checkpoint holds, exit status 1,
    no traceback; the run resumes from that checkpoint."""
    out = tmp_path / "out"
    oom = ("import runpy, sys, torch\n"
           "clip, calls = torch.nn.utils.clip_grad_norm_, []\n"
           "def clip_or_oom(*args, **kw):\n"
           "    calls.append(1)\n"
           "    if len(calls) == 7:\n"
           "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
           "    return clip(*args, **kw)\n"
           "torch.nn.utils.clip_grad_norm_ = clip_or_oom\n"
           f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
           "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--max_iters=12", "--eval_interval=4"]
    p = run("-c", oom, *args)
    assert_clean_error(p, "error: out of memory on cpu at iteration 6 with batch_size = 4, block_size = 16: lower "
                          "batch_size", f"{out / 'ckpt.pt'} holds iteration 4 (continue with --init_from=resume)")
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1, p.stderr
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 4
    p = run("train.py", *args, "--init_from=resume")
    assert p.returncode == 0, p.stderr
    assert [r["iter"] for r in train_log(out) if "val_loss" in r][-1] == 12


@pytest.mark.slow
def test_ctrl_c_stops_with_one_line_and_keeps_the_checkpoint(tiny_data, tmp_path):
    """SIGINT (Ctrl-C) while a run trains, saving a checkpoint at every iteration (so that an interrupt may land
    in a write, which is then finished first): one line saying where it stopped and which iteration the checkpoint
    holds, exit status 130, no temporary file; the checkpoint holds that iteration and the run resumes from it.
    Before the first checkpoint the line says that none was saved."""
    out = tmp_path / "out"
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--eval_iters=1"]

    def evaluated_past(it):
        try:
            return any(r["iter"] > it for r in train_log(out) if "val_loss" in r)
        except (OSError, ValueError):  # no log yet, or a line being written
            return False

    def held(err):
        """The iterations where the run stopped and of its checkpoint, from its one line."""
        m = re.fullmatch(rf"interrupted at iteration (\d+); {re.escape(str(out / 'ckpt.pt'))} holds iteration (\d+) "
                         r"\(continue with --init_from=resume\)\n", err)
        assert m, err
        return int(m[1]), int(m[2])
    first = train_in_background(*args, "--max_iters=100000", "--eval_interval=100000")
    wait_until(lambda: training(out))
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 130 and re.fullmatch(
        r"interrupted at iteration \d+; no checkpoint was saved yet \(run it again from scratch\)\n", err), err
    shutil.rmtree(out)
    args += ["--max_iters=100000", "--eval_interval=1", "--always_save_checkpoint=True"]
    # Ctrl-C inside the write of the second checkpoint (iteration 2): the write is finished, then the run stops
    interrupt = ("import os, runpy, signal, sys, torch\n"
                 "save, calls = torch.save, [0]\n"
                 "def interrupted(obj, f):\n"
                 "    calls[0] += 1\n"
                 "    if calls[0] == 2:\n"
                 "        os.kill(os.getpid(), signal.SIGINT)\n"
                 "    save(obj, f)\n"
                 "torch.save = interrupted\n"
                 f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
                 "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    p = run("-c", interrupt, *args)
    assert p.returncode == 130 and held(p.stderr) == (2, 2), p.stderr
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 2
    # Ctrl-C at a random moment of a resumed run
    proc = train_in_background(*args, "--init_from=resume")
    wait_until(lambda: evaluated_past(3))  # it has saved at least once
    time.sleep(random.Random(0).uniform(0.0, 0.05))
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    stopped, saved = held(err)
    assert proc.returncode == 130 and 2 < saved <= stopped, err
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == saved
    p = run("train.py", *args, f"--max_iters={saved + 2}", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == saved + 2


@pytest.mark.slow
def test_a_run_from_scratch_keeps_another_runs_results(trained, tiny_data, tmp_path):
    """A run from scratch into an out_dir that holds another run's results but no checkpoint (its eval.json, a log
    evaluated past iteration 0: a results folder kept without its checkpoint) stops before any work, naming them,
    and leaves them as they were; the log of a run that never evaluated past iteration 0 is written over. A setting
    refused once the data is read leaves no out_dir behind, and an empty data_dir is refused."""
    both, logged, evaluated, crashed = (tmp_path / name for name in ("both", "logged", "evaluated", "crashed"))
    for d in (both, logged, evaluated, crashed):
        d.mkdir()
    for d in (both, logged):
        shutil.copy(os.path.join(trained, "log.jsonl"), d / "log.jsonl")  # evaluated at 0, 4 and 8
    for d in (both, evaluated):
        (d / "eval.json").write_text('{"results": []}')
    (crashed / "log.jsonl").write_text('{"iter": 0, "train_loss": 4.2, "val_loss": 4.2}\n{"iter": 0, "lo')
    files = lambda: {f: f.read_bytes() for d in (both, logged, evaluated) for f in d.iterdir()}
    before = files()
    (tmp_path / "file").write_text("")
    new = tmp_path / "new" / "run"
    cases = [(f"--out_dir={both}", f"error: {both} holds another run's results (eval.json and log.jsonl, evaluated up "
                                   f"to iteration 8) but no checkpoint: train from scratch into another --out_dir (or "
                                   f"delete {both / 'eval.json'}, {both / 'log.jsonl'} first)"),
             (f"--out_dir={logged}", "(log.jsonl, evaluated up to iteration 8) but no checkpoint"),
             (f"--out_dir={evaluated}", "(eval.json) but no checkpoint"),
             ("--dataset=nosuch", "nosuch/meta.json not found"), ("--documents=True", "names none"),
             ("--data_dir=", "data_dir = '': must be a directory"),
             (f"--data_dir={tmp_path / 'file'}", "must be a directory (made if missing), not a file")]
    assert_each_is_one_line("train.py", cases, *TINY, f"--data_dir={tiny_data}", f"--out_dir={new}")
    assert files() == before and not (tmp_path / "new").exists()
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={crashed}", "--max_iters=1")
    assert p.returncode == 0, p.stderr
    assert [r["iter"] for r in train_log(crashed) if "val_loss" in r] == [0, 1]


@pytest.mark.slow
def test_a_run_in_use_is_named_first_and_evaluated_without_eval_json(tiny_data, tmp_path):
    """While a run trains, past its first checkpoint: a second train.py into its out_dir is told that it is in use
    (exit status EX_TEMPFAIL), never advised to delete the checkpoint; evaluate.py prints the checkpoint's results
    but writes no eval.json, which would mark the unfinished run as done."""
    out = tmp_path / "out"
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--eval_iters=1"]
    first = train_in_background(*args, "--max_iters=100000", "--eval_interval=2", "--always_save_checkpoint=True")
    try:
        wait_until((out / "ckpt.pt").exists)
        first.send_signal(signal.SIGSTOP)  # paused, it holds its lock and leaves the CPU to the two below
        second = train_in_background(*args, "--max_iters=8")  # side by side with evaluate.py: half the time
        p = run("evaluate.py", f"--out_dir={out}", "--device=cpu", "--dtype=float32", "--factors=1",
                "--eval_batches=1", "--batch_size=2")
        assert p.returncode == 0, p.stderr
        assert (f"{out} is in use by a train.py that has not ended: the results are printed, {out / 'eval.json'} "
                "is not written\n") in p.stdout.split("| length |")[0] and "| 16 | 1 |" in p.stdout, p.stdout
        _, err = second.communicate(timeout=60)
        assert second.returncode == os.EX_TEMPFAIL and err == (f"error: {out} is in use by another train.py that has "
                                                                "not ended: wait for it, or train into another --out_dir\n")
        assert first.poll() is None and not (out / "eval.json").exists()
    finally:
        first.kill()
        first.wait()


@pytest.mark.slow
def test_evaluate_ctrl_c_is_one_line(trained, tmp_path):
    """Ctrl-C in evaluate.py: `interrupted`, exit status 130, no traceback, nothing written. The out_dir is locked
    here as a running train.py locks it, so that evaluate.py's first line says when its Ctrl-C handler is set."""
    import fcntl
    shutil.copy(os.path.join(trained, "ckpt.pt"), tmp_path / "ckpt.pt")
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "evaluate.py"), f"--out_dir={tmp_path}",
                                 "--device=cpu", "--dtype=float32", "--factors=1", f"--eval_batches={10 ** 6}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        for line in proc.stdout:  # the settings, then the line
            if "is in use by a train.py" in line:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        os.close(fd)
    assert proc.returncode == 130 and err == "interrupted\n", err
    assert os.listdir(tmp_path) == ["ckpt.pt"]


@pytest.mark.slow
def test_sample_ctrl_c_is_one_line(trained):
    """Ctrl-C in sample.py (stopping a long --max_new_tokens): `interrupted`, exit status 130, no traceback."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "sample.py"), f"--out_dir={trained}", "--device=cpu",
                             "--dtype=float32", "--num_samples=1", f"--max_new_tokens={10 ** 9}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    proc.stdout.read(300)  # the settings, then tokens as they are sampled
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == b"interrupted\n", err


@pytest.mark.slow
def test_a_reader_that_stops_early_gets_no_traceback(trained, tmp_path):
    """sample.py and evaluate.py whose output nobody reads any more (python sample.py | head, the reader gone): they
    end quietly, by SIGPIPE as any Unix command, not with a BrokenPipeError traceback; evaluate.py writes eval.json
    before it prints the table, so that a reader gone during the evaluation loses nothing."""
    shutil.copy(os.path.join(trained, "ckpt.pt"), tmp_path / "ckpt.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # each print written at once, as on a terminal
    read_end, write_end = os.pipe()
    os.close(read_end)  # gone before the first token
    try:
        p = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), f"--out_dir={tmp_path}", "--device=cpu",
                            "--num_samples=1"], stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                           timeout=120)
    finally:
        os.close(write_end)
    assert p.returncode == -signal.SIGPIPE and p.stderr == "", (p.returncode, p.stderr)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "evaluate.py"), f"--out_dir={tmp_path}", "--device=cpu",
                             "--dtype=float32", "--factors=1", "--eval_batches=1", "--batch_size=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    for line in proc.stdout:  # the settings, printed before the evaluation
        if line.startswith("Overriding: batch_size"):
            break
    proc.stdout.close()  # gone during the evaluation, before the table
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == -signal.SIGPIPE and err == "", (proc.returncode, err)
    assert json.loads((tmp_path / "eval.json").read_text())["iter_num"] == 8


@pytest.mark.slow
def test_config_file_errors_name_the_file_and_evaluate_names_its_flags(trained, tmp_path):
    """A config file with a syntax error, or one that calls sys.exit(0), is one line naming the file (not <string>,
    not a silent exit 0); evaluate.py's need for an end-of-text token names only the flags given."""
    (tmp_path / "bad.py").write_text("max_iters = 2\nx = (\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    assert_each_is_one_line("train.py", [(str(tmp_path / "bad.py"), f"{tmp_path / 'bad.py'} failed: SyntaxError: "
                                          "'(' was never closed (bad.py, line 2)"),
                                         (str(tmp_path / "exits.py"), f"config file {tmp_path / 'exits.py'} exited")])
    cases = [(["--documents=True"], "error: documents=True needs the end-of-text token"),
             (["--padded=True"], "error: padded=True needs the end-of-text token"),
             (["--documents=True", "--padded=True"], "error: documents=True and padded=True need the end-of-text token")]
    results = run_each("evaluate.py", [[f"--out_dir={trained}", "--device=cpu", *args] for args, _ in cases])
    for (args, phrase), (code, err) in zip(cases, results, strict=True):
        assert code == 1 and err.startswith(phrase) and len(err.splitlines()) == 1, (args, err)


@pytest.mark.slow
def test_derived_defaults_follow_the_overrides(tiny_data, tmp_path):
    """min_lr (learning_rate / 10) and lr_decay_iters (max_iters) are resolved after the overrides: the
    schedule follows --learning_rate and --max_iters, and the checkpoint's config holds the values used."""
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--learning_rate=1e-4",
            "--max_iters=6", "--eval_interval=6", "--always_save_checkpoint=True")
    assert p.returncode == 0, p.stderr
    assert "warmup 2 iterations, cosine decay to 1.0e-05 at iteration 6" in p.stdout
    lrs = [r["lr"] for r in train_log(str(tmp_path)) if "lr" in r]
    assert max(lrs) == 1e-4 and lrs[2:] == sorted(lrs[2:], reverse=True), lrs
    config = torch.load(tmp_path / "ckpt.pt", weights_only=True)["config"]
    assert config["min_lr"] == pytest.approx(1e-5) and config["lr_decay_iters"] == 6


@pytest.mark.slow
def test_train_settings_are_checked_before_any_work(tmp_path):
    """A setting out of its range is one line naming the value and the allowed range, before the data is
    read or prepared and before out_dir is made."""
    (tmp_path / "file").write_text("")
    cases = [("--batch_size=0", "batch_size = 0: must be >= 1"), ("--block_size=0", "block_size = 0: must be >= 1"),
             ("--learning_rate=-0.001", "learning_rate = -0.001: must be a finite number >= 0"),
             ("--learning_rate=1e999", "learning_rate = inf: must be a finite number >= 0"),
             ("--eval_interval=0", "eval_interval = 0: must be >= 1"), ("--eval_iters=0", "eval_iters = 0: must be >= 1"),
             ("--log_interval=0", "log_interval = 0"), ("--n_head=0", "n_head = 0: must be >= 1"),
             ("--n_layer=0", "n_layer = 0"), ("--n_embd=-32", "n_embd = -32"), ("--expand_k=0", "expand_k = 0.0"),
             ("--conv_size=0", "conv_size = 0"), ("--mlp_hidden=-1", "mlp_hidden = -1"),
             ("--n_head=3", "n_embd (32) must be divisible by n_head (3)"), ("--chunk_size=0", "chunk_size = 0"),
             ("--seed=-1", "seed = -1: must be >= 0"), ("--gradient_accumulation_steps=0", "gradient_accumulation_steps = 0"),
             ("--max_iters=0", "max_iters = 0"), ("--warmup_iters=-1", "warmup_iters = -1"),
             ("--lr_decay_iters=-1", "lr_decay_iters = -1: must be >= 0 (0: max_iters)"),
             ("--min_lr=0.01", "min_lr = 0.01: must be in [0, learning_rate = 0.002] (-1: learning_rate / 10)"),
             ("--grad_clip=-1", "grad_clip = -1.0"), ("--weight_decay=-0.1", "weight_decay = -0.1"),
             ("--beta1=-0.1", "beta1 = -0.1: must be in [0, 1)"), ("--beta2=1.0", "beta2 = 1.0: must be in [0, 1)"),
             ("--patience=-1", "patience = -1"), ("--sample_tokens=-1", "sample_tokens = -1"),
             ("--init_from=pretrained", "init_from = 'pretrained': must be 'scratch' or 'resume'"),
             ("--dtype=float64", "dtype = 'float64': must be 'float32', 'bfloat16' or 'float16'"),
             ("--mixer=rnn", "mixer = 'rnn'"), ("--mixer=kla,attn", "mixer = 'kla,attn': must be 'kla', 'gdn', 'attn' or a "
                                                "per-layer pattern of them whose length divides n_layer"),
             ("--backend=fast", "backend = 'fast'"), ("--device=tpu", "device = 'tpu'"),
             (f"--out_dir={tmp_path / 'file'}", "must be a directory (made if missing), not a file")]
    if not torch.cuda.is_available():
        cases += [("--device=cuda", "device = 'cuda': no CUDA GPU is available here; use --device=cpu"),
                  ("--backend=triton", "backend = 'triton': must be 'auto', 'chunkwise' or 'recurrent' on device 'cpu'")]
    assert_each_is_one_line("train.py", cases, *TINY, f"--data_dir={tmp_path / 'none'}", "--dataset=custom",
                            f"--out_dir={tmp_path / 'out'}")
    assert not (tmp_path / "out").exists() and not (tmp_path / "none").exists()


@pytest.mark.slow
def test_damaged_data_files(tiny_data, tmp_path):
    """A train.bin cut in the middle of a token, a meta.json cut short or without a field: one line naming the file."""
    src = os.path.join(tiny_data, "shakespeare_char")
    for name in ("odd", "cut", "field"):
        shutil.copytree(src, tmp_path / name)
    with open(tmp_path / "odd" / "train.bin", "ab") as f:
        f.write(b"\0")
    meta = (tmp_path / "cut" / "meta.json").read_text()
    (tmp_path / "cut" / "meta.json").write_text(meta[:len(meta) // 2])
    (tmp_path / "field" / "meta.json").write_text(json.dumps({k: v for k, v in json.loads(meta).items() if k != "dtype"}))
    size = os.path.getsize(tmp_path / "odd" / "train.bin")
    cases = [("--dataset=odd", f"odd/train.bin holds {size} bytes, not a whole number of uint16 tokens"),
             ("--dataset=cut", "cut/meta.json is damaged (JSONDecodeError"),
             ("--dataset=field", "field/meta.json is damaged (KeyError: 'dtype'); prepare the data again")]
    assert_each_is_one_line("train.py", cases, *TINY, f"--data_dir={tmp_path}", f"--out_dir={tmp_path / 'out'}")


@pytest.mark.parametrize("when", ["import", "model"])
@pytest.mark.slow
def test_ctrl_c_while_train_py_starts_is_one_line(tiny_data, tmp_path, when):
    """Ctrl-C in train.py's first seconds, while torch is imported or the model built (sent here at those moments):
    one line, exit status 130, no traceback."""
    interrupt = {"import": ("import builtins, os, signal\n"
                            "real_import = builtins.__import__\n"
                            "def importing(name, *args, **kw):\n"
                            "    if name == 'torch':\n"
                            "        os.kill(os.getpid(), signal.SIGINT)\n"
                            "    return real_import(name, *args, **kw)\n"
                            "builtins.__import__ = importing\n"),
                 "model": ("import os, signal, model\n"
                           "def building(self, *args, **kw):\n"
                           "    os.kill(os.getpid(), signal.SIGINT)\n"
                           "model.GPT.__init__ = building\n")}[when]
    train = (f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
             "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    p = run("-c", "import runpy, sys\n" + interrupt + train, *TINY, f"--data_dir={tiny_data}",
            f"--out_dir={tmp_path / 'out'}", "--max_iters=2")
    assert p.returncode == 130 and p.stderr == "interrupted\n", p.stderr


@pytest.mark.slow
def test_half_precision_on_the_cpu_warns(tiny_data, tmp_path):
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--max_iters=1", "--dtype=bfloat16")
    assert p.returncode == 0, p.stderr
    assert "warning: dtype = 'bfloat16' on the CPU runs several times slower than float32" in p.stderr


SYNCS = """import collections, runpy, sys, torch
TRAIN, reads = sys.argv[1], collections.Counter()
def counted(name, method):
    def wrapper(self, *args, **kw):
        caller = sys._getframe(1).f_code
        if caller.co_filename == TRAIN and caller.co_name not in ("estimate_loss", "save_checkpoint"):
            reads[f"{name} in {caller.co_name}"] += 1
        return method(self, *args, **kw)
    return wrapper
for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__"):
    setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
sys.argv = sys.argv[1:]
runpy.run_path(TRAIN, run_name="__main__")
print("reads:", sum(reads.values()), dict(reads))
"""


@pytest.mark.slow
def test_training_reads_from_the_device_only_to_log_or_evaluate(tiny_data, tmp_path):
    """Between log lines and evaluations the training loop reads no value back from the device (on a GPU each
    read waits for all the work queued): train.py's conversions of tensors to Python values, evaluation and
    saving aside, counted over 12 iterations that log twice and evaluate twice."""
    p = run("-c", SYNCS, os.path.join(ROOT, "train.py"), *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}",
            "--max_iters=12", "--log_interval=6", "--eval_interval=12")
    assert p.returncode == 0, p.stderr
    assert int(p.stdout.split("reads: ")[1].split()[0]) <= 4, p.stdout.split("reads: ")[1]


# -----------------------------------------------------------------------------
# sample.py


def test_sample_streams(trained, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("ALICE:\n")
    p = run("sample.py", f"--out_dir={trained}", f"--start=FILE:{prompt}", "--num_samples=2", "--max_new_tokens=20",
            "--device=cpu", "--dtype=float32")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("---------------") == 2 and "tokens/s" in p.stdout
    first = p.stdout.split("---------------")[0].split("Overriding: dtype = 'float32'\n")[1]
    assert first.startswith("ALICE:\n") and len(first) == len("ALICE:\n") + 20 + 1  # one character per token


@pytest.mark.slow
def test_top_k_samples_only_the_k_most_likely_tokens(trained):
    """top_k smaller than the vocabulary: at a high temperature, where sampling from all tokens leaves the top 3
    often, every token sampled with top_k = 3 is among the 3 most likely after its prefix; sample.py with
    --top_k=1 then samples the greedy text whatever its temperature."""
    torch.manual_seed(0)
    m = GPT(tiny_config("kla")).eval()
    prompt = torch.randint(0, 61, (8, 5))

    def in_top3(out):
        with torch.no_grad():
            logits, _ = m(out[:, :-1], targets=out[:, 1:])
        top3 = logits[:, 4:].topk(3, -1).indices  # (8, 24, 3): after each prefix of the sampled part
        return (top3 == out[:, 5:, None]).any(-1)
    assert in_top3(m.generate(prompt, 24, temperature=5.0, top_k=3)).all()
    assert not in_top3(m.generate(prompt, 24, temperature=5.0)).all()
    args = [f"--out_dir={trained}", "--num_samples=1", "--max_new_tokens=30", "--device=cpu", "--dtype=float32"]
    greedy, top1 = (run("sample.py", *args, *opts)
                    for opts in (["--temperature=0"], ["--temperature=2.0", "--top_k=1"]))
    assert greedy.returncode == 0 and top1.returncode == 0, greedy.stderr + top1.stderr
    text = lambda p: p.stdout.split("---------------")[0].rsplit("\nOverriding: ", 1)[1].split("\n", 1)[1]  # noqa: E731
    assert text(top1) == text(greedy) and len(text(greedy)) > 30


@pytest.mark.slow
@pytest.mark.parametrize("args, phrase", [
    (["--start=Zounds é"], "characters not in the vocabulary: 'Zé'"),
    (["--max_new_tokens=0"], "max_new_tokens = 0: must be >= 1"),
    (["--start=FILE:/nonexistent/prompt.txt"], "cannot read the prompt file"),
    (["--start="], "the prompt is empty"),
])
def test_sample_errors(trained, args, phrase):
    assert_clean_error(run("sample.py", f"--out_dir={trained}", "--device=cpu", *args), phrase)


@pytest.mark.slow
def test_sample_settings_are_checked_before_any_work(tmp_path):
    cases = [("--num_samples=0", "num_samples = 0: must be >= 1"), ("--top_k=-1", "top_k = -1: must be >= 0 (0: all tokens)"),
             ("--temperature=-1", "temperature = -1.0: must be a finite number >= 0"),
             ("--max_new_tokens=0", "max_new_tokens = 0: must be >= 1"), ("--seed=-1", "seed = -1"),
             ("--dtype=float64", "dtype = 'float64'")]
    if not torch.cuda.is_available():
        cases += [("--device=cuda", "device = 'cuda': no CUDA GPU is available here")]
    assert_each_is_one_line("sample.py", cases, f"--out_dir={tmp_path}", "--device=cpu")  # no checkpoint there


@pytest.mark.slow
def test_digits_and_folders_are_checked_before_any_work(tmp_path):
    """A factor written with a digit that int() does not take (a superscript), an out_dir or data_dir that is a file,
    prepare_data.py's data_dir '' (the current folder): one line naming the value, before any work."""
    (tmp_path / "file").write_text("")
    file = tmp_path / "file"
    assert_each_is_one_line("evaluate.py", [("--factors=1,\u00b2", "factors = '1,\u00b2': must be integers >= 1"),
                                            (f"--out_dir={file}", f"out_dir = '{file}': must be the folder of a run"),
                                            (f"--data_dir={file}", f"data_dir = '{file}': must be a folder")],
                            "--device=cpu")
    assert_each_is_one_line("sample.py", [(f"--out_dir={file}", f"out_dir = '{file}': must be the folder of a run "
                                                                "(train.py's out_dir, which holds ckpt.pt), not a file")],
                            "--device=cpu")
    p = run("prepare_data.py", "--dataset=mqar_small", "--data_dir=", "--n_train=10")
    assert_clean_error(p, "config error: data_dir = '': must be a folder (made if missing)")
    assert not os.path.exists(os.path.join(ROOT, "mqar_small"))


@pytest.mark.slow
def test_not_a_checkpoint_gives_no_unsafe_advice(tmp_path):
    """A file of random bytes as ckpt.pt: one line that does not pass on PyTorch's advice to load it with
    weights_only=False (which would run whatever code an untrusted file holds)."""
    (tmp_path / "ckpt.pt").write_bytes(random.Random(0).randbytes(4096))
    code, err = run_each("sample.py", [[f"--out_dir={tmp_path}", "--device=cpu"]])[0]
    assert code != 0 and "cannot load" in err and len(err.splitlines()) == 1, err
    assert "weights_only" not in err, err


@pytest.mark.slow
def test_a_checkpoint_that_train_py_did_not_write_is_one_line(trained, tiny_data, tmp_path):
    """A ckpt.pt that torch.load reads but that is not what train.py writes (a tensor saved by other code, a dict
    without an entry that the command reads, model_args with a field this model.py does not know or of another type,
    non-finite weights, a damaged optimizer or RNG state): one line naming the file and what is wrong, from train.py
    --init_from=resume, sample.py and evaluate.py; the files are left as they were."""
    good = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    nan = {k: v * float("nan") if v.is_floating_point() else v for k, v in good["model"].items()}
    variants = {"tensor": torch.zeros(3), "no_meta": {k: v for k, v in good.items() if k != "meta"},
                "no_optimizer": {k: v for k, v in good.items() if k != "optimizer"},
                "no_iter_num": {k: v for k, v in good.items() if k != "iter_num"},
                "newer": dict(good, model_args=dict(good["model_args"], bogus=1)),
                "str_arg": dict(good, model_args=dict(good["model_args"], n_layer="1")),
                "nan": dict(good, model=nan), "empty_optimizer": dict(good, optimizer={}),
                "bad_rng": dict(good, rng={"python": 1})}
    for name, obj in variants.items():
        (tmp_path / name).mkdir()
        torch.save(obj, tmp_path / name / "ckpt.pt")
        shutil.copy(os.path.join(trained, "log.jsonl"), tmp_path / name / "log.jsonl")
    saved = {name: (tmp_path / name / "ckpt.pt").read_bytes() for name in variants}
    holds_a_tensor = "ckpt.pt holds a Tensor, not the dict of a checkpoint that train.py writes"
    newer = "checkpoint's model_args hold ['bogus'], which this model.py does not know"
    not_finite = "checkpoint holds weights that are not finite: ['blocks.0."
    for script, cases, args in (
            ("sample.py", [("tensor", holds_a_tensor), ("no_meta", "is not a checkpoint that train.py writes, or a "
                                                                   "damaged one: it has no 'meta'"),
                           ("newer", newer), ("str_arg", "checkpoint's model_args do not fit this model.py"),
                           ("nan", not_finite)], ["--device=cpu", "--max_new_tokens=2"]),
            ("evaluate.py", [("tensor", holds_a_tensor), ("no_iter_num", "it has no 'iter_num'"), ("newer", newer),
                             ("nan", not_finite)], ["--device=cpu", "--factors=1", "--eval_batches=1"]),
            ("train.py", [("tensor", holds_a_tensor), ("no_optimizer", "it has no 'optimizer'"), ("newer", newer),
                          ("nan", not_finite), ("empty_optimizer", "its optimizer state cannot be loaded (KeyError"),
                          ("bad_rng", "its random number generator states cannot be restored")],
             [*TINY, f"--data_dir={tiny_data}", "--init_from=resume", "--max_iters=12"])):
        results = run_each(script, [[f"--out_dir={tmp_path / name}", *args] for name, _ in cases])
        for (name, phrase), (code, err) in zip(cases, results, strict=True):
            assert code != 0 and "Traceback" not in err and len(err.splitlines()) == 1, (script, name, err)
            assert f"{tmp_path / name / 'ckpt.pt'}" in err and phrase in err, (script, name, err)
    for name in variants:
        assert (tmp_path / name / "ckpt.pt").read_bytes() == saved[name], name
        assert (tmp_path / name / "log.jsonl").read_bytes() == open(os.path.join(trained, "log.jsonl"), "rb").read()
        assert sorted(os.listdir(tmp_path / name)) == ["ckpt.pt", "log.jsonl"], name


@pytest.mark.slow
def test_checkpoint_without_the_step_rule_fields_loads_and_resumes(tiny_data, tmp_path):
    """model_args without step_rule and decay (a checkpoint saved before they existed) is KLA with its decay:
    GPT.from_checkpoint builds it, train.py resumes it, and refuses to resume it as another rule."""
    out = str(tmp_path / "out")
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--eval_interval=2", "--always_save_checkpoint=True"]
    p = run("train.py", *args, "--max_iters=2")
    assert p.returncode == 0, p.stderr
    path = os.path.join(out, "ckpt.pt")
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["model_args"].pop("step_rule") == "" and ckpt["model_args"].pop("decay") is True
    torch.save(ckpt, path)
    m = GPT.from_checkpoint(run_safety.read_checkpoint(path))
    assert m.blocks[0].mixer.rule == "kaczmarz" and m.config.decay
    p = run("train.py", *args, "--max_iters=4", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    p = run("train.py", *args, "--max_iters=6", "--init_from=resume", "--step_rule=raw")
    assert_clean_error(p, "step_rule='' (this run: 'raw')")
