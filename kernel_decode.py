"""
Triton kernels for decoding the KLA (or GDN) model one token at a time: the whole block around the KLA step
(kernel.py holds the KLA kernels themselves; this file imports it, model.py uses both).

    kla_decode_mixer        one kernel for any batch: the mixer between its input and output projections (the
                            short convolutions, the norms of q (and for GDN k), eta, the decay, beta, the state
                            step, the output's RMSNorm and SiLU gate); grid (B*H).
    decode_linear           batch 1: one linear layer as a stream of its weights, with an RMSNorm or SwiGLU
                            before it and a residual add after; grid (N / BN).
    kla_decode_mixer_split  batch 1: RMSNorm, the mixer and its output projection plus the residual as three
                            kernels: the input projection and the short convolutions (_decode_in_proj_kernel), the
                            state step over value blocks (_decode_state_kernel, grid (V / BV, H)), the heads'
                            RMSNorm and gate, the output projection and the residual (_decode_out_proj_kernel).

At batch 1 the kernels are launched as programmatic dependent launches on Hopper and later (_pdl_wait).
model.GPT decodes with them (GPT._decode_fused); its layers compute the same in PyTorch.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from kernel import _beta, _block_k, _delta_step

# -----------------------------------------------------------------------------
# helpers


@triton.jit
def _conv_step(x_new, conv, w, b_off, C, ch, mc, W: tl.constexpr, BW: tl.constexpr):
    """One token of a depthwise causal convolution + SiLU on channels ch of a (B, W - 1, C) buffer holding
    the last W - 1 inputs; the buffer is shifted by one row and x_new appended, in place."""
    rw = tl.arange(0, BW)
    inside = (rw[:, None] < W - 1) & mc[None, :]
    win = tl.load(conv + b_off + rw[:, None] * C + ch[None, :], mask=inside, other=0.).to(tl.float32)
    win = tl.where(rw[:, None] == W - 1, x_new[None, :], win)  # row W - 1: the new input
    wt = tl.load(w + ch[None, :] * W + rw[:, None], mask=(rw[:, None] < W) & mc[None, :], other=0.).to(tl.float32)
    y = tl.sum(win * wt, 0)
    nxt = tl.load(conv + b_off + (rw[:, None] + 1) * C + ch[None, :], mask=(rw[:, None] < W - 2) & mc[None, :],
                  other=0.)
    nxt = tl.where(rw[:, None] == W - 2, x_new[None, :].to(nxt.dtype), nxt)
    tl.debug_barrier()  # every thread has read the window before any row is overwritten
    tl.store(conv + b_off + rw[:, None] * C + ch[None, :], nxt, mask=inside)
    return y * tl.sigmoid(y)


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Batch-1 decoding's kernels are launched as programmatic dependent launches (Hopper; DECODE_PDL): a
    kernel may start while the one before it runs, and requests what no kernel writes (its weights) before
    this wait for the previous kernel's completion and memory; everything else it reads or writes comes
    after. Then it lets the next kernel start. As each kernel lets the next one start only after its own
    wait, a kernel starts only once the kernel two before it has completed."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _decode_mixer_kernel(xp, cq, ckk, cvv, wq, wk, wv, a_log, dt_bias, eta_bias, norm_w, state, out,
                         stride_xb, scale, eps, norm_eps,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, BW: tl.constexpr, KACZ: tl.constexpr):
    """One decoding token through the mixer between its two projections, for one (sequence, head): the
    short convolutions of q, k, v (their buffers shifted in place), q (and for GDN k) normalised, eta and the
    decay from their projections, beta, the delta-rule step on the state (in place), and the output's
    RMSNorm times SiLU(gate). xp is the input projection's output [q | k | v | gate | eta | decay]."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    x_row = xp + i_b * stride_xb
    rk = tl.arange(0, BK)
    mk = rk < K
    ch_k = i_h * K + rk
    q = _conv_step(tl.load(x_row + ch_k, mask=mk, other=0.).to(tl.float32), cq, wq, i_b * (W - 1) * H * K,
                   H * K, ch_k, mk, W, BW)
    k = _conv_step(tl.load(x_row + H * K + ch_k, mask=mk, other=0.).to(tl.float32), ckk, wk,
                   i_b * (W - 1) * H * K, H * K, ch_k, mk, W, BW)
    q = tl.where(mk, q, 0.) / tl.maximum(tl.sqrt(tl.sum(tl.where(mk, q * q, 0.), 0)), 1e-12)
    k = tl.where(mk, k, 0.)
    if not KACZ:
        k = k / tl.maximum(tl.sqrt(tl.sum(k * k, 0)), 1e-12)
    eta = tl.sigmoid(tl.load(x_row + 2 * H * K + 2 * H * V + i_h).to(tl.float32)
                     + tl.load(eta_bias + i_h).to(tl.float32))
    a = tl.load(x_row + 2 * H * K + 2 * H * V + H + i_h).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32)
    g = -tl.exp(tl.load(a_log + i_h).to(tl.float32)) * tl.where(a > 20., a, tl.log(1. + tl.exp(a)))  # softplus
    beta = _beta(tl.sum(k * k, 0), eta, eps, KACZ)
    decay = tl.exp(g)
    sumsq = 0.
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        mv = rv < V
        ch_v = i_h * V + rv
        v = _conv_step(tl.load(x_row + 2 * H * K + ch_v, mask=mv, other=0.).to(tl.float32), cvv, wv,
                       i_b * (W - 1) * H * V, H * V, ch_v, mv, W, BW)
        offs = i_bh * K * V + rk[:, None] * V + rv[None, :]
        ms = mk[:, None] & mv[None, :]
        S, o = _delta_step(tl.load(state + offs, mask=ms, other=0.), decay, q, k, tl.where(mv, v, 0.), beta, scale)
        tl.store(state + offs, S, mask=ms)  # each element written by the thread that read it
        sumsq += tl.sum(tl.where(mv, o * o, 0.), 0)
        tl.store(out + i_bh * V + rv, o.to(out.dtype.element_ty), mask=mv)
    rstd = 1. / tl.sqrt(sumsq / V + norm_eps)
    tl.debug_barrier()  # the unnormalised output is read back by other threads
    for i_v in range(tl.cdiv(V, BV)):
        rv = i_v * BV + tl.arange(0, BV)
        mv = rv < V
        o = tl.load(out + i_bh * V + rv, mask=mv, other=0.).to(tl.float32)
        gate = tl.load(x_row + 2 * H * K + H * V + i_h * V + rv, mask=mv, other=0.).to(tl.float32)
        y = o * rstd * tl.load(norm_w + rv, mask=mv, other=0.).to(tl.float32) * gate * tl.sigmoid(gate)
        tl.store(out + i_bh * V + rv, y.to(out.dtype.element_ty), mask=mv)


