"""
Registers and spills of kernel.py's kernels for sm_90 without a GPU (the installed Triton and the ptxas it runs for
sm_90: with Triton 3.6, as on the H200, its bundled ptxas 12.8; with 3.9, ptxas-blackwell). Usage:
    python tools/ptxas_report.py [--fp32] [NAME ...]   (substrings of the kernel labels below; default: all)
Prints kernel, K, V, dtype, constexprs, warps, registers, spill stores/loads (bytes), shared memory. A NAME in no
label, or an unknown flag, is one error line naming the kernels or the flags.
    python tools/ptxas_report.py --wgmma
    python tools/ptxas_report.py --loops
The sequential kernels' PTX at their configurations (bf16, K = V = 128): the asynchronous tensor-core products
(wgmma.mma_async) and the waits for them (wgmma.wait_group N: wait until at most N groups are in flight), which
say how many products of a chunk's step run one after another. With PYTHONPATH at another Triton (e.g. a
Triton 3.6 installed with pip --target), that Triton's PTX.
--loops: the loads inside each kernel's loops that Triton issues stages ahead (cp.async) and those it loads
synchronously, the sequential kernels at their configurations for 16 and for 128 sequence-heads.
    python tools/ptxas_report.py --trans
Each chunk kernel's transposes (tt.trans in its Triton IR): of a loaded tile or of a matrix computed from a
product, and whether the transpose reaches a product's operand. A computed matrix transposed into a product is what
Triton 3.4 to 3.7.0 miscompile on Hopper (fla #640); the kernels avoid it (tests/test_kernel.py checks).
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton
import triton.language as tl
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget

import kernel

FP32_ARGS = {"sa", "qdp", "qdc", "ssc", "bl_ptr", "beta_ptr", "bl_out", "beta_out", "g", "eta", "dg", "deta", "coef",
             "scratch", "dh0", "dht", "h0", "ht", "s_in", "s_out"}
INT_ARGS = {"T", "H", "Tp"}
INT_PTR_ARGS = {"cu", "cs", "order", "cr"}
FLT_ARGS = {"scale", "eps"}


def compile_kernel(fn, constexprs, num_warps, dtype="bf16", num_stages=1):
    """The kernel compiled for sm_90 as the JIT specializes a call on tensors: every pointer 16-byte aligned
    and H divisible by 16 (T and Tp are not specialized). Without these facts the loads are not vectorized
    and Triton pipelines none of them."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            sig[name] = "constexpr"
            continue
        if name in INT_ARGS:
            sig[name] = "i32"
        elif name in FLT_ARGS:
            sig[name] = "fp32"
        elif name in FP32_ARGS:
            sig[name] = "*fp32"
        elif name in INT_PTR_ARGS:
            sig[name] = "*i32"
        else:
            sig[name] = "*" + dtype
        if sig[name].startswith("*") or name == "H":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                         "num_stages": num_stages})


def compile_report(fn, constexprs, num_warps, dtype="bf16", num_stages=1):
    ck = compile_kernel(fn, constexprs, num_warps, dtype, num_stages)
    ptxas = get_ptxas(90).path  # the ptxas the JIT runs for sm_90 with this Triton
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        open(p, "w").write(ck.asm["ptx"])
        out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", p, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True)
    txt = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", txt)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", txt)
    return (int(regs.group(1)) if regs else None, spill.groups() if spill else None, ck.metadata.shared)


SEQ_FWD = dict(USE_H0=True, STORE_HT=True, SAVE_H=True, FUSE_O=True, VARLEN=False)  # _fwd_kernel as in training
SEQ_BWD = dict(USE_DHT=True, STORE_DH0=True, VARLEN=False)  # _bwd_state_kernel


