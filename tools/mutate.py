"""
A mutation check of the test suite: each mutation below is one plausible bug (a file, its exact text, the text
that replaces it, the tests that should catch it). The repository is copied to a temporary folder; each
mutation is applied alone there, its tests run, and the mutation is killed (a test failed) or survived (all
passed). A mutation whose text is not found exactly once is refused before any test runs.
    python tools/mutate.py                      # all of them (about an hour on 2 CPU cores)
    python tools/mutate.py --only=rope_offset,lr_warmup_from_zero
    python tools/mutate.py --list
Prints one line per mutation and the score, killed / all; the results and the reasons for the survivors are in
docs/testing.md.
"""
import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NUMBERS = "tests/test_numbers.py"
SCHEDULE = f"{NUMBERS}::test_schedule_every_iteration_and_after_resume"
MUTATIONS = [  # (name, file, old text, new text, pytest arguments)
    # the references and the step rules
    ("beta_eps_twice", "model.py", "r2 = k.pow(2).sum(-1) + eps", "r2 = k.pow(2).sum(-1) + 2 * eps",
     "tests/ -k 'test_step_rule_beta_is_its_formula or test_recurrent_matches_literal_recurrence'"),
    ("beta_longhorn_without_eta", "model.py", "return eta / (1 + eta * k.pow(2).sum(-1))",
     "return eta / (1 + k.pow(2).sum(-1))", "tests/ -k test_step_rule_beta_is_its_formula"),
    ("recurrent_output_unscaled", "model.py", 'torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale)',
     'torch.einsum("bhkv,bhk->bhv", S, q[:, t])', "tests/ -k test_recurrent_matches_literal_recurrence"),
    ("recurrent_decay_first_order", "model.py", "S = S * g[:, t].exp()[..., None, None]",
     "S = S * (1 + g[:, t])[..., None, None]", "tests/ -k test_recurrent_matches_literal_recurrence"),
    ("chunkwise_exclusive_decay", "model.py", "decay_out = b.exp().to(dtype)",
     "decay_out = (b - g.double()).exp().to(dtype)",
     "tests/ -k 'test_chunkwise_matches_recurrent_float64 and 37-16'"),
    ("chunkwise_state_not_decayed", "model.py", "S = decay_out[:, :, n, -1, None, None] * S + ",
     "S = S + ", "tests/ -k 'test_chunkwise_matches_recurrent_float64 and 130-64'"),
    ("raw_rule_keys_normalised", "model.py", 'if self.rule == "unit":\n            k = F.normalize',
     'if self.rule in ("unit", "raw"):\n            k = F.normalize', "tests/ -k test_each_step_rule_trains"),
    # the kernel's Kaczmarz step (float32, in Triton's interpreter)
    ("kernel_beta_eps_twice", "kernel.py", "beta = eta\n    if KACZ:\n        d = r2 + eps",
     "beta = eta\n    if KACZ:\n        d = r2 + 2 * eps",
     "tests/ -k 'test_kernel_matches_float64 and 1-130-2-48-40'"),
    # train.py's learning-rate schedule
    ("lr_warmup_from_zero", "train.py", "return learning_rate * (it + 1) / (warmup_iters + 1)",
     "return learning_rate * it / warmup_iters", SCHEDULE),
    ("lr_warmup_one_ahead", "train.py", "return learning_rate * (it + 1) / (warmup_iters + 1)",
     "return learning_rate * (it + 2) / (warmup_iters + 1)", SCHEDULE),
    ("lr_cosine_from_zero", "train.py", "math.cos(math.pi * (it - warmup_iters) /",
     "math.cos(math.pi * it /", SCHEDULE),
    ("lr_floor_late", "train.py", "if it > lr_decay_iters:", "if it > lr_decay_iters + 1:", SCHEDULE),
    ("lr_restarts_at_resume", "train.py", "lr = get_lr(iter_num) if decay_lr",
     "lr = get_lr(iter_num - (resumed_at or 0)) if decay_lr", SCHEDULE),
    # checkpoint save
    ("checkpoint_fresh_optimizer", "train.py", '"optimizer": optimizer.state_dict(),',
     '"optimizer": model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type).state_dict(),',
     "tests/ -k test_resume_is_exact"),
    ("checkpoint_patience_reset", "train.py", '"evals_since_best": evals_since_best,', '"evals_since_best": 0,',
     "tests/ -k 'test_resume_keeps_patience_and_iteration_0_saves_nothing or test_resume_keeps_the_count'"),
    # evaluate.py's metrics
    ("eval_mean_of_batch_means", "evaluate.py", "total + (loss.item() * n if n else 0.0), count + n",
     "total + loss.item(), count + 1", f"{NUMBERS} -k test_evaluate_documents_and_padding"),
    ("eval_target_after_eot_counted", "evaluate.py", "Y[X == eot] = -1", "Y[X == -2] = -1",
     f"{NUMBERS} -k test_evaluate_documents_and_padding"),
    ("eval_padding_as_document", "evaluate.py", "real[i, :n - 1] = True", "real[i, :n] = True",
     f"{NUMBERS} -k test_evaluate_documents_and_padding"),
    ("eval_accuracy_inverted", "evaluate.py", "(logits.argmax(-1)[asked] == Y[asked])",
     "(logits.argmax(-1)[asked] != Y[asked])", f"{NUMBERS} -k test_evaluate_recall_accuracy"),
    ("eval_max_examples_one_more", "evaluate.py", "n = min(len(x), max_examples or len(x))",
     "n = min(len(x), max_examples + 1 if max_examples else len(x))", f"{NUMBERS} -k test_evaluate_recall_accuracy"),
    ("eval_window_one_short", "evaluate.py", "batch = np.stack([data[i:i + length + 1] for i in ix])",
     "batch = np.stack([data[i + 1:i + length + 2] for i in ix])", f"{NUMBERS} -k test_evaluate_losses_at_each_factor"),
    # the rotary embedding
    ("rope_interleaved_pairs", "model.py", "x1, x2 = x.float().chunk(2, -1)",
     "x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]", f"{NUMBERS} -k rope"),
    ("rope_positions_from_one", "model.py", "angles = pos.float()[:, None] * freqs",
     "angles = (pos.float()[:, None] + 1) * freqs", f"{NUMBERS} -k rope"),
    ("rope_frequency_exponent", "model.py", "dtype=torch.float32) / D)", "dtype=torch.float32) / (D - 2))",
     f"{NUMBERS} -k rope"),
    ("rope_sign", "model.py", "x1 * cos - x2 * sin", "x1 * cos + x2 * sin", f"{NUMBERS} -k rope"),
]


