"""
Benchmarks on one GPU: python bench.py [--section=kernel,decode,profile,tune] [--out=DIR] [--smoke]

Sections (comma-separated; default kernel,decode):
  kernel  kernel.kla_chunk against the anchor, fla-core 0.6.0's chunk_gated_delta_rule with the Kaczmarz
          beta = eta / (||k||^2 + eps) computed in PyTorch (use_qk_l2norm_in_kernel=False), bf16, forward and
          forward + backward, triton.testing.do_bench medians in the same run; peak memory of one call.
  decode  kernel.kla_step against fla's fused_recurrent_gated_delta_rule, one token, H = 16, D = 128, fp32 state.
  profile time per kernel.py kernel in one forward + backward (torch.profiler).
  tune    kernel.py's block sizes and warps, one variant at a time (for choosing the defaults).
Each section returns (title, header, rows) for one printed table, all also written to DIR/bench.md
(DIR defaults to $OUT). A whole-model section is a function of the same shape added to SECTIONS.
fla raises in its gated backward on Hopper with Triton 3.4 to 3.7.0 (fla #640); for timing only, its guard is
switched off (fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True): its gradients are wrong there, its time is not.
"""

import os
import sys

os.environ.setdefault("FLA_FLASH_QLA", "0")  # time fla's own Triton kernels, not a dispatch to FlashQLA
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton

import kernel

EPS = 1e-6


def load_fla():
    try:
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as err:
        print(f"fla not importable ({err}): its columns are left empty")
        return None, None
    if hasattr(chunk_o, "TRITON_ABOVE_3_7_1"):
        chunk_o.TRITON_ABOVE_3_7_1 = True  # timing only (see the docstring)
    else:
        print("fla.ops.common.chunk_o has no TRITON_ABOVE_3_7_1: its backward guard is left as it is")
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def inputs(B, T, H, D, device, requires_grad=False):
    """bf16 q (unit), raw k (SiLU of a normal, as after KLA's short convolution), v; fp32 g <= 0 and eta."""
    q = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=device), dim=-1).bfloat16()
    k = torch.nn.functional.silu(torch.randn(B, T, H, D, device=device)).bfloat16()
    v = torch.randn(B, T, H, D, device=device).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=device) + 3)
    eta = torch.sigmoid(torch.randn(B, T, H, device=device))
    xs = [q, k, v, g, eta]
    return [x.requires_grad_(requires_grad) for x in xs]


def ours_chunk(q, k, v, g, eta):
    return kernel.kla_chunk(q, k, v, g, eta, eps=EPS)[0]


def fla_chunk_fn(fla_chunk):
    def run(q, k, v, g, eta):
        beta = eta / (k.float().pow(2).sum(-1) + EPS)
        return fla_chunk(q, k, v, g, beta, use_qk_l2norm_in_kernel=False)[0]
    return run


def timed(fn, xs, backward, device):
    """(median ms, peak MiB above what was allocated before the call)."""
    if backward:
        do = torch.randn_like(fn(*xs))

        def step():
            fn(*xs).backward(do)
    else:
        def step():
            with torch.no_grad():
                fn(*xs)
    step()
    if device != "cuda":
        return float("nan"), float("nan")
    for x in xs:
        x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = triton.testing.do_bench(step, warmup=50, rep=200, grad_to_none=xs if backward else None,
                                 return_mode="median")
    return ms, peak


def section_kernel(device, smoke):
    fla_chunk, _ = load_fla()
    shapes = [(16, 2048, 8, 64, True), (8, 4096, 16, 128, True), (1, 32768, 16, 128, True),
              (1, 131072, 16, 128, False)]
    if smoke:
        shapes = [(1, 100, 2, 32, True)]
    rows = []
    for B, T, H, D, with_bwd in shapes:
        for backward in ([False, True] if with_bwd else [False]):
            xs = inputs(B, T, H, D, device, requires_grad=backward)
            ours_ms, ours_mem = timed(ours_chunk, xs, backward, device)
            fla_ms, fla_mem = (timed(fla_chunk_fn(fla_chunk), xs, backward, device) if fla_chunk
                               else (float("nan"), float("nan")))
            rows.append([f"({B}, {T}, {H}, {D})", "fwd+bwd" if backward else "fwd", ours_ms, fla_ms,
                         ours_ms / fla_ms, ours_mem, fla_mem])
            print(rows[-1], flush=True)
            del xs
            if device == "cuda":
                torch.cuda.empty_cache()
    head = ["shape (B, T, H, D)", "pass", "ours ms", "fla ms", "ours / fla", "ours peak MiB", "fla peak MiB"]
    return "chunk kernel, bf16, do_bench medians (fla: chunk_gated_delta_rule + beta in PyTorch)", head, rows


