"""
evaluate.py and experiments.py: training and evaluating on the synthetic tasks and on documents, the experiments'
tables, resume and failure cases.
"""

import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import prepare_data

from helpers import (
    ROOT, TINY, assert_clean_error, assert_each_is_one_line, run, run_each, train_in_background, train_log,
    wait_until,
)


# -----------------------------------------------------------------------------
# Synthetic recall (MQAR, S-NIAH) and evaluate.py


def test_experiments_summary_gives_no_spread_for_one_seed():
    """The summary table shows mean ± sample std over seeds, and a bare mean where one seed ran."""
    rows = [{"mixer": "kla", "loss@1": "2.0"}, {"mixer": "kla", "loss@1": "3.0"}, {"mixer": "attn", "loss@1": "2.5"}]
    p = run("-c", f"import sys; sys.argv = ['experiments.py']; import experiments; "
                  f"print(experiments.summary('lm', 'loss', {rows!r}))")
    assert p.returncode == 0, p.stderr
    assert "| kla | 2 | 2.50 ± 0.71 |" in p.stdout and "| attn | 1 | 2.50 |" in p.stdout, p.stdout


@pytest.mark.slow
def test_experiments_summary_keeps_the_lengths_every_seed_has():
    """Seeds evaluated at different lengths (one at 1, 2, 4, another at 1, 4) are summarised at the lengths all of
    them have, each value in its own column."""
    rows = [{"mixer": "kla", "loss@1": "2.0", "loss@2": "9.0", "loss@4": "1.0"}, {"mixer": "kla", "loss@1": "3.0", "loss@4": "2.0"},
            {"mixer": "gdn", "loss@1": "2.5", "loss@4": "1.5"}]
    p = run("-c", f"import sys; sys.argv = ['experiments.py']; import experiments; "
                  f"print(experiments.summary('lm', 'loss', {rows!r}))")
    assert p.returncode == 0, p.stderr
    assert "| mixer or rule | seeds | 1 | 4 |" in p.stdout, p.stdout
    assert "| kla | 2 | 2.50 ± 0.71 | 1.50 ± 0.71 |" in p.stdout and "| gdn | 1 | 2.50 | 1.50 |" in p.stdout, p.stdout


@pytest.mark.slow
def test_experiments_summary_pairs_kla_and_gdn_seed_by_seed():
    """With KLA and GDN run on the same seeds, the summary adds their difference seed by seed: its mean, sample std
    and how many seeds KLA leads in (higher accuracy; for a loss, lower); seeds only one of them ran are left out."""
    rows = [{"mixer": m, "seed": str(s), "accuracy@8": str(a)} for m, s, a in
            [("kla", 1, 0.9), ("gdn", 1, 0.8), ("kla", 2, 0.5), ("gdn", 2, 0.7), ("kla", 3, 0.6), ("gdn", 3, 0.6),
             ("kla", 4, 0.1)]]
    p = run("-c", f"import sys; sys.argv = ['experiments.py']; import experiments; "
                  f"print(experiments.summary('mqar', 'accuracy', {rows!r}))")
    assert p.returncode == 0, p.stderr
    assert "| kla - gdn, paired | 3 | -3.33 ± 15.28 (1 of 3 kla ahead) |" in p.stdout, p.stdout


@pytest.mark.slow
def test_experiments_resumes_a_stopped_run(tmp_path):
    """experiments.py prepares a task's data in --data_dir with --n_train examples, resumes a run that has a
    checkpoint but no eval.json (stopped by a deadline with --eval_stopped=False, or killed) instead of
    starting it again, evaluates it and writes its row of the results table."""
    data, root, res = tmp_path / "data", tmp_path / "exp", tmp_path / "res"
    small = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--mlp_hidden=64", "--batch_size=4", "--eval_interval=3",
             "--eval_iters=2", "--log_interval=1", "--device=cpu", "--dtype=float32", "--compile=False",
             "--always_save_checkpoint=True"]
    exp = ["experiments.py", "--tasks=mqar_small", "--mixers=kla", "--seeds=1", "--jobs=1", f"--root={root}",
           f"--results_dir={res}", f"--data_dir={data}", "--n_train=100", "--eval_args=--max_examples=8 --device=cpu"]
    p = run(*exp, "--train_args=" + " ".join(small + ["--max_iters=6"]), "--deadline=1", "--eval_stopped=False",
            timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads((data / "mqar_small" / "meta.json").read_text())["n_train"] == 100
    run_dir = root / "mqar_small-kla-1"
    assert "deadline: stopped" in p.stdout and not (run_dir / "eval.json").exists()  # killed within a second
    # a run killed after its checkpoint at iteration 6 (train.py by hand, as experiments.py starts it)
    p = run("train.py", "config/mqar_small.py", "--mixer=kla", "--seed=1", f"--out_dir={run_dir}",
            f"--data_dir={data}", "--sample_tokens=0", *small, "--max_iters=6", timeout=300)
    assert p.returncode == 0, p.stderr
    p = run(*exp, "--train_args=" + " ".join(small + ["--max_iters=9"]), timeout=300)
    assert p.returncode == 0, p.stderr
    assert f"resumed {run_dir}" in p.stdout and "evaluated 1 runs" in p.stdout
    evals = [json.loads(line)["iter"] for line in open(run_dir / "log.jsonl") if '"val_loss"' in line]
    assert evals == [0, 3, 6, 9]  # went on from 6 (its evaluation there logged once), not from 0
    rows = list(csv.DictReader(open(res / "mqar_small.csv")))
    assert [(r["mixer"], r["seed"], r["last_iter"]) for r in rows] == [("kla", "1", "9")]
    # a run that train.py ended but whose evaluation did not finish: evaluated again, not trained again
    (run_dir / "eval.json").unlink()
    p = run(*exp, "--train_args=" + " ".join(small + ["--max_iters=9"]), timeout=300)
    assert p.returncode == 0, p.stderr
    assert "nothing left to train" in p.stdout and "evaluated 1 runs" in p.stdout, p.stdout
    assert [json.loads(line)["iter"] for line in open(run_dir / "log.jsonl") if '"val_loss"' in line] == evals
    # a run that fails: its exit status and its last line in experiments.py's own output (a block_size that the
    # task's examples refuse: found by train.py once it reads the data; a setting out of range is refused before any
    # run, test_experiments_checks_the_flags_of_its_runs_before_any_work)
    p = run(*exp, "--seeds=2", "--train_args=" + " ".join(small + ["--max_iters=6", "--block_size=64"]), timeout=300)
    assert_clean_error(p, f"error: 1 run(s) failed: {root / 'mqar_small-kla-2'}")
    assert f"failed {root / 'mqar_small-kla-2'} (exit 1)\n    error: {data / 'mqar_small'} holds examples of 128 " \
           "tokens: set --block_size=128" in p.stdout, p.stdout


@pytest.mark.slow
def test_experiments_leaves_a_run_in_use_alone(tmp_path):
    """experiments.py over a run that another train.py is training (the same command in two terminals) neither
    trains nor evaluates it: its train.py stops at the lock, and no eval.json marks the unfinished run as done."""
    data, root, res = tmp_path / "data", tmp_path / "exp", tmp_path / "res"
    prepare_data.prepare("mqar_small", str(data), n_train=100)
    small = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--mlp_hidden=64", "--batch_size=4", "--eval_interval=3",
             "--eval_iters=2", "--device=cpu", "--dtype=float32", "--compile=False", "--always_save_checkpoint=True"]
    run_dir = root / "mqar_small-kla-1"
    first = train_in_background("config/mqar_small.py", "--mixer=kla", "--seed=1", f"--out_dir={run_dir}",
                                f"--data_dir={data}", "--sample_tokens=0", *small, "--max_iters=100000", "--patience=0")
    try:
        wait_until((run_dir / "ckpt.pt").exists)  # a checkpoint, which the old experiments.py would have evaluated
        p = run("experiments.py", "--tasks=mqar_small", "--mixers=kla", "--seeds=1", "--jobs=1", f"--root={root}",
                f"--results_dir={res}", f"--data_dir={data}", "--train_args=" + " ".join(small + ["--max_iters=9"]),
                "--eval_args=--max_examples=8 --device=cpu", timeout=300)
        assert p.returncode == 0, p.stderr
        assert f"left alone {run_dir}: in use by another train.py" in p.stdout and "evaluated 0 runs" in p.stdout, p.stdout
        assert first.poll() is None and not (run_dir / "eval.json").exists()
    finally:
        first.kill()
        first.wait()


