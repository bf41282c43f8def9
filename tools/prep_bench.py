"""
kernel.py's _prep_kernel (the gate sums, beta and the chunk inverses) alone against another kernel.py's, in one
process: do_bench medians in microseconds at 1, 2 and 4 warps, at (8, 4096, 16, 128), the model's heads (32, 2048,
6, 96) and (16, 2048, 8, 64), bf16, with the relative difference of each inverse from the other file's at 1 warp.
For choosing kernel._prep_warps; tools/ab_kernel.py then times the whole forward.
    git show <rev>:kernel.py > out-ab/kernel_old.py
    python3 tools/prep_bench.py --old=out-ab/kernel_old.py
Prints a table (written to $OUT/prep_bench.md when OUT is set). Both files' _prep_kernel must take this one's
arguments, the float32 scratch sa after ar_out where the kernel has one.
"""
import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import triton

import bench
import kernel
from ab_kernel import load_other

SHAPES = [(8, 4096, 16, 128), (32, 2048, 6, 96), (16, 2048, 8, 64)]


def prep_call(mod, k, g, eta, B, T, H, K, nw):
    """A function launching mod's _prep_kernel on k, g, eta, and the inverses it writes (bf16, NaN before)."""
    N = triton.cdiv(T, kernel.C_CHUNK)
    Tp, C, BK = N * kernel.C_CHUNK, kernel.C_CHUNK, kernel._block_k(K)
    bl, beta = (torch.empty(B * H, Tp, device=k.device) for _ in range(2))
    ar = torch.full((B * H, Tp, C), float("nan"), device=k.device, dtype=torch.bfloat16)
    args = [k, g, eta, bl, beta, ar]
    if "sa" in inspect.signature(mod._prep_kernel.fn).parameters:
        args.append(torch.empty(B * H, Tp, C, device=k.device))
    args += [None, T, H, Tp, bench.EPS]
    return (lambda: mod._prep_kernel[(N, B * H)](*args, K=K, C=C, BK=BK, KACZ=True, VARLEN=False, PREC="tf32",
                                                 num_warps=nw)), ar


def main():
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    if not os.path.isfile(args.get("old", "")):
        sys.exit(f"error: --old={args.get('old', '')!r}: must name another kernel.py (git show <rev>:kernel.py > FILE)")
    if not torch.cuda.is_available():
        sys.exit("error: tools/prep_bench.py times CUDA kernels and found no GPU")
    other = load_other(args["old"])
    lines = [f"tools/prep_bench.py on {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
             f"{triton.__version__}: _prep_kernel of this kernel.py (new) against {args['old']} (old), us", "",
             "| (B, T, H, K) | version | warps | us | inverse vs old at 1 warp |", "|---|---|---|---|---|"]
    for B, T, H, K in SHAPES:
        _, k, _, g, eta = bench.inputs(B, T, H, K, "cuda")
        ref = None
        for name, mod in (("old", other), ("new", kernel)):
            for nw in (1, 2, 4):
                fn, ar = prep_call(mod, k, g, eta, B, T, H, K, nw)
                fn()
                torch.cuda.synchronize()
                ref = ar.float().clone() if ref is None else ref
                err = ((ar.float() - ref).norm() / ref.norm()).item()
                us = 1e3 * triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")
                lines.append(f"| {(B, T, H, K)} | {name} | {nw} | {us:.1f} | {err:.1e} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "prep_bench.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