def copy_repo(dst):
    """The working tree without git's folder, data, runs' outputs and caches."""
    skip = shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "data", "out*", "results")
    shutil.copytree(ROOT, dst, ignore=skip, dirs_exist_ok=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--only", default="", help="names of the mutations to run, separated by commas")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds for one mutation's tests")
    args = parser.parse_args()
    names = [m[0] for m in MUTATIONS]
    chosen = [n for n in args.only.split(",") if n] or names
    unknown = [n for n in chosen if n not in names]
    if unknown:
        sys.exit(f"error: --only names {', '.join(unknown)}, which are not mutations (--list shows them)")
    if args.list:
        for name, path, *_, tests in MUTATIONS:
            print(f"{name:32s} {path:12s} {tests}")
        return
    todo = [m for m in MUTATIONS if m[0] in chosen]
    stale = [f"{name} ({path}: found {open(os.path.join(ROOT, path)).read().count(old)} times)"
             for name, path, old, *_ in todo if open(os.path.join(ROOT, path)).read().count(old) != 1]
    if stale:
        sys.exit(f"error: the text of each mutation must occur exactly once; not so for {', '.join(stale)}")
    killed = []
    with tempfile.TemporaryDirectory(prefix="kla-mutate-") as tmp:
        copy_repo(tmp)
        for name, path, old, new, tests in todo:
            target = os.path.join(tmp, path)
            original = open(target).read()
            with open(target, "w") as f:
                f.write(original.replace(old, new))
            t0 = time.time()
            try:
                p = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                    "-m", "slow or not slow", *shlex.split(tests)], cwd=tmp, capture_output=True, text=True,
                                   timeout=args.timeout)
                code = p.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            finally:
                with open(target, "w") as f:
                    f.write(original)
            if code in (0, 1, "timeout"):  # a timeout: the mutation made the tests hang, counted apart
                verdict = {0: "survived", 1: "killed"}.get(code, "timeout")
            else:  # 2-5: interrupted, pytest's own error, no tests collected: the mutation's tests are wrong
                sys.exit(f"error: {name}: pytest exited with {code} (no test ran?): {tests}\n{p.stdout[-2000:]}")
            killed += [name] if verdict == "killed" else []
            print(f"{verdict:8s} {name:32s} {time.time() - t0:6.0f} s  {path}", flush=True)
    print(f"score: {len(killed)} / {len(todo)} killed")


if __name__ == "__main__":
    main()
