"""
kernel.py against another version of it, in one process: kla_chunk's forward and forward + backward ms (do_bench
medians, bench.py's inputs) at bench.py's kernel shapes and the model's heads, the two versions alternating for
several rounds so that both see the same GPU state, taking turns at running first. For deciding a kernel change;
bench.py's kernel section then times the chosen code against fla and FlashQLA.
    git show <rev>:kernel.py > out-ab/kernel_old.py
    python3 tools/ab_kernel.py --old=out-ab/kernel_old.py [--shapes=1,4] [--rounds=3] [--dtype=float32]
q, k and v are bfloat16, or float32 with --dtype=float32. Prints a table (written to $OUT/ab_kernel.md when OUT is
set), with the largest relative difference between the two versions' outputs and gradients on each row's inputs.
The other version's PyTorch operators are registered as kla_ab:: instead of kla::, so that both load side by side.
"""
import importlib.util
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import triton

import bench
import kernel

SHAPES = [(16, 2048, 8, 64, 64), (8, 4096, 16, 128, 128), (4, 8192, 16, 128, 128), (1, 32768, 16, 128, 128),
          bench.MODEL_HEADS]


def load_other(path):
    """The kernel.py at path as a module of its own, its operators renamed."""
    src = open(path).read().replace('"kla::', '"kla_ab::')
    spec = importlib.util.spec_from_loader("kernel_ab", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__file__ = os.path.abspath(path)  # Triton reads the kernels' source from their file
    code = compile(src, mod.__file__, "exec")
    sys.modules["kernel_ab"] = mod
    exec(code, mod.__dict__)
    return mod


def difference(old, new, xs, backward):
    """Largest relative difference ||new - old|| / ||old|| of the two versions' outputs on the same inputs, and with
    backward of every input's gradient (the same dO): a variant that times well but computes something else shows
    here (test_gpu.py checks against float64)."""
    results = []
    do = None
    for mod in (old, new):
        leaves = [x.detach().requires_grad_(backward) for x in xs]
        with torch.set_grad_enabled(backward):
            o = mod.kla_chunk(*leaves, eps=bench.EPS)[0]
        if backward:
            do = torch.randn_like(o) if do is None else do
            o.backward(do)
        results.append([o.detach()] + ([x.grad for x in leaves] if backward else []))
    return max(((b.double() - a.double()).norm() / a.double().norm().clamp_min(1e-30)).item()
               for a, b in zip(*results))


def main():
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    if not os.path.isfile(args.get("old", "")):
        sys.exit(f"error: --old={args.get('old', '')!r}: must name another kernel.py (git show <rev>:kernel.py > FILE)")
    picks = args.get("shapes", ",".join(map(str, range(len(SHAPES))))).split(",")
    if not all(i.isdigit() and int(i) < len(SHAPES) for i in picks):
        sys.exit(f"error: --shapes={args['shapes']}: must be indices 0..{len(SHAPES) - 1}, comma-separated")
    if not args.get("rounds", "3").isdigit() or int(args.get("rounds", "3")) < 1:
        sys.exit(f"error: --rounds={args['rounds']}: must be an integer >= 1")
    dtype = args.get("dtype", "bfloat16")
    if dtype not in ("bfloat16", "float32"):
        sys.exit(f"error: --dtype={dtype}: must be bfloat16 or float32")
    dtype = getattr(torch, dtype)
    if not torch.cuda.is_available():
        sys.exit("error: tools/ab_kernel.py times CUDA kernels and found no GPU")
    other = load_other(args["old"])
    shapes = [SHAPES[int(i)] for i in picks]
    rounds = int(args.get("rounds", 3))
    lines = [f"tools/ab_kernel.py on {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
             f"{triton.__version__}: this kernel.py (new) against {args['old']} (old), {rounds} rounds alternating, "
             "old first in rounds 1, 3, ..., "
             f"q, k, v in {dtype}",
             "", "| (B, T, H, K, V) | pass | old ms, each round | new ms, each round | new / old (medians) | "
             "new vs old, largest relative difference |", "|---|---|---|---|---|---|"]
    for B, T, H, K, V in shapes:
        for backward in (False, True):
            xs = [(x.to(dtype) if x.dtype == torch.bfloat16 else x).requires_grad_(backward)
                  for x in bench.inputs(B, T, H, K, "cuda", V=V)]
            times = {"old": [], "new": []}
            for i in range(rounds):  # the version run first alternates: neither always runs in the wake of the other
                pair = (("old", other), ("new", kernel))
                for name, mod in (pair if i % 2 == 0 else pair[::-1]):
                    def run(q, k, v, g, eta, mod=mod):
                        return mod.kla_chunk(q, k, v, g, eta, eps=bench.EPS)[0]
                    times[name].append(bench.timed(run, xs, backward, "cuda")[0])
            old, new = (statistics.median(times[n]) for n in ("old", "new"))
            lines.append(f"| ({B}, {T}, {H}, {K}, {V}) | {'fwd+bwd' if backward else 'fwd'} | "
                         + " / ".join(f"{t:.3f}" for t in times["old"]) + " | "
                         + " / ".join(f"{t:.3f}" for t in times["new"]) + f" | {new / old:.3f} | "
                         + f"{difference(other, kernel, xs, backward):.1e} |")
            print(lines[-1], flush=True)
            del xs
            torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "ab_kernel.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
