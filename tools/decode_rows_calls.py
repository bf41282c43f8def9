"""
_decode_rows_kernel (kernel_decode._rows) at batch 64 on GPT-2 small's decoding calls, each with and without
its prologue / epilogue: us of GPU time a call (do_bench_cudagraph, one copy of the weight, so L2-resident),
the last call with and without programmatic dependent launches.
    python3 tools/decode_rows_calls.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch, triton, kernel_decode as kd
torch.manual_seed(0)
dev, dt, B = "cuda", torch.bfloat16, 64
H, K, V, W, d = 6, 96, 192, 4, 768
HK, HV = H * K, H * V
def bench(label, fn, wbytes):
    fn()
    us = triton.testing.do_bench_cudagraph(fn) * 1e3
    print(f"| {label} | {us:.2f} | {wbytes / us / 1e6:.3f} |", flush=True)
def W_(n, k): return torch.randn(n, k, device=dev, dtype=dt) / k ** .5
x = torch.randn(B, d, device=dev, dtype=dt)
nw = torch.ones(d, device=dev, dtype=dt)
win = W_(3472, d); y = torch.empty(B, 3472, device=dev, dtype=dt)
cq = torch.randn(B, W - 1, HK, device=dev, dtype=dt); ck = torch.randn_like(cq); cv = torch.randn(B, W - 1, HV, device=dev, dtype=dt)
wq = torch.randn(HK, W, device=dev, dtype=dt); wk = torch.randn_like(wq); wv = torch.randn(HV, W, device=dev, dtype=dt)
print("| call | us | TB/s |\n|---|---|---|")
bench("in_proj plain", lambda: kd._rows(x, win, y), win.numel() * 2)
bench("in_proj NORM", lambda: kd._rows(x, win, y, norm_weight=nw), win.numel() * 2)
bench("in_proj NORM+CONV", lambda: kd._rows(x, win, y, norm_weight=nw, conv=(cq, ck, cv, wq, wk, wv)), win.numel() * 2)
o = torch.randn(B, HV, device=dev, dtype=dt); wo = W_(d, HV); yo = torch.empty(B, d, device=dev, dtype=dt)
ssq = torch.rand(B, H, 6, device=dev) * 10; gate = y[:, 2 * HK + HV:]; onw = torch.ones(V, device=dev, dtype=dt)
bench("o_proj plain", lambda: kd._rows(o, wo, yo), wo.numel() * 2)
bench("o_proj RES", lambda: kd._rows(o, wo, yo, residual=x), wo.numel() * 2)
bench("o_proj HEADS+RES", lambda: kd._rows(o, wo, yo, norm_weight=onw, residual=x, heads=(ssq, gate, V)), wo.numel() * 2)
wu = W_(4096, d); yu = torch.empty(B, 4096, device=dev, dtype=dt)
bench("up plain", lambda: kd._rows(x, wu, yu), wu.numel() * 2)
bench("up NORM", lambda: kd._rows(x, wu, yu, norm_weight=nw), wu.numel() * 2)
wdn = W_(d, 2048)
bench("down plain (K 2048)", lambda: kd._rows(yu[:, :2048].contiguous(), wdn, yo), wdn.numel() * 2)
bench("down SWIGLU+RES", lambda: kd._rows(yu, wdn, yo, swiglu=True, residual=x), wdn.numel() * 2)
wl = W_(50304, d); yl = torch.empty(B, 50304, device=dev, dtype=dt)
bench("lm_head NORM", lambda: kd._rows(x, wl, yl, norm_weight=nw), wl.numel() * 2)
for pdl in (True, False):
    kd.DECODE_PDL = pdl
    bench(f"o_proj HEADS+RES pdl={pdl}", lambda: kd._rows(o, wo, yo, norm_weight=onw, residual=x, heads=(ssq, gate, V)), wo.numel() * 2)