def chosen(name, BK, V, fp32=False, BH=0):
    """kernel.CONFIGS's row for kernel `name` at this shape: (its constexprs, warps, stages; 3, Triton's default,
    where the row has none)."""
    c = kernel._config(name, BK, V, fp32, BH)
    return {k: v for k, v in c.items() if k not in ("num_warps", "num_stages")}, c["num_warps"], c.get("num_stages", 3)


def configs(K, fp32=False):
    """(label, kernel, constexprs, warps, stages): the chosen configuration of every token-parallel backward kernel
    first (marked *), then alternatives; with fp32 only the chosen ones, and the sequential kernels'; head size
    K = V."""
    BK = kernel._block_k(K)
    base = dict(K=K, V=K, C=64, BK=BK, KACZ=True, PREC="ieee" if fp32 else "tf32",
                DT=tl.float32 if fp32 else tl.bfloat16)
    out = []
    for name, fn in (("bwd_cc", kernel._bwd_cc_kernel), ("bwd_wy", kernel._bwd_wy_kernel),
                     ("bwd_dqk", kernel._bwd_dqk_kernel)):
        cx, nw, ns = chosen(name, BK, K, fp32)
        out.append((f"* {fn.__name__} K=V={K}", fn, dict(base, **cx), nw, ns))
    if fp32:  # and the sequential kernels, whose float32 configuration does not depend on the shape
        for name, fn, extra in (("fwd", kernel._fwd_kernel, SEQ_FWD), ("bwd_state", kernel._bwd_state_kernel, SEQ_BWD)):
            cx, nw, ns = chosen(name, BK, K, True, 1)
            out.append((f"* {fn.__name__} K=V={K}", fn, dict(base, **cx, **extra), nw, ns))
        return out
    for bv, nw in ((16, 4), (32, 8), (64, 8)):
        out.append((f"_bwd_cc_kernel K=V={K}", kernel._bwd_cc_kernel, dict(base, BV=bv), nw, 1))
    for nw in (4, 8):
        out.append((f"_bwd_wy_kernel K=V={K}", kernel._bwd_wy_kernel, base, nw, 3))
    for bkb, bv, nw in ((64, 32, 8), (64, 16, 4), (64, 64, 8), (64, 64, 4), (32, 32, 4)):
        out.append((f"_bwd_dqk_kernel K=V={K}", kernel._bwd_dqk_kernel, dict(base, BKB=min(BK, bkb), BV=bv), nw, 1))
    return out


def sequential_configs():
    """(label, kernel, constexprs, warps, stages): _fwd_kernel (output inside, chunk states saved) and
    _bwd_state_kernel, bf16, K = V = 128, at the configurations kernel.CONFIGS gives 16 heads at batch 1 and
    128 sequence-heads."""
    base = dict(K=128, V=128, C=64, BK=128, PREC="tf32", DT=tl.bfloat16)
    out = []
    for BH, who in ((16, "16 heads at batch 1"), (128, "128 sequence-heads")):
        for fn, extra, name in ((kernel._fwd_kernel, SEQ_FWD, "fwd"), (kernel._bwd_state_kernel, SEQ_BWD, "bwd_state")):
            cx, nw, ns = chosen(name, 128, 128, False, BH)
            BV = cx["BV"]
            out.append((f"{fn.__name__}, {who} (BV {BV}, {nw} warps, {ns} stages)", fn, dict(base, BV=BV, **extra),
                        nw, ns))
    return out


def wgmma_report():
    """The products and waits in the PTX of the sequential kernels (sequential_configs)."""
    print(f"Triton {triton.__version__}, sm_90, bf16, K = V = 128")
    for label, fn, cx, nw, ns in sequential_configs():
        ptx = compile_kernel(fn, cx, nw, "bf16", ns).asm["ptx"]
        waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)
        print(f"{label}: {ptx.count('wgmma.mma_async')} wgmma.mma_async, waits {waits}", flush=True)


