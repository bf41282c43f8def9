"""
prepare_data.py: the datasets (characters, BPE, Python code, the synthetic tasks), their splits by document, the
labels of the tasks, and its failure cases.
"""

import json
import os
import signal
import time

import numpy as np
import pytest

import prepare_data

from helpers import PLAY, ROOT, assert_clean_error, run


SHARED_TIKTOKEN = os.path.join(ROOT, "..", "shared", "tiktoken")


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


def test_recall_examples_follow_the_protocol():
    x, y = prepare_data.recall_examples(3000, 256, 32, 8192, np.random.default_rng(0))
    keys, values = x[:, 0:64:2], x[:, 1:64:2]
    assert (keys < 4096).all() and (values >= 4096).all() and x.max() < 8192
    asked = y != -1
    assert not asked[:, :64].any() and not asked[:, -1].any()
    assert 28.5 < asked.sum(1).mean() < 30.5  # 32 queries, some overwritten (about 29 survive)
    for i in range(100):  # every label is the value stored with the key asked at that position
        for pos in np.flatnonzero(asked[i]):
            assert y[i, pos] in values[i][keys[i] == x[i, pos]]
    # later positions are uniform noise; the queries lean early (density ~ x^-0.1)
    pos = np.flatnonzero(asked.any(0))
    assert asked[:, 64:160].sum() > asked[:, 160:256].sum()
    x2, y2 = prepare_data.recall_examples(3000, 256, 32, 8192, np.random.default_rng(0))
    assert np.array_equal(x, x2) and np.array_equal(y, y2) and len(pos) > 150


@pytest.mark.slow
def test_prepare_synthetic_n_train(tmp_path):
    """--n_train sets the number of training examples (the authors' 20,000 otherwise) and is recorded."""
    p = run("prepare_data.py", "--dataset=mqar_small", f"--data_dir={tmp_path}", "--n_train=100")
    assert p.returncode == 0, p.stderr
    d = tmp_path / "mqar_small"
    assert json.loads((d / "meta.json").read_text())["n_train"] == 100
    assert os.path.getsize(d / "train.bin") == 100 * 128 * 2 and os.path.getsize(d / "val.bin") == 2000 * 128 * 2


# -----------------------------------------------------------------------------
# prepare_data.py


def test_markdown_to_dialogue():
    assert prepare_data.markdown_to_dialogue(PLAY) == DIALOGUE


def test_prepare_char(tiny_data):
    d = os.path.join(tiny_data, "shakespeare_char")
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    assert meta["tokenizer"] == "char" and meta["dtype"] == "uint16" and "eot" not in meta
    assert meta["chars"] == "".join(sorted(set(DIALOGUE))) and meta["vocab_size"] == len(meta["chars"])
    train, val, test = (np.fromfile(os.path.join(d, f"{s}.bin"), dtype=np.uint16) for s in ("train", "val", "test"))
    assert len(train) == 18 * len(val) == 18 * len(test)  # whole plays: 18, 1 and 1
    encode, decode = prepare_data.get_tokenizer(meta)
    assert decode(np.concatenate([train, val, test]).tolist()) == DIALOGUE * 120
    assert encode("BOB:\n") == [meta["chars"].index(c) for c in "BOB:\n"]
    with pytest.raises(ValueError, match="'Z'"):
        encode("Zounds")


def need_bpe():
    if os.path.isdir(SHARED_TIKTOKEN):
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", SHARED_TIKTOKEN)
    try:
        import tiktoken
        tiktoken.get_encoding("r50k_base")
    except Exception as err:
        pytest.skip(f"GPT-2 BPE unavailable offline: {err}")