@pytest.mark.slow
def test_a_second_experiments_leaves_the_running_runs_output_alone(tmp_path):
    """A second experiments.py over the --root of one still training (the command typed twice) neither starts its run
    nor touches the run's stdout.txt, which keeps the first run's output (not emptied, no NUL bytes, no refusal)."""
    data, root = tmp_path / "data", tmp_path / "exp"
    prepare_data.prepare("mqar_small", str(data), n_train=100)
    # trains until stopped here, without a checkpoint (the second run's output was then opened to be emptied)
    train = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--mlp_hidden=64", "--batch_size=4", "--eval_interval=100000",
             "--eval_iters=2", "--log_interval=1", "--device=cpu", "--dtype=float32", "--compile=False",
             "--max_iters=100000", "--patience=0"]
    cmd = ["experiments.py", "--tasks=mqar_small", "--mixers=kla", "--seeds=1", "--jobs=1", f"--root={root}",
           f"--results_dir={tmp_path / 'res'}", f"--data_dir={data}", "--train_args=" + " ".join(train)]
    first = subprocess.Popen([sys.executable, os.path.join(ROOT, cmd[0]), *cmd[1:]], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    stdout = root / "mqar_small-kla-1" / "stdout.txt"
    try:
        wait_until(lambda: stdout.exists() and b"iter 3:" in stdout.read_bytes(), timeout=240)
        before = stdout.read_bytes()
        p = run(*cmd, timeout=240)
        assert p.returncode == 0, p.stderr
        assert f"left alone {root / 'mqar_small-kla-1'}: in use by another train.py" in p.stdout, p.stdout
        after = stdout.read_bytes()
        assert b"iter 3:" in before and after.startswith(before) and b"\0" not in after and b"error" not in after
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGINT)  # its runs stopped, as at a Ctrl-C
        first.communicate(timeout=60)


@pytest.mark.slow
def test_experiments_refuses_damaged_tables_files_for_runs_and_changed_flags(tmp_path):
    """experiments.py, before any work: a results table that it did not write (damaged, edited by hand) is one line; a
    file where a run's folder should be is one line; a done run trained with another value of a flag of --train_args
    is one line (its result would be collected as if of these flags); --overwrite=True says when the table it writes
    keeps rows of other runs in a mean and spread beside the replaced ones."""
    root, res = tmp_path / "exp", tmp_path / "res"
    run_dir = root / "mqar_small-kla-1"  # a done run: evaluated at its checkpoint's iteration, its log ended
    run_dir.mkdir(parents=True)
    (run_dir / "eval.json").write_text(json.dumps({"mixer": "kla", "seed": 1, "iter_num": 4,
                                                   "results": [{"length": 128, "accuracy": 0.5}]}))
    (run_dir / "log.jsonl").write_text('{"iter": 4, "val_loss": 1.0}\n{"iter": 4, "end": "max_iters", "patience": 0}\n')
    torch.save({"iter_num": 4, "config": {"max_iters": 4, "learning_rate": 0.001}}, run_dir / "ckpt.pt")
    res.mkdir()
    table = res / "mqar_small.csv"
    collect = ["experiments.py", "--collect=True", "--tasks=mqar_small", f"--root={root}", f"--results_dir={res}"]
    for damaged in ("mixer,seed,accuracy@128\nkla\n", "mixer,seed,accuracy@128\nkla,1,0.5,7\n",
                    "mixer,seed,accuracy@128\nkla,one,0.5\n", "mixer,seed,accuracy@128\nkla,1,half\n"):
        table.write_text(damaged)
        p = run(*collect)
        assert_clean_error(p, f"{table} is not a results table that experiments.py writes", "restore it")
        assert len(p.stderr.splitlines()) == 1 and table.read_text() == damaged, p.stderr
    table.write_text("mixer,step_rule,seed,accuracy@128\nkla,,1,0.9000\nkla,,2,0.8000\n")
    p = run(*collect, "--overwrite=True")
    assert p.returncode == 0, p.stderr
    assert f"warning: --overwrite=True replaces kla seed(s) 1 of {table} with runs under {root}, and keeps its kla " \
           "seed(s) 2 of other runs" in p.stderr, p.stderr
    assert "kla,,1," in table.read_text() and ",0.5000" in table.read_text()
    train = ["experiments.py", "--tasks=mqar_small", "--mixers=kla", f"--root={root}", f"--results_dir={res}",
             f"--data_dir={tmp_path / 'data'}"]
    (root / "mqar_small-kla-2").write_text("not a run")
    p = run(*train, "--seeds=1,2")
    assert_clean_error(p, f"{root / 'mqar_small-kla-2'} is a file where the folder of a run should be")
    p = run(*train, "--seeds=1", "--train_args=--max_iters=9 --learning_rate=1e-3")
    assert_clean_error(p, f"{run_dir} is done, trained with max_iters = 4, and --train_args gives max_iters = 9")
    assert not (tmp_path / "data").exists()  # before any work