@triton.jit
def _decode_linear_kernel(x, w, y, norm_w, res, N, K, norm_eps, NORM: tl.constexpr, SWIGLU: tl.constexpr,
                          RES: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ONE: tl.constexpr,
                          PDL: tl.constexpr):
    """y = W h (+ res) for one token, BN outputs a program: W (N, K) row-major (nn.Linear's weight); h is x,
    or RMSNorm(x) * norm_w (NORM), or SiLU(x[:K]) * x[K:] (SWIGLU). At batch 1 the product is a stream of
    the weights: with K <= BK (ONE) each program requests its rows whole, before anything else, so that
    their latency overlaps the input's; else it walks K in blocks of BK. PDL (launched as a programmatic
    dependent launch): the weights, which no kernel writes, are requested before waiting for the previous
    kernel (_pdl_wait), so that they stream in while it finishes."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    mn = rn < N
    if ONE:
        rk = tl.arange(0, BK)
        mk = rk < K
        wt = tl.load(w + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.)
        _pdl_wait(PDL)
        h = tl.load(x + rk, mask=mk, other=0.).to(tl.float32)
        if SWIGLU:
            h = h * tl.sigmoid(h) * tl.load(x + K + rk, mask=mk, other=0.).to(tl.float32)
        if NORM:
            h = h / tl.sqrt(tl.sum(h * h, 0) / K + norm_eps) * tl.load(norm_w + rk, mask=mk, other=0.).to(tl.float32)
        h = h.to(x.dtype.element_ty).to(tl.float32)  # rounded as the unfused path rounds it
        acc = tl.sum(wt.to(tl.float32) * h[None, :], 1)
    else:
        _pdl_wait(PDL)
        rstd = 1.
        if NORM:
            sumsq = tl.zeros([BK], dtype=tl.float32)
            for k0 in range(0, K, BK):
                rk = k0 + tl.arange(0, BK)
                h = tl.load(x + rk, mask=rk < K, other=0.).to(tl.float32)
                sumsq += h * h
            rstd = 1. / tl.sqrt(tl.sum(sumsq, 0) / K + norm_eps)
        acc = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            mk = rk < K
            wt = tl.load(w + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.)
            h = tl.load(x + rk, mask=mk, other=0.).to(tl.float32)
            if SWIGLU:
                h = h * tl.sigmoid(h) * tl.load(x + K + rk, mask=mk, other=0.).to(tl.float32)
            if NORM:
                h = h * rstd * tl.load(norm_w + rk, mask=mk, other=0.).to(tl.float32)
            h = h.to(x.dtype.element_ty).to(tl.float32)
            acc += tl.sum(wt.to(tl.float32) * h[None, :], 1)
    if RES:
        acc = acc.to(y.dtype.element_ty).to(tl.float32) + tl.load(res + rn, mask=mn, other=0.).to(tl.float32)
    tl.store(y + rn, acc.to(y.dtype.element_ty), mask=mn)


@triton.jit
def _decode_in_proj_kernel(x, w, norm_w, y, cq, ckk, cvv, wq, wk, wv, N, K, norm_eps, HK: tl.constexpr,
                           HV: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr,
                           PDL: tl.constexpr):
    """Batch-1 decoding, the mixer's input projection with what surrounds it, BN outputs a program (K <= BK):
    y = W (RMSNorm(x) * norm_w), then on the q, k, v channels (the first 2 HK + HV outputs) the short
    convolutions + SiLU, their buffers shifted in place (each channel is one program's), so that the state
    kernel after it can split a head's values over programs without racing on the buffers. Each output row
    finds its channel's buffer and weights by pointer (one convolution step for q, k and v rows alike), and
    they are requested with the weights, before the wait: only this kernel writes the buffers, at the
    previous token, which completed before the kernel this one waits for started (_pdl_wait)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    mn = rn < N
    rk = tl.arange(0, BK)
    mk = rk < K
    wt = tl.load(w + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.)
    iq = rn < HK
    ik = (rn >= HK) & (rn < 2 * HK)
    iv = (rn >= 2 * HK) & (rn < 2 * HK + HV)
    conv = iq | ik | iv
    ch = tl.where(iq, rn, tl.where(ik, rn - HK, rn - 2 * HK))  # the row's channel in its q, k or v buffer
    C = tl.where(iv, HV, HK)  # that buffer's row length
    buf = tl.where(iq, cq, tl.where(ik, ckk, cvv)) + ch  # (BN,) pointers: row 0 of the channel's window
    cw = tl.where(iq, wq, tl.where(ik, wk, wv)) + ch * W
    rw = tl.arange(0, BW)
    inside = (rw[:, None] < W - 1) & conv[None, :]
    win = tl.load(buf[None, :] + rw[:, None] * C[None, :], mask=inside, other=0.)  # (BW, BN), the last W - 1 inputs
    nxt = tl.load(buf[None, :] + (rw[:, None] + 1) * C[None, :], mask=(rw[:, None] < W - 2) & conv[None, :], other=0.)
    cwt = tl.load(cw[None, :] + rw[:, None], mask=(rw[:, None] < W) & conv[None, :], other=0.).to(tl.float32)
    _pdl_wait(PDL)
    h = tl.load(x + rk, mask=mk, other=0.).to(tl.float32)
    h = h / tl.sqrt(tl.sum(h * h, 0) / K + norm_eps) * tl.load(norm_w + rk, mask=mk, other=0.).to(tl.float32)
    h = h.to(x.dtype.element_ty).to(tl.float32)  # rounded as the unfused path rounds it
    acc = tl.sum(wt.to(tl.float32) * h[None, :], 1).to(y.dtype.element_ty).to(tl.float32)
    win = tl.where(rw[:, None] == W - 1, acc[None, :], win.to(tl.float32))  # row W - 1: the new input
    yc = tl.sum(win * cwt, 0)
    nxt = tl.where(rw[:, None] == W - 2, acc[None, :].to(nxt.dtype), nxt)  # the window shifted by one row
    tl.debug_barrier()  # every thread has read the window before any row is overwritten
    tl.store(buf[None, :] + rw[:, None] * C[None, :], nxt, mask=inside)
    acc = tl.where(conv, yc * tl.sigmoid(yc), acc)
    tl.store(y + rn, acc.to(y.dtype.element_ty), mask=mn)


@triton.jit
def _decode_state_kernel(xc, a_log, dt_bias, eta_bias, state, o, ssq, scale, eps, H: tl.constexpr,
                         K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KACZ: tl.constexpr,
                         PDL: tl.constexpr):
    """Batch-1 decoding, grid (V / BV, H): one token's delta-rule step on BV value columns of one head's state
    (in place), from xc = [q | k | v | gate | eta | decay], the input projection's output after its
    convolutions: q (and for GDN k) normalised, eta, the decay, beta; o the unnormalised output, and ssq
    (H, V / BV) the sums of squares of its BV values as o holds them (the output projection's kernel applies
    the head's RMSNorm and gate from them)."""
    i_v, i_h = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    offs = i_h * K * V + rk[:, None] * V + rv[None, :]
    ms = mk[:, None] & mv[None, :]
    # first: it does not depend on the rest (with PDL, before the wait: the state's last writer is this
    # kernel at the previous token, complete before the kernel this one waits for started: see _pdl_wait)
    S = tl.load(state + offs, mask=ms, other=0.)
    _pdl_wait(PDL)
    q = tl.load(xc + i_h * K + rk, mask=mk, other=0.).to(tl.float32)
    k = tl.load(xc + H * K + i_h * K + rk, mask=mk, other=0.).to(tl.float32)
    v = tl.load(xc + 2 * H * K + i_h * V + rv, mask=mv, other=0.).to(tl.float32)
    eta = tl.sigmoid(tl.load(xc + 2 * H * K + 2 * H * V + i_h).to(tl.float32) + tl.load(eta_bias + i_h).to(tl.float32))
    a = tl.load(xc + 2 * H * K + 2 * H * V + H + i_h).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32)
    g = -tl.exp(tl.load(a_log + i_h).to(tl.float32)) * tl.where(a > 20., a, tl.log(1. + tl.exp(a)))  # softplus
    q = q / tl.maximum(tl.sqrt(tl.sum(q * q, 0)), 1e-12)
    if not KACZ:
        k = k / tl.maximum(tl.sqrt(tl.sum(k * k, 0)), 1e-12)
    beta = _beta(tl.sum(k * k, 0), eta, eps, KACZ)
    S, out = _delta_step(S, tl.exp(g), q, k, v, beta, scale)
    tl.store(state + offs, S, mask=ms)  # each element written by the thread that read it
    out = out.to(o.dtype.element_ty)
    tl.store(o + i_h * V + rv, out, mask=mv)
    out = tl.where(mv, out.to(tl.float32), 0.)
    tl.store(ssq + i_h * tl.num_programs(0) + i_v, tl.sum(out * out, 0))