@pytest.mark.slow
def test_prepare_bpe(tmp_path):
    """GPT-2 BPE of the plays, each ended by the end-of-text token, which meta.json names; a play's own
    "<|endoftext|>" is text."""
    need_bpe()
    src = tmp_path / "plays"
    src.mkdir()
    (src / "a.md").write_text(PLAY * 10)
    (src / "b.md").write_text(PLAY.replace("good night", "<|endoftext|>") * 3)
    (src / "c.md").write_text(PLAY * 2)
    prepare_data.prepare("shakespeare", str(tmp_path / "data"), source_dir=str(src))
    d = tmp_path / "data" / "shakespeare"
    meta = json.loads((d / "meta.json").read_text())
    assert meta["vocab_size"] == 50257 and meta["tokenizer"] == "tiktoken" and meta["dtype"] == "uint16"
    assert meta["eot"] == 50256
    splits = [np.fromfile(d / f"{s}.bin", dtype=np.uint16) for s in ("train", "val", "test")]
    other = DIALOGUE.replace("good night", "<|endoftext|>")
    decode = prepare_data.get_tokenizer(meta)[1]
    assert sorted(decode(ids.tolist()) for ids in splits) == sorted(
        [DIALOGUE * 10 + "<|endoftext|>", other * 3 + "<|endoftext|>", DIALOGUE * 2 + "<|endoftext|>"])
    assert all((ids == 50256).sum() == 1 and ids[-1] == 50256 for ids in splits)  # one after each play


def prepared_from(src, dataset, tmp_path):
    """prepare_data on the source folder src: (meta.json, the splits' token ids, their decoded texts sorted)."""
    prepare_data.prepare(dataset, str(tmp_path / "data"), source_dir=str(src))
    d = tmp_path / "data" / dataset
    meta = json.loads((d / "meta.json").read_text())
    splits = [np.fromfile(d / f"{s}.bin", dtype=np.uint16) for s in ("train", "val", "test")]
    return meta, splits, sorted(prepare_data.get_tokenizer(meta)[1](ids.tolist()) for ids in splits)


@pytest.mark.slow
def test_prepare_python_stdlib(tmp_path):
    need_bpe()
    src = tmp_path / "lib"
    (src / "json").mkdir(parents=True)
    (src / "site-packages" / "numpy").mkdir(parents=True)
    (src / "json" / "b.py").write_text("def b():\n    return 2\n")
    (src / "a.py").write_text("import os\nprint(os.sep)\n")
    (src / "z.py").write_text("z = 26\n")
    (src / "notes.txt").write_text("not python")
    (src / "site-packages" / "numpy" / "c.py").write_text("x = 1\n")
    meta, splits, texts = prepared_from(src, "python_stdlib", tmp_path)
    assert texts == \
        ["def b():\n    return 2\n<|endoftext|>", "import os\nprint(os.sep)\n<|endoftext|>", "z = 26\n<|endoftext|>"]
    assert all((ids == 50256).sum() == 1 for ids in splits) and meta["eot"] == 50256  # one after each file


@pytest.mark.slow
def test_prepare_python_code(tmp_path):
    """python_code: every .py file under the folders, site-packages included, each distinct text once."""
    need_bpe()
    src = tmp_path / "lib"
    (src / "site-packages" / "pip" / "_vendor").mkdir(parents=True)
    (src / "a.py").write_text("import os\n")
    (src / "site-packages" / "numpy.py").write_text("x = 1\n")
    (src / "site-packages" / "pip" / "six.py").write_text("six = 6\n")
    (src / "site-packages" / "pip" / "_vendor" / "six.py").write_text("six = 6\n")  # a vendored copy
    _, _, texts = prepared_from(src, "python_code", tmp_path)
    assert texts == \
        ["import os\n<|endoftext|>", "six = 6\n<|endoftext|>", "x = 1\n<|endoftext|>"]
    cfg = {"__file__": os.path.join(ROOT, "config", "python_code.py")}  # the LM of GPT-2 small's size on it
    exec(open(cfg["__file__"]).read(), cfg)
    assert (cfg["dataset"], cfg["n_layer"], cfg["n_embd"], cfg["single_pass"]) == ("python_code", 12, 768, True)