@pytest.mark.slow
def test_experiments_sigterm_stops_like_the_deadline(tmp_path):
    """A SIGTERM to experiments.py (a scheduler's time limit) stops its training runs at once, as --deadline
    does, evaluates their best checkpoint so far and writes the table: the work done is not lost."""
    data, root, res = tmp_path / "data", tmp_path / "exp", tmp_path / "res"
    train = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--mlp_hidden=64", "--batch_size=4", "--eval_interval=3",
             "--eval_iters=2", "--device=cpu", "--dtype=float32", "--compile=False", "--max_iters=100000"]
    cmd = [sys.executable, os.path.join(ROOT, "experiments.py"), "--tasks=mqar_small", "--mixers=kla", "--seeds=1",
           "--jobs=1", f"--root={root}", f"--results_dir={res}", f"--data_dir={data}", "--n_train=100",
           "--eval_args=--max_examples=8 --device=cpu", "--train_args=" + " ".join(train)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    ckpt, t0 = root / "mqar_small-kla-1" / "ckpt.pt", time.time()
    while not ckpt.exists() and p.poll() is None and time.time() - t0 < 240:
        time.sleep(0.5)
    assert ckpt.exists(), p.communicate()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert f"SIGTERM: stopped {root / 'mqar_small-kla-1'}" in out and "evaluated 1 runs" in out, out
    assert (root / "mqar_small-kla-1" / "eval.json").exists()
    rows = list(csv.DictReader(open(res / "mqar_small.csv")))
    assert [(r["mixer"], r["seed"]) for r in rows] == [("kla", "1")] and int(rows[0]["best_iter"]) >= 3


@pytest.fixture(scope="module")
def tiny_recall(tmp_path_factory):
    root = tmp_path_factory.mktemp("recall")
    prepare_data.prepare_synthetic(str(root / "tinyrecall"), n_pairs=4, train_length=32, test_lengths=(32, 64),
                                   n_train=400, n_val=64, n_test=40, vocab=64)
    return str(root)


@pytest.mark.slow
def test_train_and_evaluate_recall(tiny_recall, tmp_path):
    """train.py on whole examples with their labels, early stopping, then evaluate.py's accuracies."""
    p = run("train.py", *TINY, f"--data_dir={tiny_recall}", "--dataset=tinyrecall", "--block_size=32",
            f"--out_dir={tmp_path}", "--max_iters=40", "--eval_interval=5", "--learning_rate=0.0", "--decay_lr=False", "--patience=2",
            "--always_save_checkpoint=True")
    assert p.returncode == 0, p.stderr
    assert "no better val loss in 2 evaluations: stopping at iteration 15" in p.stdout  # lr 0: never better than 5
    p = run("evaluate.py", f"--out_dir={tmp_path}", "--device=cpu", "--dtype=float32", "--batch_size=16")
    assert p.returncode == 0, p.stderr
    res = json.loads((tmp_path / "eval.json").read_text())
    labels = {L: np.fromfile(os.path.join(tiny_recall, "tinyrecall", f"test_{L}_labels.bin"), dtype=np.int16)
              for L in (32, 64)}
    assert [r["length"] for r in res["results"]] == [32, 64]
    for r in res["results"]:
        assert r["queries"] == (labels[r["length"]] != -1).sum() and 0 <= r["accuracy"] <= 1
    assert "| 64 | 2 |" in p.stdout
    p = run("train.py", *TINY, f"--data_dir={tiny_recall}", "--dataset=tinyrecall", f"--out_dir={tmp_path / 'other'}")
    assert_clean_error(p, "examples of 32 tokens: set --block_size=32")


def test_evaluate_language_model_beyond_the_context(trained):
    p = run("evaluate.py", f"--out_dir={trained}", "--device=cpu", "--dtype=float32", "--factors=1,2,4",
            "--eval_batches=2", "--batch_size=4")
    assert p.returncode == 0, p.stderr
    res = json.loads(open(os.path.join(trained, "eval.json")).read())
    assert [r["length"] for r in res["results"]] == [16, 32, 64]
    assert all(0 < r["test_loss"] < 10 and 0 < r["val_loss"] < 10 for r in res["results"])


@pytest.mark.slow
def test_evaluate_settings_are_checked_before_any_work(tmp_path):
    cases = [("--factors=0", "factors = '0': must be integers >= 1 separated by commas"), ("--factors=abc", "factors = 'abc'"),
             ("--factors=1,,2", "factors = '1,,2'"), ("--eval_batches=0", "eval_batches = 0: must be >= 1"),
             ("--batch_size=0", "batch_size = 0"), ("--max_examples=-1", "max_examples = -1"), ("--seed=-1", "seed = -1")]
    assert_each_is_one_line("evaluate.py", cases, f"--out_dir={tmp_path}", "--device=cpu")  # no checkpoint there


@pytest.mark.slow
def test_train_and_evaluate_on_documents(tiny_documents, tmp_path):
    """--documents=True trains each mixer on the batch as one packed row of documents (finite losses; the
    first evaluation, of the same initial weights, differs from documents=False's), and evaluate.py reads
    windows of 1x and 2x the context as documents."""
    args = [*TINY, f"--data_dir={tiny_documents}", "--dataset=docs", "--max_iters=3", "--eval_interval=3",
            "--always_save_checkpoint=True"]
    runs = {f"{mixer}-{documents}": [*args, f"--mixer={mixer}", f"--documents={documents}", f"--out_dir={tmp_path / mixer}-{documents}"]
            for mixer, documents in [("kla", True), ("gdn", True), ("attn", True), ("kla", False)]}
    for code, err in run_each("train.py", list(runs.values())):
        assert code == 0, err
    logs = {name: train_log(str(tmp_path / name)) for name in runs}
    assert all(math.isfinite(r.get("loss", r.get("val_loss"))) for log in logs.values() for r in log if "end" not in r)
    assert logs["kla-True"][0]["val_loss"] != logs["kla-False"][0]["val_loss"]
    cases = [[f"--out_dir={tmp_path / name}", "--device=cpu", "--dtype=float32", "--documents=True", "--factors=1,2",
              "--eval_batches=1", "--batch_size=2"] for name in ("kla-True", "attn-True")]
    for code, err in run_each("evaluate.py", cases):
        assert code == 0, err
    for name in ("kla-True", "attn-True"):
        res = json.loads((tmp_path / name / "eval.json").read_text())
        assert res["documents"] and [r["length"] for r in res["results"]] == [16, 32]
        assert all(0 < r["test_loss"] < 10 and r["tokens"] < 2 * r["length"] for r in res["results"])
    # padded=True: each test document alone in a window, padded with end-of-text tokens to the length
    p = run("evaluate.py", f"--out_dir={tmp_path / 'kla-False'}", "--device=cpu", "--dtype=float32", "--padded=True",
            "--factors=1,2", "--eval_batches=1", "--batch_size=3")
    assert p.returncode == 0, p.stderr
    test = np.fromfile(os.path.join(tiny_documents, "docs", "test.bin"), dtype=np.uint16)
    lengths = np.diff(np.concatenate([[-1], np.flatnonzero(test == 63)]))  # each document's tokens + its end
    for r in json.loads((tmp_path / "kla-False" / "eval.json").read_text())["results"]:
        own = np.minimum(lengths - 1, r["length"])  # the targets of a document within its window
        assert r["documents"] == len(lengths)
        assert r["padding_share"] == pytest.approx(1 - own.sum() / (len(lengths) * r["length"]), abs=1e-6)
        assert 0 < r["document_loss"] < 10 and 0 < r["padded_loss"] < 10 and r["padded_loss"] != r["document_loss"]


@pytest.mark.slow
def test_documents_need_an_end_of_text_token(tiny_data, trained, tmp_path):
    """documents=True on data without an end-of-text token (shakespeare_char): one line, before any training."""
    assert_each_is_one_line("train.py", [("--documents=True", "names none: prepare the data again")], *TINY,
                            f"--data_dir={tiny_data}", f"--out_dir={tmp_path}")
    assert not os.path.exists(tmp_path / "ckpt.pt") and not os.path.exists(tmp_path / "log.jsonl")
    assert_each_is_one_line("evaluate.py", [("--documents=True", "names none: prepare the data again"),
                                            ("--padded=True", "names none: prepare the data again")],
                            f"--out_dir={trained}", "--device=cpu")


NO_INTERPRETER = "import os, runpy, sys; os.environ.pop('TRITON_INTERPRET', None); sys.argv = sys.argv[1:]; " \
                 "runpy.run_path(sys.argv[0], run_name='__main__')"


@pytest.mark.slow
def test_sample_and_evaluate_a_model_trained_on_the_kernel(trained, tmp_path):
    """A checkpoint trained with --backend=triton samples and evaluates on a machine without a GPU (and
    without Triton's interpreter): the backend is how the mixer is computed, chosen for the device at hand."""
    ckpt = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    ckpt["model_args"]["backend"] = "triton"
    torch.save(ckpt, tmp_path / "ckpt.pt")
    p = run("-c", NO_INTERPRETER, os.path.join(ROOT, "sample.py"), f"--out_dir={tmp_path}", "--device=cpu",
            "--num_samples=1", "--max_new_tokens=5")
    assert p.returncode == 0, p.stderr
    p = run("-c", NO_INTERPRETER, os.path.join(ROOT, "evaluate.py"), f"--out_dir={tmp_path}", "--device=cpu",
            "--factors=1,2", "--eval_batches=1", "--batch_size=2")
    assert p.returncode == 0, p.stderr


@pytest.mark.slow
def test_experiments_step_rule_ablation(tmp_path):
    """--step_rules: a run per rule of the one mixer, named <task>-<rule>-<seed>, with its train.py flags
    ('deltanet': the rule 'unit' without the decay); the collected table carries each run's rule."""
    code = ("import json, sys; sys.argv = ['experiments.py', '--tasks=mqar_small', '--mixers=kla', "
            "'--step_rules=raw,deltanet', '--seeds=1,2', '--root=R']; import experiments; "
            "print(json.dumps(list(experiments.runs())))")
    p = run("-c", code)
    assert p.returncode == 0, p.stderr
    raw, deltanet = ["--mixer=kla", "--step_rule=raw"], ["--mixer=kla", "--step_rule=unit", "--decay=False"]
    assert json.loads(p.stdout.splitlines()[-1]) == [
        ["mqar_small", raw, 1, "R/mqar_small-raw-1"], ["mqar_small", raw, 2, "R/mqar_small-raw-2"],
        ["mqar_small", deltanet, 1, "R/mqar_small-deltanet-1"], ["mqar_small", deltanet, 2, "R/mqar_small-deltanet-2"]]
    for args, phrase in ((["--mixers=kla,gdn", "--step_rules=raw"], "mixers = 'kla,gdn': must be one mixer"),
                         (["--mixers=kla", "--step_rules=sgd"], "step_rules = 'sgd': must be step rules")):
        p = run("-c", f"import sys; sys.argv = ['experiments.py', *{args!r}]; import experiments; list(experiments.runs())")
        assert p.returncode != 0 and phrase in p.stderr, p.stderr
    root = tmp_path / "exp"
    for name, acc in (("mqar_small-kla-1", 0.5), ("mqar_small-raw-1", 0.25), ("mqar_small-deltanet-1", 0.75)):
        (root / name).mkdir(parents=True)
        (root / name / "eval.json").write_text(json.dumps(
            {"mixer": "kla", "seed": 1, "iter_num": 4, "results": [{"length": 128, "accuracy": acc}]}))
        (root / name / "log.jsonl").write_text(json.dumps({"iter": 4, "val_loss": 1.0}) + "\n" + ENDED.format(4))
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={tmp_path / 'res'}")
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(open(tmp_path / "res" / "mqar_small.csv")))
    assert [(r["mixer"], r["step_rule"], r["accuracy@128"]) for r in rows] == [
        ("kla", "", "0.5000"), ("kla", "deltanet", "0.7500"), ("kla", "raw", "0.2500")]
    assert all(row in p.stdout for row in ("| kla | 1 | 50.00 |", "| raw | 1 | 25.00 |", "| deltanet | 1 | 75.00 |"))


