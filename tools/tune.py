"""
Launch configurations timed one variant at a time on one GPU: each variant overrides rows of kernel.CONFIGS or
kernel_decode.DECODE_CONFIGS (the tables the kernels launch from), and the rows are restored after it.

    python tools/tune.py --section=tune [--shapes=0,2] [--variants=wy] [--start=N] [--out=DIR] [--smoke]

Sections (comma-separated):
  tune         the chunk backward's token-parallel kernels: value columns, warps and stages of _bwd_cc_kernel, warps
               of _bwd_wy_kernel, key and value columns, warps and stages of _bwd_dqk_kernel; forward + backward.
  tune_seq     the sequential kernels' value columns, warps and stages, the output inside _fwd_kernel or from
               _fwd_o_kernel, warps of _prep_kernel, the pre-kernels' value columns.
  tune_decode  decode_linear's rows a program and warps on GPT-2 small's projections, against cuBLAS.
--shapes picks shapes by index, --variants the variants whose name holds the text (and the defaults). A variant that
faults the GPU poisons the process: it exits printing RESTART_AT=<next index>, and --start=<index> goes on from there
in a new process. --smoke runs tiny shapes in Triton's interpreter. Tables to stdout and DIR/tune.md. The rows chosen
and their measurements: docs/kernel.md, "Choices, with the measurement behind each".
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # sets TRITON_INTERPRET=1 under --smoke before triton loads

import torch
import triton

import kernel
import kernel_decode

ARGS = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
FLAGS = ("section", "shapes", "variants", "start", "out")


def rows(name, table=kernel.CONFIGS, **values):
    """An override: every row of `table` for kernel `name` set to these launch values, whatever the shape."""
    return {(id(table), key): values for key in table if key[0] == name}


def pick(shapes, smoke):
    return [shapes[int(i)] for i in ARGS["shapes"].split(",")] if ARGS.get("shapes") and not smoke else shapes


def only_named(variants):
    if ARGS.get("variants"):
        return [v for v in variants if ARGS["variants"] in v[2] or v[2] == "default"]
    return variants


def section_tune(device, smoke):
    """The chunk backward's token-parallel kernels, one variant at a time. The first shape is the model's heads."""
    shapes = pick([(1, 100, 2, 32)] if smoke else [bench.MODEL_HEADS, (8, 4096, 16, 128), (16, 2048, 8, 64)], smoke)
    variants = []  # (shape, backward, name, override)
    dqk = lambda c: rows("bwd_dqk", BKB=c[0], BV=c[1], num_warps=c[2], num_stages=c[3])
    for shape in shapes:
        variants.append((shape, True, "default", {}))
        for c in ((32, 4, 1), (64, 8, 1), (32, 8, 1), (64, 4, 2), (32, 4, 2), (128, 8, 1)):
            variants.append((shape, True, "cc BV={} warps={} stages={}".format(*c),
                             rows("bwd_cc", BV=c[0], num_warps=c[1], num_stages=c[2])))
        for nw in (2, 4, 8):
            variants.append((shape, True, f"wy warps={nw}", rows("bwd_wy", num_warps=nw, num_stages=3)))
        for c in ((32, 16, 4, 1), (32, 32, 4, 1), (32, 32, 8, 1), (32, 32, 4, 2), (32, 32, 2, 1), (64, 32, 4, 1),
                  (64, 32, 8, 2), (64, 64, 8, 1), (64, 16, 4, 1), (128, 32, 8, 1), (128, 16, 8, 1), (128, 32, 8, 2),
                  (32, 64, 4, 1)):  # the last faults the GPU at the model's heads (Triton 3.6)
            variants.append((shape, True, "dq/dk BKB={} BV={} warps={} stages={}".format(*c), dqk(c)))
        variants.append((shape, True, "the K = 64 configurations: wy warps=8, dq/dk BKB=64 BV=32 warps=8 stages=1",
                         {**rows("bwd_wy", num_warps=8, num_stages=3), **dqk((64, 32, 8, 1))}))
    return "kernel.py chunk-backward variants (ms, do_bench median; peak MiB)", \
        ["shape", "pass", "variant", "ms", "peak MiB"], time_variants(only_named(variants), device)


def section_tune_seq(device, smoke):
    """The sequential kernels and their helpers, one variant at a time (num_stages=1 on the sequential forward
    faults the GPU, Triton 3.6)."""
    shapes = pick([(1, 100, 2, 32)] if smoke else [(1, 32768, 16, 128), (8, 4096, 16, 128), (16, 2048, 8, 64),
                                                   bench.MODEL_HEADS, (8, 8192) + bench.MODEL_HEADS[2:],
                                                   (2, 32768) + bench.MODEL_HEADS[2:]], smoke)
    variants = []  # (shape, backward, name, override)
    for shape in shapes:
        BH, V = shape[0] * shape[2], shape[-1]
        bv0 = kernel._config("fwd", kernel._block_k(shape[3]), V, False, BH)["BV"]
        for bwd in (False, True):  # value columns a program, against the grid's waves over the SMs
            for bv in (16, 32, 64):
                for ns in (2, 3):
                    variants.append((shape, bwd, f"{'bwd state' if bwd else 'fwd'} value block {bv}, stages={ns}",
                                     rows("bwd_state" if bwd else "fwd", BV=bv, num_warps=4, num_stages=ns)))
        variants.append((shape, False, "default", {}))
        for fuse in (True, False):
            for nw in (4, 8):
                for ns in (2, 3, 4):
                    variants.append((shape, False, f"fwd BV={bv0} warps={nw} stages={ns} o={'fused' if fuse else 'split'}",
                                     {**rows("fwd", BV=bv0, num_warps=nw, num_stages=ns), **rows("fuse_o", FUSE_O=fuse)}))
        for nw in (1, 4):
            variants.append((shape, False, f"prep warps={nw}", rows("prep", num_warps=nw)))
        for bvp, nw in ((32, 4), (128, 4), (64, 8)):
            variants.append((shape, False, f"pre BV={bvp} warps={nw}", rows("pre", BV=bvp, num_warps=nw)))
        variants.append((shape, True, "default", {}))
        for nw in (4, 8):
            for ns in (2, 3, 4):
                variants.append((shape, True, f"bwd state BV={bv0} warps={nw} stages={ns}",
                                 rows("bwd_state", BV=bv0, num_warps=nw, num_stages=ns)))
    return "kernel.py sequential-kernel variants (ms, do_bench median; peak MiB)", \
        ["shape", "pass", "variant", "ms", "peak MiB"], time_variants(only_named(variants), device)


def overridden(override):
    """The tables with the override's rows set; returns a function that restores them."""
    tables = {id(t): t for t in (kernel.CONFIGS, kernel_decode.DECODE_CONFIGS)}
    saved = {tid: dict(t) for tid, t in tables.items()}
    for (tid, key), values in override.items():
        tables[tid][key] = values
    return lambda: [tables[tid].update(kept) for tid, kept in saved.items()]


