"""Packed-sequence (cu_seqlens) variants of kernel.kla_chunk at 64 documents in 32768 tokens, H = 16, D = 128, bf16:
the sequential kernels' configs and the longest-first order.
Timing only (the same inputs as bench.py --section=varlen); writes $OUT/varlen_variants.md.
    python3 tools/varlen_variants.py
"""
import sys, os
sys.path.insert(0, os.getcwd())
import torch, triton
import kernel, bench
dev = "cuda"
T, N, H, D = 32768, 64, 16, 128
cuts = torch.randperm(T - 1, generator=torch.Generator().manual_seed(0))[:N - 1].sort().values + 1
cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([T])]).to(dev)
seq_config, fuse_o, layout = kernel._seq_config, kernel._fwd_fuse_o, kernel._varlen_layout
def ident(bounds, device):  # the sequences in their own order
    p = layout(bounds, device)
    return (*p[:2], torch.arange(p[-1], device=device, dtype=torch.int32), *p[3:])
variants = {
    "default": {},
    "no order": dict(_varlen_layout=ident),
    "few config": dict(_seq_config=lambda BH, V, fp32=False, bwd=False: (16, 4, 3)),
    "split o": dict(_fwd_fuse_o=lambda BH, V, save, N: False),
    "few config + split o": dict(_seq_config=lambda BH, V, fp32=False, bwd=False: (16, 4, 3), _fwd_fuse_o=lambda BH, V, save, N: False),
    "BV 32, 3 stages": dict(_seq_config=lambda BH, V, fp32=False, bwd=False: (32, 4, 3)),
    "BV 64, 2 stages": dict(_seq_config=lambda BH, V, fp32=False, bwd=False: (64, 4, 2)),
}
rows = []
for backward in (False, True):
    xs = bench.inputs(1, T, H, D, dev, requires_grad=backward)
    dense = bench.timed(bench.ours_chunk, xs, backward, dev)[0]
    rows.append(("1 sequence", backward, dense, 1.0))
    print(rows[-1], flush=True)
    for name, patch in variants.items():
        for k_, v_ in patch.items():
            setattr(kernel, k_, v_)
        kernel._layout_cache[0] = None
        try:
            ms = bench.timed(lambda *x: kernel.kla_chunk(*x, eps=1e-6, cu_seqlens=cu)[0], xs, backward, dev)[0]
        except Exception as err:
            ms = float("nan"); print(name, err)
        kernel._seq_config, kernel._fwd_fuse_o, kernel._varlen_layout = seq_config, fuse_o, layout
        rows.append((name, backward, ms, ms / dense))
        print(rows[-1], flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "varlen_variants.md"), "w") as f:
    f.write("| variant | backward | ms | / 1 sequence |\n|---|---|---|---|\n")
    for r in rows:
        f.write(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.3f} |\n")
