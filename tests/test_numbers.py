"""
The training path's numbers against independent computations: train.py's learning-rate schedule (every phase,
and after a resume), evaluate.py's metrics (losses at each factor, documents, padding, recall accuracy) on cases
small enough to count, and the rotary embedding against its definition. The options that change only how a
step is computed run end to end under the `slow` marker.

Run: python -m pytest tests/test_numbers.py (from the repository root; -m "not slow" for the quick part).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import model  # noqa: E402
import prepare_data  # noqa: E402
from model import GPT  # noqa: E402

torch.set_num_threads(2)

EOT = 63  # the end-of-text token of the `docs` dataset
# a model that trains in about a second on the CPU
TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4", "--chunk_size=8",
        "--eval_iters=1", "--log_interval=1", "--sample_tokens=0", "--device=cpu", "--dtype=float32",
        "--compile=False"]


def run(script, *args, timeout=300):
    """python ROOT/script *args, one thread (the tests share small machines)."""
    p = subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def read_log(out_dir):
    with open(Path(out_dir) / "log.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """data_dir holding 'docs': 300 documents of 1 to 40 token ids in [0, 63), each ended by EOT."""
    d = tmp_path_factory.mktemp("numbers") / "docs"
    rng = np.random.default_rng(0)
    documents = [np.append(rng.integers(0, EOT, rng.integers(1, 41)), EOT) for _ in range(300)]
    prepare_data.write_dataset(str(d), documents, {"vocab_size": 64, "tokenizer": "none", "eot": EOT})
    return d.parent


# -----------------------------------------------------------------------------
# train.py's learning-rate schedule

LR, MIN_LR, WARMUP, DECAY_END = 1e-2, 1e-3, 3, 8


def schedule(it):
    """Linear warmup from LR / (WARMUP + 1) at iteration 0 to LR at WARMUP, half a cosine from LR at WARMUP to
    MIN_LR at DECAY_END, MIN_LR after it."""
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    if it >= DECAY_END:
        return MIN_LR
    progress = (it - WARMUP) / (DECAY_END - WARMUP)
    return MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * progress)) / 2


def test_schedule_formula_by_hand():
    """The formula above at the values that can be worked out on paper."""
    assert schedule(0) == pytest.approx(LR / 4) and schedule(2) == pytest.approx(LR * 3 / 4)
    assert schedule(WARMUP) == pytest.approx(LR)
    assert schedule((WARMUP + DECAY_END) / 2) == pytest.approx((LR + MIN_LR) / 2)  # halfway: cos(pi / 2) = 0
    assert schedule(DECAY_END) == schedule(DECAY_END + 5) == MIN_LR


def test_schedule_every_iteration_and_after_resume(docs, tmp_path):
    """train.py's lr at each iteration (out_dir/log.jsonl, one record an iteration): warmup (iteration 0 included),
    the cosine, the floor past lr_decay_iters; then a run resumed from its checkpoint at iteration 5 goes on with
    the schedule's values at iterations 5 to 10, not those of a schedule begun again."""
    out = tmp_path / "out"
    args = [*TINY, f"--data_dir={docs}", "--dataset=docs", f"--out_dir={out}", f"--learning_rate={LR}",
            f"--min_lr={MIN_LR}", f"--warmup_iters={WARMUP}", f"--lr_decay_iters={DECAY_END}", "--eval_interval=5",
            "--always_save_checkpoint=True"]
    run("train.py", *args, "--max_iters=5")
    first = {r["iter"]: r["lr"] for r in read_log(out) if "lr" in r}
    assert sorted(first) == list(range(5))
    run("train.py", *args, "--max_iters=11", "--init_from=resume")
    resumed = {r["iter"]: r["lr"] for r in read_log(out) if "lr" in r}
    assert sorted(resumed) == list(range(11))
    assert all(resumed[it] == first[it] for it in first)  # the log keeps the records before the checkpoint
    for it, lr in resumed.items():
        assert lr == pytest.approx(schedule(it), rel=1e-12, abs=0), (it, lr, schedule(it))
    assert resumed[0] == pytest.approx(LR / (WARMUP + 1)) and resumed[0] > 0
    assert resumed[DECAY_END + 1] == resumed[DECAY_END + 2] == MIN_LR


# -----------------------------------------------------------------------------
# evaluate.py's metrics, against the checkpoint's model run here on whole sequences