@pytest.mark.slow
def test_prepare_web_fails_fast_offline(tmp_path):
    """Without the datasets library or the network the web corpus fails at once, saying why."""
    p = run("prepare_data.py", "--dataset=fineweb_edu", f"--data_dir={tmp_path}", timeout=60)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "datasets" in p.stderr or "cannot be reached" in p.stderr, p.stderr


@pytest.mark.slow
def test_online_check_fails_fast():
    t0 = time.time()
    with pytest.raises(SystemExit, match="cannot be reached"):
        prepare_data.check_online("https://kla-test.invalid", timeout=5)  # .invalid never resolves
    assert time.time() - t0 < 10


def test_prepare_unknown_dataset(tmp_path):
    assert_clean_error(run("prepare_data.py", "--dataset=nope", f"--data_dir={tmp_path}"), "unknown dataset 'nope'")


def split_into(text, documents):
    """The indices of the documents whose concatenation, in corpus order, is text; None if there are none."""
    taken, at = [], 0
    for i, doc in enumerate(documents):
        if text.startswith(doc, at):
            taken.append(i)
            at += len(doc)
    return taken if at == len(text) else None


@pytest.mark.slow
def test_splits_are_whole_documents_disjoint_and_cover_the_corpus(tmp_path):
    """prepare_data.py puts each play in exactly one of train / val / test, whole, in corpus order, with at least
    5 % of the tokens in val and in test, and splits the same corpus the same way every time."""
    src = tmp_path / "plays"
    src.mkdir()
    plays = [PLAY.replace("ALICE", f"ALICE{i}") * (1 + i % 3) for i in range(12)]
    for i, play in enumerate(plays):
        (src / f"play{i:02d}.md").write_text(play)
    dialogues = [prepare_data.markdown_to_dialogue(play) for play in plays]
    assert len(set(dialogues)) == 12
    found = {}
    for data in ("a", "b"):
        prepare_data.prepare("shakespeare_char", str(tmp_path / data), source_dir=str(src))
        d = tmp_path / data / "shakespeare_char"
        meta = json.loads((d / "meta.json").read_text())
        decode = prepare_data.get_tokenizer(meta)[1]
        texts = {s: decode(np.fromfile(d / f"{s}.bin", dtype=np.uint16).tolist()) for s in ("train", "val", "test")}
        found[data] = {s: split_into(text, dialogues) for s, text in texts.items()}
        assert all(found[data][s] for s in texts), found[data]  # each a non-empty run of whole plays in corpus order
        assert sorted(i for s in texts for i in found[data][s]) == list(range(12))  # disjoint, covering
        total = sum(len(t) for t in texts.values())
        for s in ("val", "test"):
            assert meta[f"{s}_tokens"] == len(texts[s]) >= 0.05 * total
            assert meta[f"{s}_documents"] == len(found[data][s])
            assert len(texts[s]) - max(len(dialogues[i]) for i in found[data][s]) < 0.05 * total  # stops once there
    assert found["a"] == found["b"]
    (src / "play02.md").unlink()
    for i in range(3, 12):
        (src / f"play{i:02d}.md").unlink()
    assert_clean_error(run("prepare_data.py", f"--source_dir={src}", f"--data_dir={tmp_path / 'c'}"),
                       "the corpus has 2 document(s): the train, val and test splits need one each")


def test_palindrome_labels_are_the_reversed_half():
    """Recomputed from the tokens alone: src before the one SEP, the labels from SEP on are src reversed."""
    x, y = prepare_data.palindrome_examples(200, 64, 128, np.random.default_rng(3))
    assert x.shape == y.shape == (200, 64) and x.max() <= 127 and x.min() >= 0
    for xi, yi in zip(x, y):
        sep = int(np.flatnonzero(xi == 127)[0])
        assert sep == 32 and (xi == 127).sum() == 1
        src = xi[:sep]
        assert np.array_equal(np.flatnonzero(yi != -1), np.arange(32, 64))
        assert np.array_equal(yi[32:], src[::-1]) and np.array_equal(xi[33:], src[::-1][:-1])
    assert len(np.unique(x[:, :32])) == 127  # src draws every token but SEP
    x2, y2 = prepare_data.palindrome_examples(200, 64, 128, np.random.default_rng(3))
    x3, _ = prepare_data.palindrome_examples(200, 64, 128, np.random.default_rng(4))
    assert np.array_equal(x, x2) and np.array_equal(y, y2) and not np.array_equal(x, x3)