def section_decode(device, smoke):
    _, fla_step = load_fla()
    H, D = (2, 32) if smoke else (16, 128)
    rows = []
    for B in (1, 32):
        q, k, v, g, eta = inputs(B, 1, H, D, device)
        state = torch.randn(B, H, D, D, device=device)
        beta = eta / (k.float().pow(2).sum(-1) + EPS)

        def ours():
            return kernel.kla_step(q, k, v, g, eta, state, eps=EPS)

        def fla():
            return fla_step(q, k, v, g, beta, initial_state=state, output_final_state=True)
        ours()
        if device != "cuda":
            rows.append([B] + [float("nan")] * 4)
            continue
        ours_us = triton.testing.do_bench(ours, warmup=50, rep=200, return_mode="median") * 1e3
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ours()
        graph_us = triton.testing.do_bench(graph.replay, warmup=50, rep=200, return_mode="median") * 1e3
        fla_us = float("nan")
        if fla_step:
            fla()
            fla_us = triton.testing.do_bench(fla, warmup=50, rep=200, return_mode="median") * 1e3
        rows.append([B, ours_us, graph_us, fla_us, ours_us / fla_us])
        print(rows[-1], flush=True)
    head = ["batch", "ours us", "ours in a CUDA graph us", "fla fused_recurrent us", "ours / fla"]
    return f"decode step, H = {H}, D = {D}, bf16 q/k/v, fp32 state (fla given beta precomputed)", head, rows


def section_tune(device, smoke):
    """Block sizes and warps of kernel.py, one variant at a time (kernel's config functions replaced)."""
    shapes = [(1, 100, 2, 32)] if smoke else [(8, 4096, 16, 128), (1, 32768, 16, 128), (16, 2048, 8, 64)]
    saved = kernel._fwd_bv, kernel._nw, kernel._bwd_chunk_config, kernel._bwd_dqk_config
    rows = []
    try:
        for B, T, H, D in shapes:
            for bv in (16, 32, 64):
                for nw in (4, 8):
                    kernel._fwd_bv, kernel._nw = (lambda BH, V, fp32=False, bv=bv: bv), (lambda BK, nw=nw: nw)
                    ms, _ = timed(ours_chunk, inputs(B, T, H, D, device), False, device)
                    rows.append([f"({B}, {T}, {H}, {D})", "fwd", f"BV={bv} warps={nw}", ms])
                    print(rows[-1], flush=True)
            kernel._fwd_bv, kernel._nw = saved[:2]
            for bv in (16, 32, 64):
                for nw in (4, 8):
                    kernel._bwd_chunk_config = lambda BK, V, fp32=False, bv=bv, nw=nw: (bv, nw)
                    ms, _ = timed(ours_chunk, inputs(B, T, H, D, device, True), True, device)
                    rows.append([f"({B}, {T}, {H}, {D})", "fwd+bwd", f"cc bwd BV={bv} warps={nw}", ms])
                    print(rows[-1], flush=True)
            kernel._bwd_chunk_config = saved[2]
            for bkb, bv in ((64, 16), (64, 32), (128, 16), (128, 32)):
                kernel._bwd_dqk_config = lambda BK, V, fp32=False, bkb=bkb, bv=bv: (min(BK, bkb), bv, 8)
                ms, _ = timed(ours_chunk, inputs(B, T, H, D, device, True), True, device)
                rows.append([f"({B}, {T}, {H}, {D})", "fwd+bwd", f"dq/dk bwd BKB={bkb} BV={bv} warps=8", ms])
                print(rows[-1], flush=True)
            kernel._bwd_dqk_config = saved[3]
    finally:
        kernel._fwd_bv, kernel._nw, kernel._bwd_chunk_config, kernel._bwd_dqk_config = saved
    return "kernel.py variants (ms, do_bench median)", ["shape", "pass", "variant", "ms"], rows


def section_profile(device, smoke):
    """Time per kernel of one forward + backward (torch.profiler, CUDA time summed over 5 calls)."""
    shapes = [(1, 100, 2, 32)] if smoke else [(8, 4096, 16, 128), (1, 32768, 16, 128), (16, 2048, 8, 64)]
    rows = []
    for B, T, H, D in shapes:
        xs = inputs(B, T, H, D, device, True)
        do = torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16)
        ours_chunk(*xs).backward(do)
        acts = [torch.profiler.ProfilerActivity.CPU]
        acts += [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else []
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(5):
                ours_chunk(*xs).backward(do)
            if device == "cuda":
                torch.cuda.synchronize()
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
            if us > 0 and "_kernel" in ev.key:
                rows.append([f"({B}, {T}, {H}, {D})", ev.key, us / 5 / 1e3])
    return "time per kernel in one fwd+bwd (ms)", ["shape", "kernel", "ms"], rows


SECTIONS = {"profile": section_profile, "kernel": section_kernel, "decode": section_decode, "tune": section_tune}


def table(title, head, rows):
    fmt = lambda x: f"{x:.3f}" if isinstance(x, float) else str(x)
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def main():
    arg = lambda name, default: next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), default)
    names = arg("section", "kernel,decode").split(",")
    out = arg("out", os.environ.get("OUT"))
    smoke = "--smoke" in sys.argv
    if not smoke and not torch.cuda.is_available():
        sys.exit("error: bench.py times CUDA kernels and found no GPU (--smoke runs it in Triton's interpreter)")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        sys.exit(f"error: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    device = "cpu" if smoke else "cuda"
    torch.manual_seed(0)
    dev = "CPU (interpreter)" if smoke else torch.cuda.get_device_name()
    text = [f"bench.py on {dev}, torch {torch.__version__}, triton {triton.__version__}"]
    for name in names:
        text.append(table(*SECTIONS[name](device, smoke)))
        print("\n" + text[-1], flush=True)
    text = "\n\n".join(text)
    print("\n" + text)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
