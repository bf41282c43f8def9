"""
_decode_rows_kernel's configuration (rows, outputs, K block, warps, stages a program) on the calls with a
prologue, batch 64: us of GPU time a call (do_bench_cudagraph over copies of the weight past the L2 cache).
    python3 tools/decode_rows_sweep.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch, triton, kernel_decode as kd
torch.manual_seed(0)
dev, dt, B = "cuda", torch.bfloat16, 64
H, K, V, W, d = 6, 96, 192, 4, 768
HK, HV = H * K, H * V
def W_(n, k): return torch.randn(n, k, device=dev, dtype=dt) / k ** .5
def copies(n, k): return [W_(n, k) for _ in range(max(8, -(-256 * 2**20 // (n * k * 2))))]
x = torch.randn(B, d, device=dev, dtype=dt)
nw = torch.ones(d, device=dev, dtype=dt)
win = copies(3472, d); y = torch.empty(B, 3472, device=dev, dtype=dt)
cq = torch.randn(B, W - 1, HK, device=dev, dtype=dt); ck = torch.randn_like(cq); cv = torch.randn(B, W - 1, HV, device=dev, dtype=dt)
wq = torch.randn(HK, W, device=dev, dtype=dt); wk = torch.randn_like(wq); wv = torch.randn(HV, W, device=dev, dtype=dt)
o = torch.randn(B, HV, device=dev, dtype=dt); wo = copies(d, HV); yo = torch.empty(B, d, device=dev, dtype=dt)
ssq = torch.rand(B, H, 6, device=dev) * 10; gate = y[:, 2 * HK + HV:]; onw = torch.ones(V, device=dev, dtype=dt)
wu = copies(4096, d); yu = torch.randn(B, 4096, device=dev, dtype=dt)
wdn = copies(d, 2048)
calls = [
         ("o_proj HEADS+RES", wo, lambda w: kd._rows(o, w, yo, norm_weight=onw, residual=x, heads=(ssq, gate, V))),
         ("up NORM", wu, lambda w: kd._rows(x, w, yu, norm_weight=nw)),
         ("down SWIGLU+RES", wdn, lambda w: kd._rows(yu, w, yo, swiglu=True, residual=x))]
saved = kd._rows_config
print("| call | BM BN BK warps stages | us | TB/s |\n|---|---|---|---|")
for label, ws, fn in calls:
    N, Kw = ws[0].shape
    cfgs = [None] + [(bm, bn, bk, nw_, ns) for bm in (64,) for bn in (16, 32) for bk in (32, 64, 128)
                     for nw_, ns in ((4, 1), (4, 3), (8, 2))]
    for c in cfgs:
        kd._rows_config = saved if c is None else (lambda M, N, K, fp32=False, c=c: c)
        try:
            fn(ws[0])
            us = triton.testing.do_bench_cudagraph(lambda: [fn(w) for w in ws]) * 1e3 / len(ws)
        except Exception as e:
            print(f"| {label} | {c} | {type(e).__name__} | |", flush=True); continue
        print(f"| {label} | {'default ' + str(saved(B, N, Kw)) if c is None else c} | {us:.2f} | {N * Kw * 2 / us / 1e6:.3f} |", flush=True)
kd._rows_config = saved