def time_variants(variants, device):
    """Rows [shape, pass, variant, ms, peak MiB]: bench.ours_chunk timed once per (shape (B, T, H, K[, V]), backward,
    name, override) in order, the tables restored after each."""
    out = []
    for i, (shape, backward, name, override) in enumerate(variants):
        if i < int(ARGS.get("start", 0)):
            continue
        restore = overridden(override)
        label = [str(shape), "fwd+bwd" if backward else "fwd", name]
        try:
            xs = bench.inputs(*shape[:4], device, backward, V=shape[4] if len(shape) > 4 else None)
            ms, mem = bench.timed(bench.ours_chunk, xs, backward, device)
        except Exception as err:
            out.append(label + [type(err).__name__, ""])
            print(out[-1], flush=True)
            if "illegal" in str(err) or type(err).__name__ == "AcceleratorError":
                print(f"RESTART_AT={i + 1}", flush=True)
                os._exit(3)
            continue
        finally:
            restore()
        out.append(label + [ms, mem])
        print(out[-1], flush=True)
    return out


def section_tune_decode(device, smoke):
    """decode_linear (batch-1 decoding's projections) on GPT-2 small's shapes, rows a program and warps one variant
    at a time, against torch's F.linear (cuBLAS) on the same weight; GPU time a call, and the bandwidth the weight's
    bytes give. The timed CUDA graph (triton.testing.do_bench_cudagraph) makes one call on each of several copies
    of the weight, together past the 50 MB L2 cache (as a decoding step's 276 MB of weights are), so that every
    call reads from HBM."""
    shapes = [(40, 24)] if smoke else [(3472, 768), (768, 1152), (4096, 768), (768, 2048), (50304, 768)]
    out = []

    def gpu_us(fn, ws):
        if smoke:
            fn(ws[0])
            return float("nan")
        return triton.testing.do_bench_cudagraph(lambda: [fn(w) for w in ws]) * 1e3 / len(ws)

    for N, K in shapes:
        dtype = torch.float32 if smoke else torch.bfloat16
        copies = 1 if smoke else max(8, -(-256 * 2**20 // (N * K * 2)))
        ws = [torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5 for _ in range(copies)]
        w, x = ws[0], torch.randn(1, K, device=device, dtype=dtype)
        us = gpu_us(lambda w: torch.nn.functional.linear(x, w), ws)
        out.append([f"({N}, {K})", "F.linear (cuBLAS)", us, N * K * w.element_size() / us / 1e6])
        print(out[-1], flush=True)
        for bn in ((16,) if smoke else (1, 2, 4, 8, 16, 32)):
            for nw in ((4,) if smoke else (1, 2, 4, 8)):
                label = [f"({N}, {K})", f"decode_linear BN={bn} warps={nw}"]
                restore = overridden(rows("linear", kernel_decode.DECODE_CONFIGS, BN=bn, num_warps=nw))
                try:
                    us = gpu_us(lambda w: kernel_decode.decode_linear(x, w), ws)
                except Exception as err:  # e.g. out of resources: that variant is out, the rest go on
                    out.append(label + [type(err).__name__, ""])
                    continue
                finally:
                    restore()
                out.append(label + [us, N * K * w.element_size() / us / 1e6])
                print(out[-1], flush=True)
    return "decode_linear variants, one token (us of GPU time a call)", ["(N, K)", "variant", "us", "TB/s"], out


SECTIONS = {"tune": section_tune, "tune_seq": section_tune_seq, "tune_decode": section_tune_decode}


def main():
    known = lambda a: a == "--smoke" or a.startswith("--") and "=" in a and a[2:].split("=", 1)[0] in FLAGS
    unknown = [a for a in sys.argv[1:] if not known(a)]
    if unknown:
        sys.exit(f"error: unknown argument {unknown[0]!r}; tools/tune.py takes --smoke and --KEY=VALUE with KEY one "
                 f"of {', '.join(FLAGS)}")
    names = ARGS.get("section", "tune").split(",")
    if any(n not in SECTIONS for n in names):
        sys.exit(f"error: --section={ARGS['section']}: choose from {', '.join(SECTIONS)}")
    smoke = "--smoke" in sys.argv
    if not smoke and not torch.cuda.is_available():
        sys.exit("error: tools/tune.py times CUDA kernels and found no GPU (--smoke runs it in Triton's interpreter)")
    device = "cpu" if smoke else "cuda"
    torch.manual_seed(0)
    text = [f"tools/tune.py on {'CPU (interpreter)' if smoke else torch.cuda.get_device_name()}, torch "
            f"{torch.__version__}, triton {triton.__version__}"]
    for name in names:
        text.append(bench.table(*SECTIONS[name](device, smoke)))
        print("\n" + text[-1], flush=True)
    if ARGS.get("out"):
        os.makedirs(ARGS["out"], exist_ok=True)
        with open(os.path.join(ARGS["out"], "tune.md"), "w") as f:
            f.write("\n\n".join(text) + "\n")


if __name__ == "__main__":
    main()