@triton.jit
def _decode_out_proj_kernel(o, ssq, gate, w, norm_w, res, y, N, K, norm_eps, V: tl.constexpr, NV: tl.constexpr,
                            BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    """Batch-1 decoding, the mixer's output projection with what precedes and follows it, BN outputs a
    program (K = H V <= BK): y = W (RMSNorm of each head's V values of o * norm_w * SiLU(gate)) + res, each
    head's mean square from the state kernel's NV partial sums ssq (H, NV)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    mn = rn < N
    rk = tl.arange(0, BK)
    mk = rk < K
    wt = tl.load(w + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.)
    _pdl_wait(PDL)
    h = tl.load(o + rk, mask=mk, other=0.).to(tl.float32)
    gt = tl.load(gate + rk, mask=mk, other=0.).to(tl.float32)
    head = rk // V
    sumsq = tl.zeros([BK], dtype=tl.float32)
    for j in tl.static_range(NV):  # each column's head's sum of squares: NV independent (cached) loads
        sumsq += tl.load(ssq + head * NV + j, mask=mk, other=0.)
    h = h / tl.sqrt(sumsq / V + norm_eps) * tl.load(norm_w + rk % V, mask=mk, other=0.).to(tl.float32) * gt * tl.sigmoid(gt)
    h = h.to(o.dtype.element_ty).to(tl.float32)
    acc = tl.sum(wt.to(tl.float32) * h[None, :], 1).to(y.dtype.element_ty).to(tl.float32)
    acc += tl.load(res + rn, mask=mn, other=0.).to(tl.float32)
    tl.store(y + rn, acc.to(y.dtype.element_ty), mask=mn)


# -----------------------------------------------------------------------------
# launch


# Batch-1 decoding's kernels (decode_linear, kla_decode_mixer_split) as programmatic dependent launches on
# Hopper and later (see _pdl_wait); bench.py --pdl=0 turns it off to time the difference
DECODE_PDL = True


def _pdl(x):
    """The launch options of a batch-1 decoding kernel: PDL=True with launch_pdl where DECODE_PDL applies."""
    on = (DECODE_PDL and x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"
          and _pdl_device(x.device.index if x.device.index is not None else torch.cuda.current_device()))
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


@functools.lru_cache
def _pdl_device(index):
    """Whether this GPU (compute capability 9 or more) and this Triton (gdc_wait, the launch_pdl option) do PDL."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        triton_has = hasattr(tl.extra.cuda, "gdc_wait") and "launch_pdl" in CUDAOptions.__dataclass_fields__
    except (ImportError, AttributeError):
        triton_has = False
    return triton_has and torch.cuda.get_device_capability(index)[0] >= 9


def _linear_config(N, K):
    """(rows a program, K block, warps) of the batch-1 decoding projections (_decode_linear_kernel and the
    mixer's _decode_in_proj_kernel / _decode_out_proj_kernel): all of K requested at once up to 4096 columns.
    Chosen inside the whole decoding token on an H200 (GPT-2 small, CUDA graph; `python tools/decode_config.py
    --sweep --from=2rows --prompt=64`: each projection's rows 1-16 x warps 1-8 with the others at 2 rows and 4
    warps, 8 from K = 2048, ms a token against 0.2515 for those): 8 rows and 4 warps for the wide outputs, the
    MLP's (4096, 768) 0.2407 and lm_head (50304, 768) 0.2407; 8 rows and 8 warps for the model's width as
    output, the mixer's (768, 1152) 0.2405 and the MLP's (768, 2048) 0.2504; 2 rows and 4 warps kept for the
    mixer's (3472, 768), where 8 rows took 0.2568. Against 2 rows and 4 warps everywhere (8 from K = 2048) in
    one process (`python tools/decode_config.py`): 0.229 against 0.251 ms a token (0.911-0.925x in five
    alternating rounds, GDN 0.912-0.918x). Timed alone with each weight read from HBM (`python bench.py
    --section=tune_decode`), 2 rows were the fastest at every shape: a call's own time is not what a token of
    dependent launches waits for. A second sweep from that configuration (`python tools/decode_config.py --sweep
    --prompt=64`, results/bench_h200/decode_config.md) moved three: the MLP's (4096, 768) to 4 rows and 1 warp,
    the mixer's (768, 1152) to 4 rows and the MLP's (768, 2048) to 16 rows (8 warps each); together 0.2191-0.2196
    against 0.2276-0.2282 ms a token in five alternating rounds (0.961-0.964x); lm_head kept (4 rows within 0.6 %).
    Below 264 outputs (no GPU-sized model) 16 rows a program, which keeps the tests' tiny models fast in the
    interpreter."""
    BK = min(triton.next_power_of_2(K), 4096)
    if N < 264:
        return 16, BK, 4
    if N >= 8192:
        return 8, BK, 4
    if N >= 4096:
        return 4, BK, 1
    if N <= 1024:
        return (4 if K < 2048 else 16), BK, 8
    return 2, BK, 4 if BK <= 1024 else 8


def _mixer_config(V):
    """(value columns a step, warps) of the one-kernel mixer (_decode_mixer_kernel, batch > 1): V in blocks of 64
    with 4 warps. The head's whole state as one tile (16 warps) was slower on an H200, 14.3 against 11.8 us a call
    at batch 1 and 55 against 21 us at batch 64."""
    return min(64, max(16, triton.next_power_of_2(V))), 4


def _state_config(V):
    """(value columns a program, warps) of the batch-1 state kernel (_decode_state_kernel): 32 columns, 4 warps
    (d_v 192: 36 programs for the 6 heads). In the sweep of _linear_config, 16 or 64 columns at 1-8 warps and 32
    at 1, 2 or 8 took 1.000-1.105x the token's time."""
    return 32, 4


def _check_cache(conv_q, conv_k, conv_v, state, B, H, K, V, W, dtype):
    """The decoding cache that the kernels update in place: the convolutions' buffers (B, W - 1, channels) in
    the activations' dtype and the state (B, H, K, V) in float32, all contiguous."""
    for name, buf, shape, dt in (("conv_q", conv_q, (B, W - 1, H * K), dtype),
                                 ("conv_k", conv_k, (B, W - 1, H * K), dtype),
                                 ("conv_v", conv_v, (B, W - 1, H * V), dtype),
                                 ("state", state, (B, H, K, V), torch.float32)):
        if tuple(buf.shape) != shape or not buf.is_contiguous() or buf.dtype != dt:
            raise ValueError(f"{name} must be a contiguous {dt} tensor of shape {shape}, got "
                             f"{buf.dtype} {tuple(buf.shape)}{'' if buf.is_contiguous() else ' (strided)'}")


def kla_decode_mixer(xp, conv_q, conv_k, conv_v, w_q, w_k, w_v, A_log, dt_bias, eta_bias, norm_weight, state, *,
                     n_head, eps=1e-6, norm_eps=1e-6, scale=None, kaczmarz=True):
    """One decoding token through the KLA (or GDN) mixer between its input and output projections, as one
    kernel: xp (B, 2 H K + 2 H V + 2 H) the input projection's output [q | k | v | gate | eta | decay]; the
    short convolutions' buffers conv_q, conv_k (B, W - 1, H K), conv_v (B, W - 1, H V) (the last W - 1 inputs,
    in xp's dtype) and their weights (channels, W); A_log, dt_bias, eta_bias (H,); norm_weight (V,) of the
    output RMSNorm; state (B, H, K, V) float32. The buffers and the state are updated in place; returns the
    gated, normalised output (B, H V) in xp's dtype. model.DeltaMixer computes the same in PyTorch;
    model.GPT decodes with it at batch > 1."""
    B, H = xp.shape[0], n_head
    (HK, W), HV = w_q.shape, w_v.shape[0]  # the layer's sizes, from its convolution weights
    K, V = HK // H, HV // H
    if HK % H or HV % H or W < 2 or w_k.shape != (HK, W) or w_v.shape != (HV, W):
        raise ValueError(f"convolution weights must be (H K, W), (H K, W), (H V, W) with W >= 2 and H = {H}, got "
                         f"{tuple(w_q.shape)}, {tuple(w_k.shape)}, {tuple(w_v.shape)}")
    if xp.dim() != 2 or xp.shape[1] != 2 * H * K + 2 * H * V + 2 * H or xp.stride(1) != 1:
        raise ValueError(f"xp must be (B, 2 H K + 2 H V + 2 H) = ({B}, {2 * H * K + 2 * H * V + 2 * H}) with unit "
                         f"column stride, got {tuple(xp.shape)} strides {xp.stride()}")
    _check_cache(conv_q, conv_k, conv_v, state, B, H, K, V, W, xp.dtype)
    out = torch.empty(B, H * V, device=xp.device, dtype=xp.dtype)
    scale = K ** -0.5 if scale is None else scale
    # A_log, dt_bias, eta_bias as they are (a .float() here would be three copy kernels a layer and token)
    BV, warps = _mixer_config(V)
    _decode_mixer_kernel[(B * H,)](
        xp, conv_q, conv_k, conv_v, w_q.contiguous(), w_k.contiguous(), w_v.contiguous(), A_log.contiguous(),
        dt_bias.contiguous(), eta_bias.contiguous(), norm_weight.contiguous(), state, out,
        xp.stride(0), float(scale), float(eps), float(norm_eps),
        H=H, K=K, V=V, W=W, BK=_block_k(K), BV=BV, BW=max(2, triton.next_power_of_2(W)), KACZ=bool(kaczmarz),
        num_warps=warps)
    return out


def decode_linear(x, weight, *, norm_weight=None, norm_eps=1e-6, swiglu=False, residual=None):
    """One token's linear layer as one kernel, for decoding at batch 1: y = h W^T (+ residual), where h is
    x, or RMSNorm(x) * norm_weight (norm_weight given), or SiLU(a) * b for x = [a | b] (swiglu). x (1, K),
    or (1, 2 K) with swiglu; weight (N, K) as nn.Linear holds it; residual (1, N). Returns (1, N) in x's
    dtype. model.GPT decodes with it at batch 1 (a norm, a projection and a residual add each a kernel otherwise)."""
    N, K = weight.shape
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != (2 * K if swiglu else K) or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous (1, {2 * K if swiglu else K}) tensor for a weight of shape "
                         f"{(N, K)}{' with swiglu' if swiglu else ''}, got {tuple(x.shape)}")
    if not weight.is_contiguous() or weight.dtype != x.dtype:
        raise ValueError(f"weight must be contiguous and of x's dtype {x.dtype}, got {weight.dtype}")
    if norm_weight is not None and swiglu:
        raise ValueError("decode_linear takes norm_weight or swiglu, not both")
    if norm_weight is not None and tuple(norm_weight.shape) != (K,):
        raise ValueError(f"norm_weight must have shape ({K},), got {tuple(norm_weight.shape)}")
    if residual is not None and (tuple(residual.shape) != (1, N) or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous (1, {N}) tensor, got {tuple(residual.shape)}")
    y = torch.empty(1, N, device=x.device, dtype=x.dtype)
    BN, BK, warps = _linear_config(N, K)
    _decode_linear_kernel[(triton.cdiv(N, BN),)](
        x, weight, y, x if norm_weight is None else norm_weight, x if residual is None else residual, N, K,
        float(norm_eps), NORM=norm_weight is not None, SWIGLU=bool(swiglu), RES=residual is not None, BN=BN, BK=BK,
        ONE=K <= BK, num_warps=warps, **_pdl(x))
    return y


def kla_decode_mixer_split(x, norm1_weight, in_proj_weight, conv_q, conv_k, conv_v, w_q, w_k, w_v, A_log, dt_bias,
                           eta_bias, state, o_norm_weight, o_proj_weight, *, n_head, eps=1e-6, norm_eps=1e-6,
                           o_norm_eps=None, scale=None, kaczmarz=True):
    """One token at batch 1 through RMSNorm, the KLA (or GDN) mixer and its output projection, plus the
    residual: x + o_proj(mixer(RMSNorm(x) * norm1_weight)), as three kernels whose middle one splits each head's
    values over programs: the input projection with the short convolutions after it (_decode_in_proj_kernel),
    the state step (_decode_state_kernel, grid (V / BV, H)), the output projection with each head's RMSNorm
    and SiLU(gate) before it and the residual after (_decode_out_proj_kernel). x (1, d); in_proj_weight
    (>= 2 H K + 2 H V + 2 H, d), its outputs [q | k | v | gate | eta | decay | padding]; the convolution
    buffers (1, W - 1, channels) and the state (1, H, K, V) float32 updated in place; o_proj_weight (d, H V).
    norm_eps is the input RMSNorm's epsilon, o_norm_eps the heads' (norm_eps when None).
    model.Block computes the same in PyTorch."""
    H = n_head
    o_norm_eps = norm_eps if o_norm_eps is None else o_norm_eps
    (HK, W), HV = w_q.shape, w_v.shape[0]
    K, V = HK // H, HV // H
    d = x.shape[-1]
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous (1, d) tensor, got {tuple(x.shape)}")
    for name, t in (("in_proj_weight", in_proj_weight), ("o_proj_weight", o_proj_weight)):
        if not t.is_contiguous() or t.dtype != x.dtype:
            raise ValueError(f"{name} must be contiguous and of x's dtype {x.dtype}, got {t.dtype}")
    if in_proj_weight.shape[1] != d or in_proj_weight.shape[0] < 2 * HK + 2 * HV + 2 * H:
        raise ValueError(f"in_proj_weight must be (>= {2 * HK + 2 * HV + 2 * H}, {d}), got {tuple(in_proj_weight.shape)}")
    if tuple(o_proj_weight.shape) != (d, HV):
        raise ValueError(f"o_proj_weight must be ({d}, {HV}), got {tuple(o_proj_weight.shape)}")
    if not w_q.dtype == w_k.dtype == w_v.dtype:
        raise ValueError(f"the convolution weights must share a dtype, got {w_q.dtype}, {w_k.dtype}, {w_v.dtype}")
    _check_cache(conv_q, conv_k, conv_v, state, 1, H, K, V, W, x.dtype)
    N, pdl = in_proj_weight.shape[0], _pdl(x)
    xc = torch.empty(1, N, device=x.device, dtype=x.dtype)
    BN, BK, warps = _linear_config(N, d)
    if BK < d:
        raise ValueError(f"kla_decode_mixer_split takes a width d <= 4096, got {d}")
    _decode_in_proj_kernel[(triton.cdiv(N, BN),)](
        x, in_proj_weight, norm1_weight, xc, conv_q, conv_k, conv_v, w_q.contiguous(), w_k.contiguous(),
        w_v.contiguous(), N, d, float(norm_eps), HK=HK, HV=HV, W=W, BN=BN, BK=BK,
        BW=max(2, triton.next_power_of_2(W)), num_warps=warps, **pdl)
    o = torch.empty(1, HV, device=x.device, dtype=x.dtype)
    BV, warps = _state_config(V)
    ssq = torch.empty(H, triton.cdiv(V, BV), device=x.device, dtype=torch.float32)
    _decode_state_kernel[(triton.cdiv(V, BV), H)](
        xc, A_log, dt_bias, eta_bias, state, o, ssq, float(K ** -0.5 if scale is None else scale), float(eps),
        H=H, K=K, V=V, BK=_block_k(K), BV=BV, KACZ=bool(kaczmarz), num_warps=warps, **pdl)
    y = torch.empty(1, d, device=x.device, dtype=x.dtype)
    BN, BK, warps = _linear_config(d, HV)
    if BK < HV:
        raise ValueError(f"kla_decode_mixer_split takes H V <= 4096, got {HV}")
    _decode_out_proj_kernel[(triton.cdiv(d, BN),)](
        o, ssq, xc[:, 2 * HK + HV:], o_proj_weight, o_norm_weight, x, y, d, HV, float(o_norm_eps), V=V,
        NV=ssq.shape[1], BN=BN, BK=BK, num_warps=warps, **pdl)
    return y