def loop_loads(ttgir):
    """(pipelined, synchronous) loads inside loops of a kernel's TritonGPU IR: cp.async copies issued stages
    ahead, and plain loads, whose latency a step waits for unless other work covers it."""
    stack, n_async, n_sync = [], 0, 0
    for line in ttgir.splitlines():
        s = line.strip()
        if s.startswith("}"):
            stack and stack.pop()
        in_loop = "for" in stack
        n_async += in_loop and "ttg.async_copy_global_to_local" in s
        n_sync += in_loop and " tt.load " in s
        if s.endswith("{"):
            stack.append("for" if "scf.for" in s else "other")
    return n_async, n_sync


def sequential_loop_loads():
    """[(label, pipelined, synchronous)]: the loads inside the loops of the sequential kernels (sequential_configs)."""
    return [(label, *loop_loads(compile_kernel(fn, cx, nw, "bf16", ns).asm["ttgir"]))
            for label, fn, cx, nw, ns in sequential_configs()]


def chunk_kernels():
    """(kernel, constexprs, warps, stages): every kernel of the chunkwise forward and backward at its configuration,
    bf16, K = V = 128 (the sequential ones for 16 heads at batch 1 and for 128 sequence-heads)."""
    base = dict(K=128, V=128, C=64, BK=128, KACZ=True, VARLEN=False, PREC="tf32", DT=tl.bfloat16)
    pre, nwp, _ = chosen("pre", 128, 128)
    items = [(kernel._prep_kernel, base, chosen("prep", 128, 128)[1], 3)]
    items += [(fn, dict(base, **pre), nwp, 3)
              for fn in (kernel._fwd_pre_kernel, kernel._fwd_o_kernel, kernel._bwd_pre_kernel)]
    items += [(fn, cx, nw, ns) for _, fn, cx, nw, ns in configs(128)[:3] + sequential_configs()]
    return [(fn, {k: v for k, v in cx.items() if k in fn.arg_names}, nw, ns) for fn, cx, nw, ns in items]


def token_parallel_loop_loads():
    """[(label, pipelined, synchronous)]: the loads inside the loops of the token-parallel kernels (chunk_kernels)."""
    return [(f"{fn.__name__} (BV {cx.get('BV', '-')}, {nw} warps, {ns} stages)",
             *loop_loads(compile_kernel(fn, cx, nw, "bf16", ns).asm["ttgir"]))
            for fn, cx, nw, ns in chunk_kernels() if fn not in (kernel._fwd_kernel, kernel._bwd_state_kernel)]


def loops_report():
    """Loads inside the loops of the sequential kernels and of the token-parallel kernels, bf16, K = V = 128."""
    print(f"Triton {triton.__version__}, sm_90, bf16, K = V = 128: loads inside loops, pipelined / synchronous")
    for label, n_async, n_sync in sequential_loop_loads() + token_parallel_loop_loads():
        print(f"{label:66s}: {n_async} / {n_sync}", flush=True)


SSA_DEF = re.compile(r"^\s*(%[\w.#:]+(?:\s*,\s*%[\w.#:]+)*)\s*=\s*([\w.]+)\s*(.*)$")  # %a[, %b] = op operands : types


