"""
The same training run on one GPU and on N GPUs through torchrun: same model, same global batch,
same batches (train.py draws global micro-batch r * gradient_accumulation_steps + m on process r), so the
loss curves should agree up to floating-point noise and the tokens/s should scale with N.

$ python tools/ddp_compare.py --nproc=2 --out=ddp.md -- config/python_stdlib.py --n_layer=12 ...

Everything after "--" goes to train.py for both runs; --gradient_accumulation_steps there must be a multiple
of --nproc (the N-GPU run gives each process its share): checked first, as --nproc >= 1, before any run (a bad
flag is one `error: ...` line). A run that fails stops the comparison with its error line. Prints and writes a
markdown table: median ms / iteration and tokens/s over the iterations after --skip (compilation and warm-up), the
speed-up, and the loss of both runs at a few iterations with the largest difference between the two curves.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ap = argparse.ArgumentParser()
ap.add_argument("--nproc", type=int, default=2, help="GPUs of the second run")
ap.add_argument("--skip", type=int, default=20, help="iterations left out of the timing")
ap.add_argument("--root", default="out-ddp", help="the runs write <root>/gpu1 and <root>/gpu<N>")
ap.add_argument("--out", default="", help="also write the table to this file")
ap.add_argument("--timeout", type=float, default=0, help="seconds each run may take (0: no limit)")
ap.error = lambda msg: sys.exit(f"error: {msg}")  # one line, not argparse's usage and message
args, train_args = ap.parse_known_args()
train_args = [a for a in train_args if a != "--"]
args.root = os.path.abspath(args.root)  # train.py runs in the repository, this script anywhere


def accumulation_steps():
    """(train.py's gradient_accumulation_steps for train_args, where it comes from), as its configurator sets it:
    train.py's default, then each config file and --gradient_accumulation_steps in order; (None, '') where a value
    cannot be read here (train.py then reports it)."""
    with open(os.path.join(here, "train.py")) as f:
        steps = int(re.search(r"^gradient_accumulation_steps = (\d+)", f.read(), re.M).group(1))
    source = "train.py's default"
    for a in train_args:
        if a.startswith("--gradient_accumulation_steps="):
            steps, source = a.split("=", 1)[1], a
        elif not a.startswith("--"):  # a config file, read from the folder train.py runs in
            config = {"__file__": a}
            try:
                with open(os.path.join(here, a)) as f:
                    exec(f.read(), config)
            except Exception:
                return None, ""
            if "gradient_accumulation_steps" in config:
                steps, source = config["gradient_accumulation_steps"], a
    return (int(steps), source) if str(steps).isdigit() else (None, "")


if args.nproc < 1:
    sys.exit(f"error: --nproc={args.nproc}: must be >= 1 (the processes of the second run)")
if args.skip < 0:
    sys.exit(f"error: --skip={args.skip}: must be >= 0")
if args.timeout < 0:
    sys.exit(f"error: --timeout={args.timeout:g}: must be >= 0 seconds (0: no limit)")
steps, source = accumulation_steps()
if steps is not None and steps % args.nproc:
    sys.exit(f"error: gradient_accumulation_steps = {steps} ({source}): must be a multiple of --nproc={args.nproc}, "
             f"each process taking its share; pass e.g. --gradient_accumulation_steps={args.nproc * steps} after --")


def error_line(path):
    """The error line of a failed run's output: its last line that starts with 'error:' or 'config error:'
    (torchrun's traceback follows it), else its last line."""
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    errors = [line for line in lines if line.startswith(("error:", "config error:"))]
    return (errors or lines or ["(no output)"])[-1][:500]


def run(n):
    out_dir = os.path.join(args.root, f"gpu{n}")
    os.makedirs(out_dir, exist_ok=True)
    for name in ("log.jsonl", "ckpt.pt"):  # a fresh run, not a resumed one
        if os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "train.py",
           *train_args, f"--out_dir={out_dir}", "--log_interval=1", "--sample_tokens=0"]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    print(" ".join(cmd), flush=True)
    t0, log = time.time(), os.path.join(out_dir, "stdout.txt")
    with open(log, "w") as f:
        try:
            p = subprocess.run(cmd, cwd=here, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout or None)
        except subprocess.TimeoutExpired:
            sys.exit(f"error: the {n}-process run took longer than --timeout={args.timeout:g} s (its output: {log})")
    print(f"{n} process(es): exit {p.returncode} after {time.time() - t0:.0f} s", flush=True)
    if p.returncode:
        sys.exit(f"error: the {n}-process run failed (exit {p.returncode}): {error_line(log)} (its output: {log})")
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "log.jsonl"))]
    return {r["iter"]: r for r in rows if "loss" in r}


one, many = run(1), run(args.nproc)
timed = [i for i in one if i >= args.skip and i in many]
if not timed:
    sys.exit(f"no iteration past --skip={args.skip} in both runs")
ms1 = statistics.median(one[i]["ms"] for i in timed)
msn = statistics.median(many[i]["ms"] for i in timed)
tok1 = statistics.median(one[i]["tok_s"] for i in timed)
tokn = statistics.median(many[i]["tok_s"] for i in timed)
common = sorted(set(one) & set(many))
diffs = {i: abs(one[i]["loss"] - many[i]["loss"]) for i in common}
worst = sorted(diffs, key=diffs.get)[-3:]
show = sorted(set([common[0], common[len(common) // 2], common[-1]] + worst))
lines = [f"train.py {' '.join(train_args)}", "",
         f"| run | ms / iteration (median, iters {timed[0]}-{timed[-1]}) | tokens/s | speed-up |",
         "|---|---|---|---|",
         f"| 1 GPU | {ms1:.1f} | {tok1:,.0f} | 1.00x |",
         f"| {args.nproc} GPUs | {msn:.1f} | {tokn:,.0f} | {tokn / tok1:.2f}x |", "",
         "| iteration | loss, 1 GPU | loss, %d GPUs | difference |" % args.nproc, "|---|---|---|---|"]
lines += [f"| {i} | {one[i]['loss']:.4f} | {many[i]['loss']:.4f} | {diffs[i]:.4f} |" for i in show]
lines += ["", f"loss difference over {len(common)} iterations: mean {statistics.mean(diffs.values()):.4f}, "
          f"max {max(diffs.values()):.4f} (iteration {worst[-1]})"]
print("\n".join(lines))
if args.out:
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
