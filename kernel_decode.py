"""
Triton kernels for decoding the KLA (or GDN) model one token at a time: the whole block around the KLA step
(kernel.py holds the KLA kernels themselves; this file imports it, model.py uses both).

    kla_decode_mixer        one kernel for any batch: the mixer between its input and output projections (the
                            short convolutions, the norms of q (and for GDN k), eta, the decay, beta, the state
                            step, the output's RMSNorm and SiLU gate); grid (B*H).
    decode_linear           one linear layer as a stream of its weights, with an RMSNorm or SwiGLU before it and
                            a residual add after; at batch 1 grid (N / BN), above it a tensor-core product over
                            the rows (_decode_rows_kernel, grid (N / BN, B / BM)).
    kla_decode_mixer_split  RMSNorm, the mixer and its output projection plus the residual as three kernels: the
                            input projection and the short convolutions (_decode_in_proj_kernel at batch 1,
                            _decode_rows_kernel above), the state step over value blocks (_decode_state_kernel,
                            grid (V / BV, B*H)), the heads' RMSNorm and gate, the output projection and the
                            residual (_decode_out_proj_kernel at batch 1, _decode_rows_kernel above).

The kernels of decode_linear and kla_decode_mixer_split are launched as programmatic dependent launches on
Hopper and later (_pdl_wait). model.GPT decodes with them (GPT._decode_fused); its layers compute the same in
PyTorch.
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
    """Decoding's kernels (but kla_decode_mixer's) are launched as programmatic dependent launches (Hopper; DECODE_PDL): a
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
def _decode_state_kernel(xc, a_log, dt_bias, eta_bias, state, o, ssq, stride_xc, scale, eps, H: tl.constexpr,
                         K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KACZ: tl.constexpr,
                         PDL: tl.constexpr):
    """Decoding, grid (V / BV, B*H): one token's delta-rule step on BV value columns of one (sequence, head)'s
    state (in place), from its row of xc = [q | k | v | gate | eta | decay], the input projection's output
    after its convolutions: q (and for GDN k) normalised, eta, the decay, beta; o (B, H V) the unnormalised
    output, and ssq (B, H, V / BV) the sums of squares of its BV values as o holds them (the output
    projection's kernel applies the head's RMSNorm and gate from them)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_h = i_bh % H
    xc += (i_bh // H) * stride_xc
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    offs = i_bh * K * V + rk[:, None] * V + rv[None, :]
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
    tl.store(o + i_bh * V + rv, out, mask=mv)
    out = tl.where(mv, out.to(tl.float32), 0.)
    tl.store(ssq + i_bh * tl.num_programs(0) + i_v, tl.sum(out * out, 0))


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


@triton.jit
def _decode_rows_kernel(x, w, y, norm_w, res, ssq, gate, cq, ckk, cvv, wq, wk, wv, M, N, K, stride_x, stride_g,
                        norm_eps, NORM: tl.constexpr, SWIGLU: tl.constexpr, HEADS: tl.constexpr, RES: tl.constexpr,
                        CONV: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, V: tl.constexpr, NV: tl.constexpr,
                        W: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                        PDL: tl.constexpr):
    """Decoding at batch M > 1, grid (N / BN, M / BM): Y = H W^T for BM rows (one per sequence) and BN outputs
    a program, as a stream of the weights W (N, K) through a tensor-core product with the rows; what the
    batch-1 kernels do around their products, on rows. H is x, or with NORM RMSNorm(x) * norm_w (the weight
    applied to x, 1 / rms to the product: both are linear in it), or with SWIGLU SiLU(x[:, :K]) * x[:, K:], or
    with HEADS each head's RMSNorm of x (B, H V) from the state kernel's partial sums ssq (B, H, NV), times
    norm_w and SiLU(gate). After the product: + res (RES), or (CONV, the mixer's input projection) the short
    convolutions + SiLU on the q, k, v channels (the first 2 HK + HV outputs), each sequence's buffers shifted
    in place, as _decode_in_proj_kernel does for one."""
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    mm, mn = rm < M, rn < N
    _pdl_wait(PDL)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    sumsq = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        mx = mm[:, None] & mk[None, :]
        h = tl.load(x + rm[:, None] * stride_x + rk[None, :], mask=mx, other=0.).to(tl.float32)
        if SWIGLU:
            h = h * tl.sigmoid(h) * tl.load(x + rm[:, None] * stride_x + K + rk[None, :], mask=mx, other=0.).to(tl.float32)
        if NORM:
            sumsq += tl.sum(h * h, 1)
            h = h * tl.load(norm_w + rk, mask=mk, other=0.).to(tl.float32)[None, :]
        if HEADS:  # each row's sum of squares over the heads this K block touches (K = H V), spread to its columns
            s = tl.zeros([BM, BK], dtype=tl.float32)
            for t in tl.static_range((BK - 1) // V + 2):
                hh = tl.minimum(k0 // V + t, K // V - 1)  # past the last head: only masked columns
                st = tl.zeros([BM], dtype=tl.float32)
                for j in tl.static_range(NV):
                    st += tl.load(ssq + (rm * (K // V) + hh) * NV + j, mask=mm, other=0.)
                s = tl.where((rk // V == hh)[None, :], st[:, None], s)
            gt = tl.load(gate + rm[:, None] * stride_g + rk[None, :], mask=mx, other=0.).to(tl.float32)
            h = h / tl.sqrt(s / V + norm_eps) * tl.load(norm_w + rk % V, mask=mk, other=0.).to(tl.float32)[None, :]
            h = h * gt * tl.sigmoid(gt)
        wt = tl.load(w + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.)
        acc += tl.dot(h.to(wt.dtype), tl.trans(wt), input_precision=PREC)
    if NORM:
        acc *= (1. / tl.sqrt(sumsq / K + norm_eps))[:, None]
    acc = acc.to(y.dtype.element_ty).to(tl.float32)  # rounded as the unfused path rounds the product
    my = mm[:, None] & mn[None, :]
    if RES:
        acc += tl.load(res + rm[:, None] * N + rn[None, :], mask=my, other=0.).to(tl.float32)
    if CONV:
        iq = rn < HK
        ik = (rn >= HK) & (rn < 2 * HK)
        iv = (rn >= 2 * HK) & (rn < 2 * HK + HV)
        conv = iq | ik | iv
        ch = tl.where(iq, rn, tl.where(ik, rn - HK, rn - 2 * HK))  # the output's channel in its q, k or v buffer
        C = tl.where(iv, HV, HK)  # that buffer's row length
        buf = tl.where(iq, cq, tl.where(ik, ckk, cvv)) + ch  # (BN,) pointers: row 0 of the channel's window
        cw = tl.where(iq, wq, tl.where(ik, wk, wv)) + ch * W
        row = buf[None, :] + rm[:, None] * (W - 1) * C[None, :]  # (BM, BN): window row 0; buffers (M, W - 1, C)
        inside = mm[:, None] & conv[None, :]
        yc = acc * tl.load(cw + W - 1, mask=conv, other=0.).to(tl.float32)[None, :]  # the new input, the last tap
        for j in tl.static_range(W - 1):  # window row j: its tap, then row j + 1 (or the new input) moved into it
            cur = tl.load(row + j * C[None, :], mask=inside, other=0.)
            yc += cur.to(tl.float32) * tl.load(cw + j, mask=conv, other=0.).to(tl.float32)[None, :]
            if j < W - 2:
                nxt = tl.load(row + (j + 1) * C[None, :], mask=inside, other=0.)
            else:
                nxt = acc.to(cur.dtype)
            tl.debug_barrier()  # every thread has read row j before it is overwritten (later steps read rows > j)
            tl.store(row + j * C[None, :], nxt, mask=inside)
        acc = tl.where(conv[None, :], yc * tl.sigmoid(yc), acc)
    tl.store(y + rm[:, None] * N + rn[None, :], acc.to(y.dtype.element_ty), mask=my)


# -----------------------------------------------------------------------------
# launch


# Decoding's kernels (decode_linear, kla_decode_mixer_split) as programmatic dependent launches on
# Hopper and later (see _pdl_wait); bench.py --pdl=0 turns it off to time the difference
DECODE_PDL = True


def _pdl(x):
    """The launch options of a decoding kernel: PDL=True with launch_pdl where DECODE_PDL applies."""
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
    mixer's _decode_in_proj_kernel / _decode_out_proj_kernel): all of K requested at once up to 4096 columns,
    2 rows a program, 4 warps up to K = 1024 and 8 above. Measured on an H200 with `python bench.py
    --section=tune_decode` (each weight read from HBM), us a call, this config against the best of 24 (rows
    1-32 x warps 1-8) and cuBLAS: (3472, 768) 3.37 (best) / 4.68; (768, 1152) 2.48 (best) / 5.23; (4096, 768)
    3.62 (best) / 4.85; (768, 2048) 2.85 against 2.84 / 7.54; (50304, 768) 20.2 against 19.5 / 21.9; 8 rows a
    program at 768 columns with 4 warps took 4.0, 3.6, 4.2, 3.6, 21.4. Below 264
    outputs (no GPU-sized model) 16 rows a program, which keeps the tests' tiny models fast in the
    interpreter."""
    BK = min(triton.next_power_of_2(K), 4096)
    if N < 264:
        return 16, BK, 4
    return 2, BK, 4 if BK <= 1024 else 8


def _rows_config(M, N, K, fp32=False):
    """(rows, outputs, K block, warps, stages) a program of _decode_rows_kernel: all M <= 64 rows in one block
    (16 at least, tl.dot's smallest), and outputs a program so that GPT-2 small's projections make 48-400
    programs. K blocks of 64 in float32, so that three stages of the prologues' loads fit in shared memory.
    Below 264 outputs (no GPU-sized model) small blocks, which keep the tests fast in the interpreter."""
    BM = max(16, min(64, triton.next_power_of_2(M)))
    if N < 264:
        return BM, 16, min(64, max(16, triton.next_power_of_2(K))), 4, 1
    return BM, (128 if N >= 16384 else 32 if N >= 2048 else 16), 64 if fp32 else 128, 4, 3


def _rows(x, weight, y, *, norm_weight=None, norm_eps=1e-6, swiglu=False, residual=None, heads=None, conv=None):
    """Launches _decode_rows_kernel on x's B rows: y (B, N) = the product with weight (N, K); heads =
    (ssq, gate, V) of the output projection, conv = (conv_q, conv_k, conv_v, w_q, w_k, w_v) of the input one."""
    (M, _), (N, K) = x.shape, weight.shape
    BM, BN, BK, warps, stages = _rows_config(M, N, K, x.dtype == torch.float32)
    ssq, gate, V = heads if heads is not None else (x, x, 1)
    cq, ckk, cvv, wq, wk, wv = conv if conv is not None else (x,) * 6
    (HK, W), HV = (wq.shape, wv.shape[0]) if conv is not None else ((0, 2), 0)
    _decode_rows_kernel[(triton.cdiv(N, BN), triton.cdiv(M, BM))](
        x, weight, y, x if norm_weight is None else norm_weight, x if residual is None else residual, ssq, gate,
        cq, ckk, cvv, wq, wk, wv, M, N, K, x.stride(0), gate.stride(0), float(norm_eps),
        NORM=norm_weight is not None and heads is None, SWIGLU=bool(swiglu), HEADS=heads is not None,
        RES=residual is not None, CONV=conv is not None, HK=HK, HV=HV, V=V, NV=ssq.shape[-1] if heads else 1,
        W=W, BM=BM, BN=BN, BK=BK,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages, **_pdl(x))
    return y


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
    # A_log, dt_bias, eta_bias as they are (a .float() here would be three copy kernels a layer and token).
    # V in blocks of 64 with 4 warps: the head's whole state as one tile (16 warps) was slower on an H200,
    # 14.3 against 11.8 us a call at batch 1 and 55 against 21 us at batch 64
    _decode_mixer_kernel[(B * H,)](
        xp, conv_q, conv_k, conv_v, w_q.contiguous(), w_k.contiguous(), w_v.contiguous(), A_log.contiguous(),
        dt_bias.contiguous(), eta_bias.contiguous(), norm_weight.contiguous(), state, out,
        xp.stride(0), float(scale), float(eps), float(norm_eps),
        H=H, K=K, V=V, W=W, BK=_block_k(K), BV=min(64, max(16, triton.next_power_of_2(V))),
        BW=max(2, triton.next_power_of_2(W)), KACZ=bool(kaczmarz), num_warps=4)
    return out


def decode_linear(x, weight, *, norm_weight=None, norm_eps=1e-6, swiglu=False, residual=None):
    """One token's linear layer for B sequences as one kernel, for decoding: y = h W^T (+ residual), where h
    is x, or RMSNorm(x) * norm_weight (norm_weight given), or SiLU(a) * b for x = [a | b] (swiglu). x (B, K),
    or (B, 2 K) with swiglu; weight (N, K) as nn.Linear holds it; residual (B, N). Returns (B, N) in x's
    dtype. At batch 1 a stream of the weights (_decode_linear_kernel), above it the same with a tensor-core
    product over the rows (_decode_rows_kernel). model.GPT decodes with it (a norm, a projection and a
    residual add each a kernel otherwise)."""
    N, K = weight.shape
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] != (2 * K if swiglu else K) or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous (B, {2 * K if swiglu else K}) tensor for a weight of shape "
                         f"{(N, K)}{' with swiglu' if swiglu else ''}, got {tuple(x.shape)}")
    B = x.shape[0]
    if not weight.is_contiguous() or weight.dtype != x.dtype:
        raise ValueError(f"weight must be contiguous and of x's dtype {x.dtype}, got {weight.dtype}")
    if norm_weight is not None and swiglu:
        raise ValueError("decode_linear takes norm_weight or swiglu, not both")
    if norm_weight is not None and tuple(norm_weight.shape) != (K,):
        raise ValueError(f"norm_weight must have shape ({K},), got {tuple(norm_weight.shape)}")
    if residual is not None and (tuple(residual.shape) != (B, N) or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous ({B}, {N}) tensor, got {tuple(residual.shape)}")
    y = torch.empty(B, N, device=x.device, dtype=x.dtype)
    if B > 1:
        return _rows(x, weight, y, norm_weight=norm_weight, norm_eps=norm_eps, swiglu=swiglu, residual=residual)
    BN, BK, warps = _linear_config(N, K)
    _decode_linear_kernel[(triton.cdiv(N, BN),)](
        x, weight, y, x if norm_weight is None else norm_weight, x if residual is None else residual, N, K,
        float(norm_eps), NORM=norm_weight is not None, SWIGLU=bool(swiglu), RES=residual is not None, BN=BN, BK=BK,
        ONE=K <= BK, num_warps=warps, **_pdl(x))
    return y


def kla_decode_mixer_split(x, norm1_weight, in_proj_weight, conv_q, conv_k, conv_v, w_q, w_k, w_v, A_log, dt_bias,
                           eta_bias, state, o_norm_weight, o_proj_weight, *, n_head, eps=1e-6, norm_eps=1e-6,
                           o_norm_eps=None, scale=None, kaczmarz=True):
    """One token for B sequences through RMSNorm, the KLA (or GDN) mixer and its output projection, plus the
    residual: x + o_proj(mixer(RMSNorm(x) * norm1_weight)), as three kernels whose middle one splits each head's
    values over programs: the input projection with the short convolutions after it, the state step
    (_decode_state_kernel, grid (V / BV, B H)), the output projection with each head's RMSNorm and SiLU(gate)
    before it and the residual after (at batch 1 _decode_in_proj_kernel and _decode_out_proj_kernel, above it
    _decode_rows_kernel). x (B, d); in_proj_weight (>= 2 H K + 2 H V + 2 H, d), its outputs
    [q | k | v | gate | eta | decay | padding]; the convolution buffers (B, W - 1, channels) and the state
    (B, H, K, V) float32 updated in place; o_proj_weight (d, H V). norm_eps is the input RMSNorm's epsilon,
    o_norm_eps the heads' (norm_eps when None). model.Block computes the same in PyTorch."""
    H = n_head
    o_norm_eps = norm_eps if o_norm_eps is None else o_norm_eps
    (HK, W), HV = w_q.shape, w_v.shape[0]
    K, V = HK // H, HV // H
    B, d = x.shape if x.dim() == 2 else (0, 0)
    if x.dim() != 2 or B < 1 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous (B, d) tensor, got {tuple(x.shape)}")
    for name, t in (("in_proj_weight", in_proj_weight), ("o_proj_weight", o_proj_weight)):
        if not t.is_contiguous() or t.dtype != x.dtype:
            raise ValueError(f"{name} must be contiguous and of x's dtype {x.dtype}, got {t.dtype}")
    if in_proj_weight.shape[1] != d or in_proj_weight.shape[0] < 2 * HK + 2 * HV + 2 * H:
        raise ValueError(f"in_proj_weight must be (>= {2 * HK + 2 * HV + 2 * H}, {d}), got {tuple(in_proj_weight.shape)}")
    if tuple(o_proj_weight.shape) != (d, HV):
        raise ValueError(f"o_proj_weight must be ({d}, {HV}), got {tuple(o_proj_weight.shape)}")
    if not w_q.dtype == w_k.dtype == w_v.dtype:
        raise ValueError(f"the convolution weights must share a dtype, got {w_q.dtype}, {w_k.dtype}, {w_v.dtype}")
    _check_cache(conv_q, conv_k, conv_v, state, B, H, K, V, W, x.dtype)
    N, pdl = in_proj_weight.shape[0], _pdl(x)
    conv = (conv_q, conv_k, conv_v, w_q.contiguous(), w_k.contiguous(), w_v.contiguous())
    xc = torch.empty(B, N, device=x.device, dtype=x.dtype)
    if B > 1:
        _rows(x, in_proj_weight, xc, norm_weight=norm1_weight, norm_eps=norm_eps, conv=conv)
    else:
        BN, BK, warps = _linear_config(N, d)
        if BK < d:
            raise ValueError(f"kla_decode_mixer_split takes a width d <= 4096 at batch 1, got {d}")
        _decode_in_proj_kernel[(triton.cdiv(N, BN),)](
            x, in_proj_weight, norm1_weight, xc, *conv, N, d, float(norm_eps), HK=HK, HV=HV, W=W, BN=BN, BK=BK,
            BW=max(2, triton.next_power_of_2(W)), num_warps=warps, **pdl)
    o = torch.empty(B, HV, device=x.device, dtype=x.dtype)
    BV = 32
    ssq = torch.empty(B, H, triton.cdiv(V, BV), device=x.device, dtype=torch.float32)
    _decode_state_kernel[(triton.cdiv(V, BV), B * H)](
        xc, A_log, dt_bias, eta_bias, state, o, ssq, xc.stride(0), float(K ** -0.5 if scale is None else scale),
        float(eps), H=H, K=K, V=V, BK=_block_k(K), BV=BV, KACZ=bool(kaczmarz), num_warps=4, **pdl)
    y = torch.empty(B, d, device=x.device, dtype=x.dtype)
    gate = xc[:, 2 * HK + HV:]
    if B > 1:
        return _rows(o, o_proj_weight, y, norm_weight=o_norm_weight, norm_eps=o_norm_eps, residual=x,
                     heads=(ssq, gate, V))
    BN, BK, warps = _linear_config(d, HV)
    if BK < HV:
        raise ValueError(f"kla_decode_mixer_split takes H V <= 4096 at batch 1, got {HV}")
    _decode_out_proj_kernel[(triton.cdiv(d, BN),)](
        o, ssq, gate, o_proj_weight, o_norm_weight, x, y, d, HV, float(o_norm_eps), V=V,
        NV=ssq.shape[-1], BN=BN, BK=BK, num_warps=warps, **pdl)
    return y