def transposes(ttir):
    """[(value, of a product, into a product)] for each tt.trans in a kernel's Triton IR: whether the matrix it
    transposes is computed from a product (a tt.dot, through any other ops; a loop's carried value counts as
    computed) rather than loaded, and whether the transpose reaches an operand of a product (through any ops but
    stores). Both at once is the pattern Triton 3.4 to 3.7.0 miscompile on Hopper (fla #640)."""
    defs, users, params = {}, {}, set()
    for line in ttir.splitlines():
        if "tt.func" in line:
            params.update(re.findall(r"(%[\w.]+): ", line))  # the kernel's arguments: pointers and scalars
        m = SSA_DEF.match(line)
        if m:  # every result of the op (tt.split has two)
            names, op, rest = m.groups()
            for name in re.findall(r"%[\w.#]+", names):
                defs[name] = (op, re.findall(r"%[\w.#]+", rest.split(" : ")[0]))
    for name, (_, args) in defs.items():
        for a in args:
            users.setdefault(a, []).append(name)

    def computed(v, seen):
        if v in params or v in seen:
            return False
        if v not in defs:  # a block argument: a loop's carried value
            return True
        seen.add(v)
        op, args = defs[v]
        return op == "tt.dot" or (op != "tt.load" and any(computed(a, seen) for a in args))

    def into_product(v, seen):
        for u in users.get(v, []):
            op, args = defs[u]
            if op == "tt.dot" and v in args[:2]:
                return True
            if u not in seen and op != "tt.store":
                seen.add(u)
                if into_product(u, seen):
                    return True
        return False

    return [(name, computed(args[0], set()), into_product(name, set()))
            for name, (op, args) in defs.items() if op == "tt.trans"]


def chunk_kernel_transposes():
    """[(kernel name, transposes(its Triton IR))] for chunk_kernels()."""
    return [(fn.__name__, transposes(compile_kernel(fn, cx, nw, "bf16", ns).asm["ttir"]))
            for fn, cx, nw, ns in chunk_kernels()]


def trans_report():
    """Each chunk kernel's transposes: of a loaded or a computed matrix, into a product or not."""
    print(f"Triton {triton.__version__}, sm_90, bf16, K = V = 128: transposes (value: loaded or computed / into a product or not)")
    for name, ts in chunk_kernel_transposes():
        print(f"{name:20s} " + ", ".join(f"{v}: {'computed' if c else 'loaded'} / {'product' if p else '-'}"
                                         for v, c, p in ts), flush=True)


MODES = {"--wgmma": wgmma_report, "--loops": loops_report, "--trans": trans_report}  # the other reports


def main():
    """Arguments: substrings of the labels to keep (default all); --fp32 for the float32 (ieee) configs;
    --wgmma for the sequential kernels' products and waits instead; --loops for the loads in their loops; --trans
    for the chunk kernels' transposes. An unknown flag, a name that matches no label, or names given to another
    report is one error line before anything is compiled."""
    flags = [a for a in sys.argv[1:] if a.startswith("-")]
    sel = [a for a in sys.argv[1:] if not a.startswith("-")]
    for a in flags:
        if a not in ("--fp32", *MODES):
            sys.exit(f"error: unknown flag {a!r}; the flags are --fp32, {', '.join(MODES)}")
    modes = [a for a in flags if a in MODES]
    if len(modes) > 1 or modes and (sel or "--fp32" in flags):
        sys.exit(f"error: {' '.join(sys.argv[1:])}: {modes[0]} is a report of its own, without kernel names, "
                 "--fp32 or another report")
    if modes:
        return MODES[modes[0]]()
    fp32 = "--fp32" in flags
    labels = [c[0] for K in (128, 64) for c in configs(K, fp32)]
    for part in sel:
        if not any(part in name for name in labels):
            kernels = sorted({name.split()[-2] for name in labels})
            sys.exit(f"error: {part!r} is in no kernel's label: give parts of the labels "
                     "'[*] <kernel> K=V=<128 or 64>' (* marks the chosen configurations), the kernels being "
                     + ", ".join(kernels))
    for K in (128, 64):
        for name, fn, cx, nw, ns in configs(K, fp32):
            if sel and not any(s in name for s in sel):
                continue
            cx = {k: v for k, v in cx.items() if k in fn.arg_names}
            regs, spill, smem = compile_report(fn, cx, nw, "fp32" if fp32 else "bf16", ns)
            shown = {k: v for k, v in cx.items() if k in ("BV", "BKB")}
            print(f"{name:36s} {str(shown):24s} warps {nw}, stages {ns}: {regs} regs, spill st/ld {spill} B, smem {smem} B",
                  flush=True)


if __name__ == "__main__":
    main()