def full_logits(m, x):
    """Logits (B, T, vocab) of token ids x in one pass, float64 (the targets only make forward return them all)."""
    x = torch.as_tensor(np.asarray(x, dtype=np.int64))
    with torch.no_grad():
        logits, _ = m(x, torch.zeros_like(x))
    return logits.double()


def token_losses(m, x, y):
    """-log p(y_t | x_<=t) for each position of the sequences x, y (B, T): a log-softmax written out."""
    logits = full_logits(m, x)
    log_z = logits.logsumexp(-1)
    return log_z - logits.gather(-1, torch.as_tensor(np.asarray(y, dtype=np.int64))[..., None])[..., 0]


def load(out_dir):
    """The model of out_dir/ckpt.pt, in eval mode."""
    return GPT.from_checkpoint(torch.load(Path(out_dir) / "ckpt.pt", map_location="cpu", weights_only=True)).eval()


@pytest.fixture(scope="module")
def docs_model(docs, tmp_path_factory):
    """out_dir of a tiny KLA model trained 4 iterations on 'docs' (block_size 16)."""
    out = tmp_path_factory.mktemp("docs_model") / "out"
    run("train.py", *TINY, f"--data_dir={docs}", "--dataset=docs", f"--out_dir={out}", "--max_iters=4",
        "--eval_interval=4", "--always_save_checkpoint=True", "--learning_rate=1e-2", "--warmup_iters=0")
    return out


def windows(data, length, batches, batch_size, seed):
    """The random windows (length + 1 tokens) that evaluate.py draws: its documented seeded draw."""
    rng = np.random.default_rng(seed)
    for _ in range(batches):
        ix = rng.integers(len(data) - length, size=batch_size)
        yield np.stack([data[i:i + length + 1] for i in ix]).astype(np.int64)


def test_evaluate_losses_at_each_factor(docs, docs_model):
    """test_loss and val_loss at 1x and 2x the context (evaluate.py reads 2x in two segments with the state carried):
    the mean over every predicted token of one pass over each whole window; the count of tokens too."""
    run("evaluate.py", f"--out_dir={docs_model}", "--device=cpu", "--dtype=float32", "--factors=1,2",
        "--eval_batches=2", "--batch_size=3", "--seed=5")
    res = json.loads((docs_model / "eval.json").read_text())["results"]
    m = load(docs_model)
    assert [r["length"] for r in res] == [16, 32]
    for r in res:
        for split in ("test", "val"):
            data = np.fromfile(docs / "docs" / f"{split}.bin", dtype=np.uint16)
            losses = torch.cat([token_losses(m, w[:, :-1], w[:, 1:]).flatten()
                                for w in windows(data, r["length"], 2, 3, 5)])
            assert r[f"{split}_loss"] == pytest.approx(losses.mean().item(), rel=1e-5), (split, r)
        assert r["tokens"] == 2 * 3 * r["length"]


def test_evaluate_documents_and_padding(docs, docs_model):
    """documents=True: each document of a window read alone, the target after an end-of-text not counted; padded:
    each test document in a window of its own padded with EOT, the mean over every target (padded_loss), over
    the document's own (document_loss, its tokens and its end-of-text), and the padding's share of the targets."""
    run("evaluate.py", f"--out_dir={docs_model}", "--device=cpu", "--dtype=float32", "--factors=1,2",
        "--eval_batches=1", "--batch_size=3", "--documents=True", "--padded=True")
    res = json.loads((docs_model / "eval.json").read_text())["results"]
    m = load(docs_model)
    test = np.fromfile(docs / "docs" / "test.bin", dtype=np.uint16).astype(np.int64)
    for r in res:
        L = r["length"]
        own = []  # the loss of each target predicted within its own document
        for w in windows(test, L, 1, 3, 1337):
            for row in w:
                x, y = row[:-1], row[1:]
                starts = [0, *(np.flatnonzero(x == EOT) + 1)]
                for s, e in zip(starts, [*starts[1:], L]):
                    if e > s:  # the document x[s:e]; if it ends in EOT, its last target is the next document's
                        n = e - s - 1 if x[e - 1] == EOT else e - s
                        own.append(token_losses(m, x[None, s:e], y[None, s:e])[0, :n])
        own = torch.cat(own)
        assert r["tokens"] == len(own)
        assert r["test_loss"] == pytest.approx(own.mean().item(), rel=1e-5)
        # padded: one document a window, counted by hand from the document boundaries
        ends = np.flatnonzero(test == EOT)
        starts = np.concatenate([[0], ends[:-1] + 1])
        padded, real = [], []
        for s, e in zip(starts, ends):
            doc = test[s:e + 1][:L + 1]
            window = np.concatenate([doc, np.full(L + 1 - len(doc), EOT)])
            losses = token_losses(m, window[None, :-1], window[None, 1:])[0]
            padded.append(losses)
            real.append(losses[:len(doc) - 1])
        padded, real = torch.cat(padded), torch.cat(real)
        assert r["documents"] == len(ends)
        assert r["padded_loss"] == pytest.approx(padded.mean().item(), rel=1e-5)
        assert r["document_loss"] == pytest.approx(real.mean().item(), rel=1e-5)
        assert r["padding_share"] == pytest.approx(1 - len(real) / len(padded), abs=1e-7)