@pytest.mark.parametrize("length", [1024, 1022, 1021])
def test_stack_labels_are_the_popped_values(length):
    """Replayed with Python lists from the tokens alone: every PUSH onto a stack, every POP from a non-empty one,
    each `?` labelled with the value popped, nothing else labelled (nor a POP cut off before its `?`)."""
    push, pop, ask = 125, 126, 127
    x, y = prepare_data.stack_examples(200, length, 64, 128, np.random.default_rng(5))
    assert x.shape == y.shape == (200, length)
    pops = triples = deeper = 0
    for xi, yi in zip(x, y):
        stacks, last_pushed, expected = {}, {}, np.full(length, -1)
        for p in range(0, length, 3):
            op, sid = xi[p], xi[p + 1] if p + 1 < length else None
            triples += 1
            assert sid is None or 0 <= sid < 64
            if op == push:
                if p + 2 < length:
                    assert 64 <= xi[p + 2] <= 124
                    stacks.setdefault(sid, []).append(xi[p + 2])
                    last_pushed[sid] = xi[p + 2]
            else:
                assert op == pop and (sid is None or stacks.get(sid)), (p, op)
                if p + 2 < length:
                    assert xi[p + 2] == ask
                    expected[p + 2] = stacks[sid].pop()
                    pops += 1
                    deeper += expected[p + 2] != last_pushed[sid]
        assert np.array_equal(yi, expected)
    assert 0.4 < pops / triples < 0.55  # a POP half the time once a stack holds a value
    assert deeper > 0.05 * pops  # some pops reach under a value pushed and popped later: a stack, not the last write
    x2, y2 = prepare_data.stack_examples(200, length, 64, 128, np.random.default_rng(5))
    assert np.array_equal(x, x2) and np.array_equal(y, y2)


@pytest.mark.slow
def test_stack_and_palindrome_follow_the_protocol():
    """The datasets and configs: vocab 128, 64 stacks, trained at 1024 and tested at 256 .. 2048; the synthetic
    model of config/mqar.py (2 layers, width 256, 4 heads, d_k 48 / d_v 96 a head, SwiGLU 1024) and its training."""
    for name in ("stack", "palindrome"):
        spec = prepare_data.SYNTHETIC[name]
        assert spec["task"] == name and spec["vocab"] == 128 and spec.get("n_stacks", 64) == 64
        assert spec["train_length"] == 1024 and spec["test_lengths"] == (256, 512, 1024, 2048)
        cfg = {"__file__": os.path.join(ROOT, "config", f"{name}.py")}
        exec(open(cfg["__file__"]).read(), cfg)
        assert (cfg["dataset"], cfg["block_size"], cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["mlp_hidden"]) \
            == (name, 1024, 2, 256, 4, 1024) and "expand_k" not in cfg and "expand_v" not in cfg  # 0.75, 1.5
        assert (cfg["learning_rate"], cfg["decay_lr"], cfg["batch_size"], cfg["max_iters"], cfg["eval_interval"],
                cfg["patience"], cfg["weight_decay"], cfg["beta2"], cfg["grad_clip"]) == (1e-3, False, 32, 10_000, 200,
                                                                                         10, 0.1, 0.95, 1.0)
    p = run("-c", "import json, sys; sys.argv = ['experiments.py']; import experiments; "
                  "print(json.dumps(experiments.TASKS))")
    assert p.returncode == 0, p.stderr
    tasks = json.loads(p.stdout.splitlines()[-1])
    for name in ("stack", "palindrome", "stack_small", "palindrome_small"):
        assert tasks[name] == [f"config/{name}.py", name, "accuracy"]
    assert tasks["lm"][2] == "test_loss"