# -----------------------------------------------------------------------------
# test split, stack and palindrome


@pytest.mark.slow
def test_evaluate_reports_test_beside_val(tiny_data, trained, tmp_path):
    """evaluate.py's language-model numbers: test_loss read from test.bin, val_loss from val.bin, both printed."""
    data = tmp_path / "shakespeare_char"
    shutil.copytree(os.path.join(tiny_data, "shakespeare_char"), data)
    args = [f"--out_dir={trained}", "--device=cpu", "--dtype=float32", "--factors=1,2", "--eval_batches=2",
            "--batch_size=4", f"--data_dir={tmp_path}"]
    p = run("evaluate.py", *args)
    assert p.returncode == 0, p.stderr
    assert "| length | x train | test loss | val loss |" in p.stdout
    before = json.loads(open(os.path.join(trained, "eval.json")).read())["results"]
    test = np.fromfile(data / "test.bin", dtype=np.uint16)
    np.zeros_like(test).tofile(data / "test.bin")  # another test split, the same size
    p = run("evaluate.py", *args)
    assert p.returncode == 0, p.stderr
    after = json.loads(open(os.path.join(trained, "eval.json")).read())["results"]
    assert [r["val_loss"] for r in after] == [r["val_loss"] for r in before]
    assert all(a["test_loss"] != b["test_loss"] for a, b in zip(after, before))
    assert all(f"| {r['test_loss']:.4f} | {r['val_loss']:.4f} |" in p.stdout for r in after)