@pytest.fixture(scope="module")
def recall_model(tmp_path_factory):
    """out_dir of a tiny model trained a few iterations on a recall task of 16 tokens (examples of 32, tested at 32
    and 64), and its data_dir."""
    root = tmp_path_factory.mktemp("recall")
    prepare_data.prepare_synthetic(str(root / "data" / "recall"), n_pairs=2, train_length=32, test_lengths=(32, 64),
                                   n_train=200, n_val=16, n_test=24, vocab=16)
    out = root / "out"
    run("train.py", *TINY, f"--data_dir={root / 'data'}", "--dataset=recall", "--block_size=32",
        f"--out_dir={out}", "--max_iters=6", "--eval_interval=6", "--always_save_checkpoint=True",
        "--learning_rate=1e-2", "--warmup_iters=0")
    return out, root / "data" / "recall"


def test_evaluate_recall_accuracy(recall_model):
    """accuracy: the share of labelled positions where the argmax of the whole vocabulary is the label, counted
    here from one pass over each example; queries and examples with max_examples cutting the test set."""
    out, data = recall_model
    run("evaluate.py", f"--out_dir={out}", "--device=cpu", "--dtype=float32", "--batch_size=7", "--max_examples=20")
    res = json.loads((out / "eval.json").read_text())["results"]
    m = load(out)
    assert [r["length"] for r in res] == [32, 64]
    for r in res:
        L = r["length"]
        x = np.fromfile(data / f"test_{L}.bin", dtype=np.uint16).reshape(-1, L)[:20]
        y = np.fromfile(data / f"test_{L}_labels.bin", dtype=np.int16).reshape(-1, L)[:20].astype(np.int64)
        asked = torch.from_numpy(y != -1)
        hits = (full_logits(m, x).argmax(-1) == torch.from_numpy(y))[asked]
        assert 0 < hits.sum() < len(hits)  # a count that a wrong numerator or denominator changes
        assert r["examples"] == 20 and r["queries"] == len(hits)
        assert r["accuracy"] == hits.sum().item() / len(hits)


# -----------------------------------------------------------------------------
# The attention layer's rotary embedding