@pytest.mark.slow
def test_prepare_data_ctrl_c_keeps_the_old_dataset(tmp_path, monkeypatch, capsys):
    """Ctrl-C in prepare_data.py: one line and exit status 130; the old dataset is left as it was, or, for a Ctrl-C
    while the new one replaces it (its renames are not cut half-way), the new one is whole."""
    data = tmp_path / "data"
    prepare_data.prepare("mqar_small", str(data), n_train=100)
    files = lambda: {f.name: f.read_bytes() for f in (data / "mqar_small").iterdir()}  # noqa: E731
    before = files()
    generate, write_file, calls = prepare_data.recall_examples, prepare_data.write_file, []

    def ctrl_c(*args, **kw):  # during the first test set
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return generate(*args, **kw)

    def ctrl_c_at_commit(*args):  # while meta.json, the last file, is written
        signal.raise_signal(signal.SIGINT)
        return write_file(*args)

    for name, fake, kept in (("recall_examples", ctrl_c, "the dataset in {}, if any, is left as it was"),
                             ("write_file", ctrl_c_at_commit, "{} was written in full before the interrupt")):
        with monkeypatch.context() as m:
            m.setattr(prepare_data, name, fake)
            with pytest.raises(SystemExit) as e:
                prepare_data.prepare("mqar_small", str(data), n_train=50)
        assert e.value.code == 130
        assert capsys.readouterr().err == "interrupted; " + kept.format(data / "mqar_small") + "\n"
        assert not [f for f in os.listdir(data / "mqar_small") if f.endswith(".tmp")]
    assert before.keys() == files().keys() and before != files()
    assert json.loads((data / "mqar_small" / "meta.json").read_text())["n_train"] == 50


@pytest.mark.slow
def test_prepare_data_errors_keep_the_old_dataset(tmp_path, monkeypatch):
    """prepare_data.py: a data_dir that is a file, or an n_train whose examples cannot fit in memory, is one line
    before any work; a preparation that fails half-way (out of memory, a full disk) leaves the old dataset as it
    was, without temporary files."""
    (tmp_path / "ok.txt").write_text("")
    assert_clean_error(run("prepare_data.py", f"--data_dir={tmp_path / 'ok.txt'}"),
                       f"data_dir = '{tmp_path / 'ok.txt'}' is a file: it must be a folder")
    data = tmp_path / "data"
    prepare_data.prepare("mqar_small", str(data), n_train=100)
    files = lambda: {f.name: f.read_bytes() for f in (data / "mqar_small").iterdir()}
    before = files()
    p = run("prepare_data.py", "--dataset=mqar_small", f"--data_dir={data}", f"--n_train={10 ** 12}")
    assert_clean_error(p, "n_train = 1000000000000: generating", "GB of memory", "choose a smaller --n_train")
    assert len(p.stderr.splitlines()) == 1 and files() == before
    generate, write_tmp = prepare_data.recall_examples, prepare_data.write_tmp
    calls = []

    def out_of_memory(*args, **kw):  # the first test set
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError
        return generate(*args, **kw)

    def disk_full(*args):  # the fifth file
        calls.append(1)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return write_tmp(*args)

    for name, fake, phrase in (("recall_examples", out_of_memory, "not enough memory to prepare"),
                               ("write_tmp", disk_full, "cannot prepare")):
        calls.clear()
        with monkeypatch.context() as m:
            m.setattr(prepare_data, name, fake)
            with pytest.raises(SystemExit) as e:
                prepare_data.prepare("mqar_small", str(data), n_train=50)
        assert phrase in str(e.value.code) and "the dataset there, if any, is left as it was" in str(e.value.code)
        assert files() == before