@pytest.mark.slow
def test_data_without_a_test_split_is_refused(tiny_data, trained, tmp_path):
    """Data prepared without a test split, a model trained on such data, and data split otherwise than the model's:
    one line each, before any work, saying what to do."""
    old = tmp_path / "old" / "shakespeare_char"
    shutil.copytree(os.path.join(tiny_data, "shakespeare_char"), old)
    (old / "test.bin").unlink()
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if not k.startswith("test_")}))
    other = tmp_path / "other" / "shakespeare_char"
    shutil.copytree(os.path.join(tiny_data, "shakespeare_char"), other)
    (other / "meta.json").write_text(json.dumps(dict(meta, train_tokens=meta["train_tokens"] + 1)))
    ckpt = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    ckpt["meta"] = {k: v for k, v in ckpt["meta"].items() if not k.startswith("test_")}
    (tmp_path / "out").mkdir()
    torch.save(ckpt, tmp_path / "out" / "ckpt.pt")
    cases = [([f"--out_dir={trained}", f"--data_dir={tmp_path / 'old'}"], "has no test split (test.bin): prepare it"),
             ([f"--out_dir={tmp_path / 'out'}"], "was trained on data without a test split"),
             ([f"--out_dir={trained}", f"--data_dir={tmp_path / 'other'}"], "is not split as the data")]
    for (args, phrase), (code, err) in zip(cases, run_each("evaluate.py", [a + ["--device=cpu"] for a, _ in cases])):
        assert code != 0 and "Traceback" not in err and phrase in err and len(err.splitlines()) == 1, (args, err)
    assert_each_is_one_line("train.py", [(f"--data_dir={tmp_path / 'old'}", "has no test split (test.bin)")], *TINY,
                            f"--out_dir={tmp_path / 'new'}")
    assert not os.path.exists(tmp_path / "new" / "log.jsonl")


@pytest.mark.slow
def test_train_and_evaluate_stack_and_palindrome(tmp_path):
    """prepare_data.py -> train.py (the small configs, a tiny model, 4 iterations) -> evaluate.py for both tasks:
    accuracy at each test length over exactly the scored positions of the examples read."""
    for task in ("stack_small", "palindrome_small"):
        p = run("prepare_data.py", f"--dataset={task}", f"--data_dir={tmp_path}", "--n_train=64")
        assert p.returncode == 0, p.stderr
    tiny = ["--n_embd=32", "--n_head=2", "--mlp_hidden=64", "--batch_size=4", "--max_iters=4", "--eval_interval=2",
            "--eval_iters=2", "--log_interval=1", "--device=cpu", "--dtype=float32", "--always_save_checkpoint=True"]
    cases = [[f"config/{task}.py", f"--data_dir={tmp_path}", f"--out_dir={tmp_path / ('out-' + task)}", *tiny]
             for task in ("stack_small", "palindrome_small")]
    for code, err in run_each("train.py", cases):
        assert code == 0, err
    cases = [[f"--out_dir={tmp_path / ('out-' + task)}", "--device=cpu", "--dtype=float32", "--max_examples=6",
              "--batch_size=4"] for task in ("stack_small", "palindrome_small")]
    for code, err in run_each("evaluate.py", cases):
        assert code == 0, err
    for task in ("stack_small", "palindrome_small"):
        assert [r["val_loss"] for r in train_log(str(tmp_path / ("out-" + task))) if "val_loss" in r][-1] < 10
        res = json.loads((tmp_path / ("out-" + task) / "eval.json").read_text())
        lengths = list(prepare_data.SYNTHETIC[task]["test_lengths"])
        assert res["dataset"] == task and [r["length"] for r in res["results"]] == lengths
        for r in res["results"]:
            labels = np.fromfile(tmp_path / task / f"test_{r['length']}_labels.bin", dtype=np.int16)
            assert r["examples"] == 6 and r["queries"] == (labels[:6 * r["length"]] != -1).sum() > 0
            assert 0 <= r["accuracy"] <= 1


@pytest.mark.slow
def test_experiments_collects_the_test_loss(tmp_path):
    """experiments.py's lm table reports test_loss@<length> and keeps val_loss@<length> beside it; a run
    evaluated without a test split (no test_loss) is left out, saying so. The table of a task without runs under
    --root is left as it was."""
    root = tmp_path / "exp"
    (tmp_path / "res").mkdir()
    other = "mixer,seed,accuracy@256\nkla,1,0.5000\n"  # an older table, without the step_rule column
    (tmp_path / "res" / "mqar.csv").write_text(other)
    for name, results in (("lm-kla-1", [{"length": 512, "test_loss": 1.5, "val_loss": 1.6, "tokens": 9}]),
                          ("lm-gdn-1", [{"length": 512, "loss": 1.7, "tokens": 9}])):
        (root / name).mkdir(parents=True)
        (root / name / "eval.json").write_text(json.dumps({"mixer": name.split("-")[1], "seed": 1, "iter_num": 4,
                                                          "results": results}))
        (root / name / "log.jsonl").write_text(json.dumps({"iter": 4, "val_loss": 1.6}) + "\n" + ENDED.format(4))
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={tmp_path / 'res'}")
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(open(tmp_path / "res" / "lm.csv")))
    assert [(r["mixer"], r["test_loss@512"], r["val_loss@512"]) for r in rows] == [("kla", "1.5000", "1.6000")]
    assert "skipped lm-gdn-1: its eval.json has no test_loss" in p.stdout and "| kla | 1 | 1.50 |" in p.stdout
    assert (tmp_path / "res" / "mqar.csv").read_text() == other and "mqar:" not in p.stdout


ENDED = '{{"iter": {}, "end": "max_iters", "patience": 0}}\n'  # the last record of a run train.py ended


def fake_run(run_dir, accuracy, iters=2, ended=True):
    """A run folder as experiments.py leaves it once evaluated (eval.json, log.jsonl), without training; ended=False:
    its log as while it trains (no end record). Its seed is the last digit of its name."""
    run_dir.mkdir(parents=True)
    (run_dir / "eval.json").write_text(json.dumps({"mixer": "kla", "seed": int(run_dir.name[-1]), "iter_num": iters,
                                                   "results": [{"length": 128, "accuracy": accuracy}]}))
    (run_dir / "log.jsonl").write_text(json.dumps({"iter": iters, "val_loss": 1.0}) + "\n" + ENDED.format(iters) * ended)