def test_rope_is_the_rotation_of_each_pair():
    """Rotate-half RoPE: dimension i and i + D/2 form a pair rotated by the angle pos * theta^(-2i/D), written out
    here as the 2x2 rotation on a small case (D = 4, theta 100) and on random data against that formula."""
    x = torch.tensor([[[[1.0, 2.0, 3.0, 4.0]]]])  # (B, T, H, D) = (1, 1, 1, 4): pairs (1, 3) and (2, 4)
    pos = torch.tensor([2])
    got = model.rope(x, pos, 100.0)[0, 0, 0].double()
    a0, a1 = 2.0, 2.0 / 10  # freqs 100^0 = 1 and 100^(-2/4) = 0.1
    want = torch.tensor([1 * math.cos(a0) - 3 * math.sin(a0), 2 * math.cos(a1) - 4 * math.sin(a1),
                         3 * math.cos(a0) + 1 * math.sin(a0), 4 * math.cos(a1) + 2 * math.sin(a1)], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    assert torch.equal(model.rope(x, torch.tensor([0]), 100.0), x)  # position 0: no rotation
    torch.manual_seed(0)
    B, T, H, D, theta = 2, 7, 3, 8, 10000.0
    x, pos = torch.randn(B, T, H, D, dtype=torch.float64), torch.arange(5, 5 + T)
    y = model.rope(x, pos, theta).double()
    for i in range(D // 2):
        angle = pos.double()[None, :, None] * theta ** (-2 * i / D)
        c, s = angle.cos(), angle.sin()
        assert torch.allclose(y[..., i], x[..., i] * c - x[..., i + D // 2] * s, atol=1e-5)
        assert torch.allclose(y[..., i + D // 2], x[..., i + D // 2] * c + x[..., i] * s, atol=1e-5)
        # a rotation: each pair's norm kept
        assert torch.allclose(y[..., i].hypot(y[..., i + D // 2]), x[..., i].hypot(x[..., i + D // 2]), atol=1e-5)


def test_rope_scores_depend_on_relative_positions_only():
    """q at i and k at j give the score of q at i + s and k at j + s, for every shift s; and another relative
    position gives another score."""
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16)
    score = lambda i, j: (model.rope(q, torch.tensor([i]), 10000.0) * model.rope(k, torch.tensor([j]), 10000.0)).sum(-1)
    for i, j in [(0, 0), (3, 1), (1, 3), (10, 2)]:
        for s in (1, 5, 100):
            assert torch.allclose(score(i + s, j + s), score(i, j), atol=1e-4), (i, j, s)
    assert not torch.allclose(score(3, 1), score(4, 1), atol=1e-2)


# -----------------------------------------------------------------------------
# The options that change how a step is computed, end to end (slow)

EACH_RUN = """import contextlib, io, json, runpy, sys
script, runs = sys.argv[1], json.loads(sys.argv[2])
for args in runs:
    sys.argv = [script, *args]
    with contextlib.redirect_stdout(io.StringIO()):
        runpy.run_path(script, run_name="__main__")
"""


def train_runs(runs):
    """train.py run with each list of arguments in runs, one after the other in one process (torch imported once)."""
    p = subprocess.run([sys.executable, "-c", EACH_RUN, str(ROOT / "train.py"), json.dumps(runs)], capture_output=True,
                       text=True, timeout=600, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]


def losses(out_dir):
    return [r["loss"] for r in read_log(out_dir) if "loss" in r]


@pytest.mark.slow
def test_step_options_end_to_end(docs, tmp_path):
    """Each option run 3 iterations: finite losses; those that compute the same step by another path (the fused
    loss, the elementwise work recomputed, the PyTorch backends) give the default path's losses within 1e-5
    (float32 round-off: the same weights and batches); dropout gives other, finite ones."""
    base = [*TINY, f"--data_dir={docs}", "--dataset=docs", "--max_iters=3", "--eval_interval=3", "--learning_rate=1e-2"]
    options = {"default": [], "fused_loss": ["--fused_loss=True"], "recompute": ["--recompute_elementwise=True"],
               "chunkwise": ["--backend=chunkwise"], "recurrent": ["--backend=recurrent"], "dropout": ["--dropout=0.1"]}
    train_runs([[*base, f"--out_dir={tmp_path / name}", *opts] for name, opts in options.items()])
    got = {name: losses(tmp_path / name) for name in options}
    assert all(len(v) == 3 and all(map(math.isfinite, v)) for v in got.values()), got
    for name in ("fused_loss", "recompute", "chunkwise", "recurrent"):
        assert got[name] == pytest.approx(got["default"], rel=1e-5), (name, got)
    assert got["dropout"] != got["default"]


COMPILE_LIMIT = 900  # seconds; inductor's C++ compilation of a tiny model takes minutes on 2 busy cores


@pytest.mark.slow
def test_compile_end_to_end(docs, tmp_path):
    """compile=True on the CPU (torch.compile with inductor, which needs a C++ compiler): the run ends with the
    eager run's losses within 1e-4 (fused kernels reorder float32 sums)."""
    import shutil
    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        pytest.skip("torch.compile on the CPU needs a C++ compiler, and none is installed")
    base = [*TINY, f"--data_dir={docs}", "--dataset=docs", "--max_iters=3", "--eval_interval=3", "--learning_rate=1e-2"]
    run("train.py", *base, f"--out_dir={tmp_path / 'eager'}")
    try:
        run("train.py", *base, f"--out_dir={tmp_path / 'compiled'}", "--compile=True", timeout=COMPILE_LIMIT)
    except subprocess.TimeoutExpired:
        pytest.skip(f"torch.compile of the model on this CPU took over {COMPILE_LIMIT} s")
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert len(compiled) == 3 and all(map(math.isfinite, compiled))
    assert compiled == pytest.approx(eager, rel=1e-4)