@pytest.mark.slow
def test_experiments_keeps_the_rows_of_other_runs(tmp_path):
    """A results table's row is never replaced by another run's silently (a run under another --root, with other
    settings): the call stops before any work, naming the row, and the table is left as it was; the same run
    collected again, another --results_dir, or --overwrite=True go on."""
    res, root = tmp_path / "res", tmp_path / "exp"
    res.mkdir()
    committed = "mixer,step_rule,seed,best_iter,last_iter,best_val_loss,tok_s,accuracy@128\nkla,,1,3000,3000,0.3000,,0.9000\n"
    (res / "mqar_small.csv").write_text(committed)
    fake_run(root / "mqar_small-kla-1", 0.5)
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={res}")
    assert_clean_error(p, f"{res / 'mqar_small.csv'} already holds kla seed 1, from another run than "
                          f"{root / 'mqar_small-kla-1'}", "--overwrite=True")
    assert (res / "mqar_small.csv").read_text() == committed and len(p.stderr.splitlines()) == 1
    # a run about to be trained for a row the table holds: refused before the data is prepared or the run started
    new, data = tmp_path / "new", tmp_path / "data"
    p = run("experiments.py", "--tasks=mqar_small", "--mixers=kla", "--seeds=1", f"--root={new}", f"--data_dir={data}",
            f"--results_dir={res}", "--train_args=--max_iters=2")
    assert_clean_error(p, f"already holds kla seed 1, from another run than {new / 'mqar_small-kla-1'}")
    assert not new.exists() and not data.exists() and (res / "mqar_small.csv").read_text() == committed
    for _ in range(2):  # into another table; then the same run again: the same row, no replacement
        p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={tmp_path / 'other'}")
        assert p.returncode == 0, p.stderr
    assert [r["accuracy@128"] for r in csv.DictReader(open(tmp_path / "other" / "mqar_small.csv"))] == ["0.5000"]
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={res}", "--overwrite=True")
    assert p.returncode == 0, p.stderr
    assert [(r["seed"], r["accuracy@128"]) for r in csv.DictReader(open(res / "mqar_small.csv"))] == [("1", "0.5000")]


@pytest.mark.slow
def test_experiments_reports_a_failed_run_and_evaluates_an_unreadable_eval_again(tmp_path):
    """A run whose train.py fails (here a resume refused: its checkpoint is of another n_layer) is reported with its
    error line, neither evaluated nor collected, and experiments.py exits non-zero. A run whose eval.json cannot be
    read (a write cut short by a full disk) is not done: evaluated again, and skipped by --collect, saying so."""
    data, root, res = tmp_path / "data", tmp_path / "exp", tmp_path / "res"
    prepare_data.prepare("mqar_small", str(data), n_train=100)
    small = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--mlp_hidden=64", "--batch_size=4", "--eval_interval=2",
             "--eval_iters=1", "--device=cpu", "--dtype=float32", "--compile=False", "--max_iters=2"]
    ended, other = root / "mqar_small-kla-1", root / "mqar_small-kla-2"
    p = run("train.py", "config/mqar_small.py", "--mixer=kla", "--seed=1", f"--out_dir={ended}", f"--data_dir={data}",
            "--sample_tokens=0", *small)
    assert p.returncode == 0, p.stderr
    (ended / "eval.json").write_text("")  # what an evaluate.py that wrote it in place left on a full disk
    other.mkdir()
    ckpt = torch.load(ended / "ckpt.pt", weights_only=True)
    ckpt["model_args"]["n_layer"] = 2  # a run begun with --n_layer=2, stopped before its evaluation
    torch.save(ckpt, other / "ckpt.pt")
    p = run("experiments.py", "--tasks=mqar_small", "--mixers=kla", "--seeds=1,2", "--jobs=2", f"--root={root}",
            f"--results_dir={res}", f"--data_dir={data}", "--eval_args=--max_examples=4 --device=cpu",
            "--train_args=" + " ".join(small))
    assert_clean_error(p, f"error: 1 run(s) failed: {other} (their error above")
    assert f"{ended}: its eval.json is unreadable (JSONDecodeError" in p.stdout, p.stdout
    assert f"failed {other} (exit 1)\n    error: {other / 'ckpt.pt'} is a checkpoint of another model" in p.stdout
    assert "nothing left to train" in p.stdout and "evaluated 1 runs" in p.stdout, p.stdout
    assert json.loads((ended / "eval.json").read_text())["iter_num"] == 2
    assert not (other / "eval.txt").exists() and not (other / "eval.json").exists()
    assert [(r["seed"], r["best_iter"]) for r in csv.DictReader(open(res / "mqar_small.csv"))] == [("1", "2")]
    (root / "mqar_small-kla-3").mkdir()
    (root / "mqar_small-kla-3" / "eval.json").write_text('{"mixer": "kla", "se')
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={res}")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "skipped mqar_small-kla-3: its eval.json is unreadable (JSONDecodeError" in p.stdout, p.stdout


@pytest.mark.slow
@pytest.mark.parametrize("arg,phrase", [("--tasks=foo", "tasks = 'foo': must be tasks separated by commas, from mqar"),
                                        ("--seeds=a", "seeds = 'a': must be integers >= 0"),
                                        ("--seeds=-1", "seeds = '-1'"),
                                        ("--step_rules=foo", "step_rules = 'foo': must be step rules"),
                                        ("--jobs=0", "jobs = 0: must be >= 1"),
                                        ("--deadline=-1", "deadline = -1: must be >= 0"),
                                        ("--mixers=foo", "mixers = 'foo': must be mixers separated by commas"),
                                        ("--gpus=x", "gpus = 'x'"), ("--n_train=-1", "n_train = -1"),
                                        ("--results_dir=/proc/x/y", "results_dir = '/proc/x/y': must be a folder "
                                                                    "that can be made and written (cannot make a folder in /proc"),
                                        ("--collect=True", "must be an existing folder of runs with --collect=True")])
def test_experiments_settings_are_checked_before_any_work(tmp_path, arg, phrase):
    root, data = tmp_path / "exp", tmp_path / "data"
    p = run("experiments.py", "--tasks=mqar_small", f"--root={root}", f"--data_dir={data}",
            f"--results_dir={tmp_path / 'res'}", arg, timeout=30)
    assert_clean_error(p, phrase)
    assert len(p.stderr.splitlines()) == 1 and not root.exists() and not data.exists() and not (tmp_path / "res").exists()


@pytest.mark.slow
def test_experiments_checks_the_flags_of_its_runs_before_any_work(tmp_path):
    """--train_args and --eval_args that train.py or evaluate.py refuse (a typo, a value out of range), flags there that
    experiments.py sets for each run, and a task, mixer or seed given twice (two train.py into one folder): one line
    before any data is prepared or run started, not a failure of every run after the data (or after all the
    training, for --eval_args)."""
    root, data, res = tmp_path / "exp", tmp_path / "data", tmp_path / "res"
    cases = [("--train_args=--max_iter=2", "train_args = '--max_iter=2': must be flags that train.py takes after "
                                           "config/mqar_small.py --mixer=kla (it says: unknown config key 'max_iter'"),
             ("--train_args=--max_iters=0", "(it says: max_iters = 0: must be >= 1)"),
             ("--eval_args=--max_example=4", "eval_args = '--max_example=4': must be flags that evaluate.py takes (it "
                                             "says: unknown config key 'max_example'"),
             ("--train_args=--seed=3", "train_args = '--seed=3': must be other flags than --out_dir, --seed, --mixer"),
             ("--eval_args=--out_dir=x", "eval_args = '--out_dir=x': must be other flags than --out_dir, which "
                                         "experiments.py sets for each run"),
             ("--seeds=1,01", "seeds = '1,01': must be given once each (01 and 1 are one seed)"),
             ("--mixers=kla,kla", "mixers = 'kla,kla': must be given once each"),
             ("--seeds=1,\u00b2", "seeds = '1,\u00b2': must be integers >= 0")]
    results = run_each("experiments.py", [["--tasks=mqar_small", "--mixers=kla", f"--root={root}", f"--data_dir={data}",
                                           f"--results_dir={res}", arg] for arg, _ in cases])
    for (arg, phrase), (code, err) in zip(cases, results, strict=True):
        assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1 and phrase in err, (arg, err)
    assert not root.exists() and not data.exists() and not res.exists()


@pytest.mark.slow
def test_experiments_writes_its_tables_atomically(tmp_path):
    """A results table is written whole to a temporary file renamed over the old one: a full disk (the temporary
    file sent to /dev/full) is one line, and the old table and no temporary file are left. write_file writes text
    and bytes as given."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    res, root = tmp_path / "res", tmp_path / "exp"
    res.mkdir()
    old = "mixer,step_rule,seed,accuracy@128\r\nkla,,2,0.9000\r\n"
    (res / "mqar_small.csv").write_bytes(old.encode())
    (res / "mqar_small.csv.tmp").symlink_to("/dev/full")
    fake_run(root / "mqar_small-kla-1", 0.5)
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={res}")
    assert_clean_error(p, f"error: cannot write {res / 'mqar_small.csv'}: No space left on device; the table there")
    assert len(p.stderr.splitlines()) == 1 and (res / "mqar_small.csv").read_bytes() == old.encode()
    assert not os.path.lexists(res / "mqar_small.csv.tmp")
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={res}")
    assert p.returncode == 0, p.stderr
    assert [r["seed"] for r in csv.DictReader(open(res / "mqar_small.csv"))] == ["1", "2"]
    for data in ("a\r\nb\n", b"\x00\x01\n"):
        prepare_data.write_file(str(tmp_path / "f"), data)
        assert (tmp_path / "f").read_bytes() == (data.encode() if isinstance(data, str) else data)


@pytest.mark.slow
def test_experiments_touches_only_the_tables_of_its_tasks(tmp_path):
    """Collection, its clash check and --overwrite=True cover the tasks of --tasks alone (by default with
    --collect=True: every task run under --root); --collect=True with no done run of them is an error."""
    res, root = tmp_path / "res", tmp_path / "exp"
    res.mkdir()
    committed = "mixer,step_rule,seed,best_iter,last_iter,best_val_loss,tok_s,accuracy@128\nkla,,1,3000,3000,0.3000,,0.9000\n"
    (res / "mqar_small.csv").write_text(committed)
    fake_run(root / "mqar_small-kla-1", 0.5)  # another run than the table's row
    fake_run(root / "stack_small-kla-1", 0.25)
    for extra in ([], ["--overwrite=True"]):
        p = run("experiments.py", "--collect=True", "--tasks=stack_small", f"--root={root}", f"--results_dir={res}", *extra)
        assert p.returncode == 0, p.stderr
        assert (res / "mqar_small.csv").read_text() == committed and "mqar_small:" not in p.stdout
        assert [r["accuracy@128"] for r in csv.DictReader(open(res / "stack_small.csv"))] == ["0.2500"]
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={res}")  # every task under --root
    assert_clean_error(p, f"{res / 'mqar_small.csv'} already holds kla seed 1")
    p = run("experiments.py", "--collect=True", "--tasks=lm", f"--root={root}", f"--results_dir={res}")
    assert_clean_error(p, f"error: no done run of lm under {root}: nothing to collect")
    (tmp_path / "empty").mkdir()
    p = run("experiments.py", "--collect=True", f"--root={tmp_path / 'empty'}", f"--results_dir={res}")
    assert_clean_error(p, f"error: no run under {tmp_path / 'empty'} (folders <task>-<mixer or rule>-<seed>")


@pytest.mark.slow
def test_experiments_resumes_a_run_evaluated_before_it_ended(tmp_path):
    """A run is done only if its log ends with an end record and its eval.json is of its checkpoint's iteration:
    one evaluated while it trained (evaluate.py by hand mid-run) or from an earlier checkpoint is resumed and not
    collected. A run stopped here at the deadline ends its log with an end record of its own (after a line cut
    short by the kill too), and is done once evaluated."""
    root = tmp_path / "exp"
    fake_run(root / "mqar_small-kla-1", 0.5, iters=880, ended=False)  # training went on after its evaluation
    fake_run(root / "mqar_small-kla-2", 0.5, iters=2)
    torch.save({"iter_num": 4}, root / "mqar_small-kla-2" / "ckpt.pt")  # a better checkpoint after the evaluation
    fake_run(root / "mqar_small-kla-3", 0.75, iters=4)
    torch.save({"iter_num": 4}, root / "mqar_small-kla-3" / "ckpt.pt")
    fake_run(root / "mqar_small-kla-4", 0.25, iters=4, ended=False)
    with open(root / "mqar_small-kla-4" / "log.jsonl", "a") as f:
        f.write('{"iter": 6, "lo')  # cut short by the kill
    code = ("import json, sys; sys.argv = ['experiments.py', '--tasks=mqar_small', '--mixers=kla', '--seeds=1,2,3,4', "
            f"'--root={root}']; import experiments; experiments.record_stop({str(root / 'mqar_small-kla-4')!r}, 'deadline'); "
            "print(json.dumps([r[3] for r in experiments.not_done()]))")
    p = run("-c", code)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[-1]) == [str(root / "mqar_small-kla-1"), str(root / "mqar_small-kla-2")]
    assert (f"{root / 'mqar_small-kla-1'}: its eval.json (of iteration 880) was written before the run ended (its "
            "log.jsonl has no end record and reaches iteration 880); the run is not done: it is resumed") in p.stdout
    assert f"{root / 'mqar_small-kla-2'}: its eval.json is of iteration 2, its ckpt.pt of iteration 4" in p.stdout
    assert (root / "mqar_small-kla-4" / "log.jsonl").read_text().endswith('{"iter": 6, "lo\n{"iter": 4, "end": "deadline"}\n')
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={tmp_path / 'res'}")
    assert p.returncode == 0, p.stderr
    assert "skipped mqar_small-kla-1: its eval.json (of iteration 880) was written before the run ended" in p.stdout
    assert "skipped mqar_small-kla-2: its eval.json is of iteration 2, its ckpt.pt of iteration 4" in p.stdout
    rows = list(csv.DictReader(open(tmp_path / "res" / "mqar_small.csv")))
    assert [(r["seed"], r["accuracy@128"]) for r in rows] == [("3", "0.7500"), ("4", "0.2500")]


@pytest.mark.slow
def test_experiments_ctrl_c_stops_its_runs_with_one_line(tmp_path):
    """Ctrl-C (SIGINT) to experiments.py while a run trains: its train.py is stopped, one line saying the runs can
    be resumed by running it again, exit status 130, no traceback."""
    data, root = tmp_path / "data", tmp_path / "exp"
    prepare_data.prepare("mqar_small", str(data), n_train=100)
    train = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--mlp_hidden=64", "--batch_size=4", "--device=cpu",
             "--dtype=float32", "--compile=False", "--max_iters=100000"]
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "experiments.py"), "--tasks=mqar_small", "--mixers=kla",
                          "--seeds=1", "--jobs=1", f"--root={root}", f"--results_dir={tmp_path / 'res'}",
                          f"--data_dir={data}", "--train_args=" + " ".join(train)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    for line in p.stdout:
        if "started" in line:
            break
    time.sleep(1)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err, err
    assert err == f"interrupted; the runs under {root} are stopped, their checkpoints kept: run the same command " \
                  "again to resume them\n", err
    run_dir = str(root / "mqar_small-kla-1")
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            alive += [pid] if run_dir in open(f"/proc/{pid}/cmdline").read() else []
        except OSError:
            pass
    assert not alive


@pytest.mark.slow
def test_evaluate_writes_eval_json_atomically(trained, tmp_path):
    """A full disk while evaluate.py writes eval.json (its temporary file sent to /dev/full): one line, and no
    eval.json cut short: the old one as it was, or none; no temporary file left."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    cases = []
    for name, old in (("old", "the old eval.json"), ("none", None)):
        out = tmp_path / name
        out.mkdir()
        shutil.copy(os.path.join(trained, "ckpt.pt"), out / "ckpt.pt")
        if old:
            (out / "eval.json").write_text(old)
        (out / "eval.json.tmp").symlink_to("/dev/full")
        cases.append([f"--out_dir={out}", "--device=cpu", "--dtype=float32", "--factors=1", "--eval_batches=1",
                      "--batch_size=2"])
    for (code, err), name in zip(run_each("evaluate.py", cases), ("old", "none"), strict=True):
        assert code != 0 and "Traceback" not in err and len(err.splitlines()) == 1, err
        assert f"cannot write {tmp_path / name / 'eval.json'}: No space left on device" in err, err
        assert not os.path.lexists(tmp_path / name / "eval.json.tmp")
    assert (tmp_path / "old" / "eval.json").read_text() == "the old eval.json"
    assert not (tmp_path / "none" / "eval.json").exists()


@pytest.mark.slow
def test_evaluate_checks_every_window_before_any_evaluation(trained):
    """A factor too large for a split is refused before the first length is evaluated, naming the factors allowed."""
    p = run("evaluate.py", f"--out_dir={trained}", "--device=cpu", "--dtype=float32", "--factors=1,2,100000",
            "--eval_batches=1", "--batch_size=2")
    assert_clean_error(p, "factors = '1,2,100000': the test split holds", "too few for windows of 1600000 "
                          "(factor 100000 x block_size 16); the factors it allows are 1 to ")
    assert len(p.stderr.splitlines()) == 1 and "| length |" not in p.stdout


@pytest.mark.slow
def test_evaluate_checks_its_data_files_before_any_evaluation(tiny_recall, tiny_data, trained, tmp_path):
    """A test set or split that is empty, cut short (not a whole number of tokens or examples) or whose labels are
    those of fewer examples, of any length: one line naming the file before the first length is evaluated (not
    numpy's reshape error, or torch's, after the lengths before it)."""
    out, lm = tmp_path / "recall", tmp_path / "lm"
    p = run("train.py", *TINY, f"--data_dir={tiny_recall}", "--dataset=tinyrecall", "--block_size=32",
            f"--out_dir={out}", "--max_iters=1", "--eval_interval=1")
    assert p.returncode == 0, p.stderr
    lm.mkdir()
    shutil.copy(os.path.join(trained, "ckpt.pt"), lm / "ckpt.pt")
    damaged = {"cut": ("test_64.bin", lambda b: b[:-2]), "labels": ("test_64_labels.bin", lambda b: b[:len(b) // 2]),
               "empty": ("test.bin", lambda b: b""), "odd": ("val.bin", lambda b: b[:-1])}
    for name, (file, cut) in damaged.items():
        src = os.path.join(tiny_recall, "tinyrecall") if "64" in file else os.path.join(tiny_data, "shakespeare_char")
        dst = tmp_path / name / os.path.basename(src)
        shutil.copytree(src, dst)
        (dst / file).write_bytes(cut((dst / file).read_bytes()))
    cases = [([f"--out_dir={out}", f"--data_dir={tmp_path / 'cut'}"],
              "tinyrecall/test_64.bin holds 5118 bytes, not a whole number of examples of 64 uint16 values (128 bytes "
              "each): a damaged file; prepare the data again"),
             ([f"--out_dir={out}", f"--data_dir={tmp_path / 'labels'}"],
              "tinyrecall/test_64_labels.bin holds the labels of 20 examples, and test_64.bin 40 examples"),
             ([f"--out_dir={lm}", f"--data_dir={tmp_path / 'empty'}"], "shakespeare_char/test.bin is empty"),
             ([f"--out_dir={lm}", f"--data_dir={tmp_path / 'odd'}"],
              "shakespeare_char/val.bin holds 2435 bytes, not a whole number of uint16 tokens")]
    results = run_each("evaluate.py", [[*args, "--device=cpu", "--dtype=float32", "--factors=1", "--eval_batches=1"]
                                       for args, _ in cases])
    for (args, phrase), (code, err) in zip(cases, results, strict=True):
        assert code != 0 and "Traceback" not in err and len(err.splitlines()) == 1 and phrase in err, (args, err)
    assert not (out / "eval.json").exists() and not (lm / "eval.json").exists()
