"""
Triton kernels for decoding the KLA (or GDN) model one token at a time: the whole block around the KLA step
(kernel.py holds the KLA kernels themselves; this file imports it, model.py uses both).

    kla_decode_mixer        one kernel for any batch: the mixer between its input and output projections (the
                            short convolutions, the norms of q (and for GDN k), eta, the decay, beta, the state
                            step, the output's RMSNorm and SiLU gate); grid (B*H).
    decode_linear           batch 1: one linear layer as a stream of its weights, with an RMSNorm before it
                            (the head); grid (N / BN).
    kla_decode_block        batch 1: a whole block (RMSNorm, the mixer and its projections, the residual, RMSNorm,
                            the MLP, the residual) as three kernels: the input projection and the short
                            convolutions (_decode_in_proj_kernel); the state step over value blocks, each adding
                            its share of the output projection atomically (_decode_state_kernel, grid (V / BV, H));
                            the heads' RMSNorm, the residual and the MLP, each program adding its hidden units'
                            share of the output atomically (_decode_mlp_kernel).

At batch 1 the kernels are launched as programmatic dependent launches on Hopper and later (_pdl_wait).
engine.py's Engine decodes with them (Engine._decode_fused); its layers compute the same in PyTorch.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from kernel import _beta, _block_k, _delta_step

# -----------------------------------------------------------------------------
# launch configurations: one row per (kernel, case) with the reason; _decode_config picks the case from the shape.
# Chosen inside the whole decoding token (GPT-2 small, CUDA graph), not per call; docs/kernel.md, "Choices".

DECODE_CONFIGS = {
    # _decode_linear_kernel and _decode_in_proj_kernel (batch 1): BN rows a program, all of K up to 4096 at once
    ("linear", "N < 264"): dict(BN=16, num_warps=4),  # no GPU-sized model: keeps tiny models fast in the interpreter
    ("linear", "N >= 8192"): dict(BN=8, num_warps=4),  # lm_head (50304, 768)
    ("linear", "N >= 4096"): dict(BN=4, num_warps=1),  # the MLP's (4096, 768)
    ("linear", "N <= 1024, K < 2048"): dict(BN=4, num_warps=8),  # the mixer's output projection (768, 1152)
    ("linear", "N <= 1024, K >= 2048"): dict(BN=16, num_warps=8),  # the MLP's down projection (768, 2048)
    ("linear", "K <= 1024"): dict(BN=8, num_warps=1),  # the block's input projection (3472, 768)
    ("linear", "K > 1024"): dict(BN=2, num_warps=8),  # the sweeps' starting point; no projection of the model
    # _decode_mixer_kernel (batch > 1): BV value columns a step, at most V's power of two
    ("mixer", "any"): dict(BV=64, num_warps=4),  # the head's whole state as one tile (16 warps) was slower
    # _decode_state_kernel (batch 1): BV value columns a program
    ("state", "any"): dict(BV=16, num_warps=8),  # 72 programs at d_v 192; its share of the output held in registers
    # _decode_mlp_kernel (batch 1): BF hidden units a program
    ("mlp", "any"): dict(BF=16, num_warps=8),  # 128 programs at F 2048, each adding its share atomically
}


def _decode_config(name, N=0, K=0, V=0, F=0):
    """The launch values of DECODE_CONFIGS's row for kernel `name`: a linear layer's N outputs and K inputs (its BK
    added), a head's V value columns, or the MLP's F hidden units."""
    case = "any"
    if name == "linear":
        case = ("N < 264" if N < 264 else "N >= 8192" if N >= 8192 else "N >= 4096" if N >= 4096 else
                ("N <= 1024, K < 2048" if K < 2048 else "N <= 1024, K >= 2048") if N <= 1024 else
                "K <= 1024" if K <= 1024 else "K > 1024")
    row = dict(DECODE_CONFIGS[name, case])
    if name == "linear":
        row["BK"] = min(triton.next_power_of_2(K), 4096)
    if "BV" in row:
        row["BV"] = min(row["BV"], max(16, triton.next_power_of_2(V)))
    return row


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
def _decode_linear_kernel(x, w, y, norm_w, N, K, norm_eps, NORM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          ONE: tl.constexpr, PDL: tl.constexpr):
    """y = W h for one token, BN outputs a program: W (N, K) row-major (nn.Linear's weight); h is x, or
    RMSNorm(x) * norm_w (NORM). At batch 1 the product is a stream of the weights: with K <= BK (ONE) each
    program requests its rows whole, before anything else, so that their latency overlaps the input's; else it
    walks K in blocks of BK. PDL (launched as a programmatic dependent launch): the weights, which no kernel
    writes, are requested before waiting for the previous kernel (_pdl_wait), so that they stream in while it
    finishes."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    mn = rn < N
    if ONE:
        rk = tl.arange(0, BK)
        mk = rk < K
        wt = tl.load(w + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mn[:, None] & mk[None, :], other=0.)
        _pdl_wait(PDL)
        h = tl.load(x + rk, mask=mk, other=0.).to(tl.float32)
        if NORM:
            h = h / tl.sqrt(tl.sum(h * h, 0) / K + norm_eps) * tl.load(norm_w + rk, mask=mk, other=0.).to(tl.float32)
        h = h.to(w.dtype.element_ty).to(tl.float32)  # rounded as the unfused path rounds it
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
            if NORM:
                h = h * rstd * tl.load(norm_w + rk, mask=mk, other=0.).to(tl.float32)
            h = h.to(w.dtype.element_ty).to(tl.float32)
            acc += tl.sum(wt.to(tl.float32) * h[None, :], 1)
    tl.store(y + rn, acc.to(y.dtype.element_ty), mask=mn)


@triton.jit
def _decode_in_proj_kernel(x, w, norm_w, y, cq, ckk, cvv, wq, wk, wv, zero, N, K, norm_eps, n_zero, HK: tl.constexpr,
                           HV: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr,
                           BZ: tl.constexpr, PDL: tl.constexpr):
    """Batch-1 decoding, the mixer's input projection with what surrounds it, BN outputs a program (K <= BK):
    y = W (RMSNorm(x) * norm_w), then on the q, k, v channels (the first 2 HK + HV outputs) the short
    convolutions + SiLU, their buffers shifted in place (each channel is one program's), so that the state
    kernel after it can split a head's values over programs without racing on the buffers. Each output row
    finds its channel's buffer and weights by pointer (one convolution step for q, k and v rows alike), and
    they are requested with the weights, before the wait: only this kernel writes the buffers, at the
    previous token, which completed before the kernel this one waits for started (_pdl_wait). Program 0 also
    zeroes the n_zero floats at zero (BZ at a time: the accumulators that the block's next two kernels add into)."""
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
    if tl.program_id(0) == 0:
        for z0 in range(0, n_zero, BZ):
            rz = z0 + tl.arange(0, BZ)
            tl.store(zero + rz, tl.zeros([BZ], dtype=tl.float32), mask=rz < n_zero)
    h = tl.load(x + rk, mask=mk, other=0.).to(tl.float32)
    # RMSNorm's scale after the product, so that the sum of squares and the product reduce at once
    hw = h * tl.load(norm_w + rk, mask=mk, other=0.).to(tl.float32)
    acc = tl.sum(wt.to(tl.float32) * hw[None, :], 1) / tl.sqrt(tl.sum(h * h, 0) / K + norm_eps)
    acc = acc.to(y.dtype.element_ty).to(tl.float32)
    win = tl.where(rw[:, None] == W - 1, acc[None, :], win.to(tl.float32))  # row W - 1: the new input
    yc = tl.sum(win * cwt, 0)
    nxt = tl.where(rw[:, None] == W - 2, acc[None, :].to(nxt.dtype), nxt)  # the window shifted by one row
    tl.debug_barrier()  # every thread has read the window before any row is overwritten
    tl.store(buf[None, :] + rw[:, None] * C[None, :], nxt, mask=inside)
    acc = tl.where(conv, yc * tl.sigmoid(yc), acc)
    tl.store(y + rn, acc.to(y.dtype.element_ty), mask=mn)


@triton.jit
def _decode_state_kernel(xc, a_log, dt_bias, eta_bias, state, ssq, norm_w, w_o, p, D, scale, eps, H: tl.constexpr,
                         K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr,
                         KACZ: tl.constexpr, PDL: tl.constexpr):
    """Batch-1 decoding, grid (V / BV, H): one token's delta-rule step on BV value columns of one head's state
    (in place), from xc = [q | k | v | gate | eta | decay], the input projection's output after its
    convolutions: q (and for GDN k) normalised, eta, the decay, beta. Then these columns' share of the output
    projection W_o (D, H V) before the head's RMSNorm, which is one scalar a head:
        p[h] += W_o[:, cols] (o[cols] * norm_w[cols] * SiLU(gate[cols])),
    added atomically into p (H, D) (zeroed by the input projection's kernel), and ssq (H, V / BV) the sums of
    squares of the BV values of o, from which _decode_mlp_kernel scales each head's row of p."""
    i_v, i_h = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    rd = tl.arange(0, BD)
    mk, mv, md = rk < K, rv < V, rd < D
    offs = i_h * K * V + rk[:, None] * V + rv[None, :]
    ms = mk[:, None] & mv[None, :]
    # first: they do not depend on the rest (with PDL, before the wait: the state's last writer is this
    # kernel at the previous token, complete before the kernel this one waits for started: see _pdl_wait)
    S = tl.load(state + offs, mask=ms, other=0.)
    wo = tl.load(w_o + rd[None, :] * (H * V) + (i_h * V + rv)[:, None], mask=mv[:, None] & md[None, :],
                 other=0.)  # wo[j, n] = W_o[n, h V + v_j]
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
    out = tl.where(mv, out.to(xc.dtype.element_ty).to(tl.float32), 0.)  # rounded as the unfused path rounds it
    tl.store(ssq + i_h * tl.num_programs(0) + i_v, tl.sum(out * out, 0))
    gt = tl.load(xc + 2 * H * K + H * V + i_h * V + rv, mask=mv, other=0.).to(tl.float32)
    a = out * tl.load(norm_w + rv, mask=mv, other=0.).to(tl.float32) * gt * tl.sigmoid(gt)
    a = a.to(w_o.dtype.element_ty).to(tl.float32)
    tl.atomic_add(p + i_h * D + rd, tl.sum(wo.to(tl.float32) * a[:, None], 0), mask=md, sem="relaxed")


@triton.jit
def _decode_mlp_kernel(x, p, ssq, norm_w, w_gu, w_down, z, D, F, norm_eps, o_norm_eps, H: tl.constexpr,
                       V: tl.constexpr, NV: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    """Batch-1 decoding, grid (F / BF,): the rest of the block after the state kernel. Each program
    forms the residual stream y = x + sum_h rstd_h p[h] (the mixer's output projection, each head's RMSNorm
    from ssq (H, NV)), then BF of the MLP's F hidden units, a = SiLU(W_gate[f] n) * (W_up[f] n) with
    n = RMSNorm(y) * norm_w, and adds its share W_down[:, f] a of the MLP's output atomically into z (D,),
    float32, zeroed by the input projection's kernel; program 0 also adds y. w_gu (2 F, D) is [W_gate; W_up],
    w_down (D, F)."""
    rf = tl.program_id(0) * BF + tl.arange(0, BF)
    mf = rf < F
    rd = tl.arange(0, BD)
    md = rd < D
    m2 = mf[:, None] & md[None, :]
    wg = tl.load(w_gu + rf[:, None].to(tl.int64) * D + rd[None, :], mask=m2, other=0.)
    wu = tl.load(w_gu + (F + rf)[:, None].to(tl.int64) * D + rd[None, :], mask=m2, other=0.)
    wd = tl.load(w_down + rd[None, :].to(tl.int64) * F + rf[:, None], mask=m2, other=0.)  # wd[j, n] = W_down[n, f_j]
    _pdl_wait(PDL)
    y = tl.load(x + rd, mask=md, other=0.).to(tl.float32)
    for h in tl.static_range(H):
        sumsq = 0.
        for j in tl.static_range(NV):
            sumsq += tl.load(ssq + h * NV + j)
        y += tl.load(p + h * D + rd, mask=md, other=0.) / tl.sqrt(sumsq / V + o_norm_eps)
    n = y / tl.sqrt(tl.sum(y * y, 0) / D + norm_eps) * tl.load(norm_w + rd, mask=md, other=0.).to(tl.float32)
    n = n.to(w_gu.dtype.element_ty).to(tl.float32)  # rounded as the unfused path rounds it
    g = tl.sum(wg.to(tl.float32) * n[None, :], 1).to(w_gu.dtype.element_ty).to(tl.float32)
    u = tl.sum(wu.to(tl.float32) * n[None, :], 1).to(w_gu.dtype.element_ty).to(tl.float32)
    a = (g * tl.sigmoid(g) * u).to(w_down.dtype.element_ty).to(tl.float32)
    out = tl.sum(wd.to(tl.float32) * a[:, None], 0)
    out += tl.where(tl.program_id(0) == 0, y, 0.)
    tl.atomic_add(z + rd, out, mask=md, sem="relaxed")


# -----------------------------------------------------------------------------
# launch


# Batch-1 decoding's kernels (decode_linear, kla_decode_block) as programmatic dependent launches on
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
    mixer = _decode_config("mixer", V=V)
    _decode_mixer_kernel[(B * H,)](
        xp, conv_q, conv_k, conv_v, w_q.contiguous(), w_k.contiguous(), w_v.contiguous(), A_log.contiguous(),
        dt_bias.contiguous(), eta_bias.contiguous(), norm_weight.contiguous(), state, out,
        xp.stride(0), float(scale), float(eps), float(norm_eps),
        H=H, K=K, V=V, W=W, BK=_block_k(K), BW=max(2, triton.next_power_of_2(W)), KACZ=bool(kaczmarz), **mixer)
    return out


def decode_linear(x, weight, *, norm_weight=None, norm_eps=1e-6):
    """One token's linear layer as one kernel, for decoding at batch 1: y = h W^T, where h is x, or
    RMSNorm(x) * norm_weight (norm_weight given). x (1, K) in weight's dtype or float32; weight (N, K) as
    nn.Linear holds it. Returns (1, N) in weight's dtype. model.GPT decodes its head with it at batch 1
    (norm_f and lm_head)."""
    N, K = weight.shape
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != K or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous (1, {K}) tensor for a weight of shape {(N, K)}, got "
                         f"{tuple(x.shape)}")
    if not weight.is_contiguous() or (weight.dtype != x.dtype and x.dtype != torch.float32):
        raise ValueError(f"weight must be contiguous and of x's dtype {x.dtype} (any dtype for a float32 x), got "
                         f"{weight.dtype}")
    if norm_weight is not None and tuple(norm_weight.shape) != (K,):
        raise ValueError(f"norm_weight must have shape ({K},), got {tuple(norm_weight.shape)}")
    y = torch.empty(1, N, device=x.device, dtype=weight.dtype)
    lin = _decode_config("linear", N=N, K=K)
    _decode_linear_kernel[(triton.cdiv(N, lin["BN"]),)](
        x, weight, y, x if norm_weight is None else norm_weight, N, K, float(norm_eps),
        NORM=norm_weight is not None, ONE=K <= lin["BK"], **lin, **_pdl(x))
    return y


def kla_decode_block(x, norm1_weight, in_proj_weight, conv_q, conv_k, conv_v, w_q, w_k, w_v, A_log, dt_bias, eta_bias,
                     state, o_norm_weight, o_proj_weight, norm2_weight, gate_up_weight, down_weight, *, n_head,
                     eps=1e-6, norm_eps=1e-6, o_norm_eps=None, scale=None, kaczmarz=True):
    """One token at batch 1 through a whole block, x + mixer(RMSNorm(x)) then + MLP(RMSNorm(.)), as three kernels:
    the input projection with the short convolutions after it (_decode_in_proj_kernel); the state step over value
    blocks with each block's share of the output projection added atomically (_decode_state_kernel); the
    heads' RMSNorm, the residual, RMSNorm and the MLP, each program BF hidden units and its share of the MLP's
    output added atomically (_decode_mlp_kernel). x (1, d) in the weights' dtype or float32; returns the block's
    output (1, d) in float32 (the residual stream kept in float32 between blocks). in_proj_weight
    (>= 2 H K + 2 H V + 2 H, d), its outputs [q | k | v | gate | eta | decay | padding]; the convolution buffers
    (1, W - 1, channels) and the state (1, H, K, V) float32, updated in place; o_proj_weight (d, H V);
    gate_up_weight (2 F, d) ([gate; up]) and down_weight (d, F). norm_eps is the two RMSNorms' epsilon, o_norm_eps
    the heads' (norm_eps when None). The atomic sums follow the order the programs run in, so the output can
    differ between calls in float32 rounding. model.Block computes the same in PyTorch."""
    H = n_head
    o_norm_eps = norm_eps if o_norm_eps is None else o_norm_eps
    (HK, W), HV = w_q.shape, w_v.shape[0]
    K, V = HK // H, HV // H
    d, dt = x.shape[-1], in_proj_weight.dtype
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_contiguous() or x.dtype not in (dt, torch.float32):
        raise ValueError(f"x must be a contiguous (1, d) tensor of the weights' dtype {dt} or float32, got "
                         f"{x.dtype} {tuple(x.shape)}")
    for name, t in (("in_proj_weight", in_proj_weight), ("o_proj_weight", o_proj_weight),
                    ("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        if not t.is_contiguous() or t.dtype != dt:
            raise ValueError(f"{name} must be contiguous and of in_proj_weight's dtype {dt}, got {t.dtype}")
    if in_proj_weight.shape[1] != d or in_proj_weight.shape[0] < 2 * HK + 2 * HV + 2 * H:
        raise ValueError(f"in_proj_weight must be (>= {2 * HK + 2 * HV + 2 * H}, {d}), got {tuple(in_proj_weight.shape)}")
    if tuple(o_proj_weight.shape) != (d, HV):
        raise ValueError(f"o_proj_weight must be ({d}, {HV}), got {tuple(o_proj_weight.shape)}")
    F = down_weight.shape[1]
    if tuple(down_weight.shape) != (d, F) or tuple(gate_up_weight.shape) != (2 * F, d):
        raise ValueError(f"gate_up_weight must be (2 F, {d}) and down_weight ({d}, F), got "
                         f"{tuple(gate_up_weight.shape)} and {tuple(down_weight.shape)}")
    if not w_q.dtype == w_k.dtype == w_v.dtype:
        raise ValueError(f"the convolution weights must share a dtype, got {w_q.dtype}, {w_k.dtype}, {w_v.dtype}")
    _check_cache(conv_q, conv_k, conv_v, state, 1, H, K, V, W, dt)
    N, pdl, dev = in_proj_weight.shape[0], _pdl(x), x.device
    lin = _decode_config("linear", N=N, K=d)
    if lin["BK"] < d:
        raise ValueError(f"kla_decode_block takes a width d <= 4096, got {d}")
    acc = torch.empty(H + 1, d, device=dev, dtype=torch.float32)  # p (H, d), then the block's output
    xc = torch.empty(1, N, device=dev, dtype=dt)
    _decode_in_proj_kernel[(triton.cdiv(N, lin["BN"]),)](
        x, in_proj_weight, norm1_weight, xc, conv_q, conv_k, conv_v, w_q.contiguous(), w_k.contiguous(),
        w_v.contiguous(), acc, N, d, float(norm_eps), acc.numel(), HK=HK, HV=HV, W=W,
        BW=max(2, triton.next_power_of_2(W)), BZ=1024, **lin, **pdl)
    st = _decode_config("state", V=V)
    ssq = torch.empty(H, triton.cdiv(V, st["BV"]), device=dev, dtype=torch.float32)
    BD = triton.next_power_of_2(d)
    _decode_state_kernel[(triton.cdiv(V, st["BV"]), H)](
        xc, A_log, dt_bias, eta_bias, state, ssq, o_norm_weight, o_proj_weight, acc, d,
        float(K ** -0.5 if scale is None else scale), float(eps), H=H, K=K, V=V, BK=_block_k(K), BD=BD,
        KACZ=bool(kaczmarz), **st, **pdl)
    mlp = _decode_config("mlp", F=F)
    _decode_mlp_kernel[(triton.cdiv(F, mlp["BF"]),)](
        x, acc, ssq, norm2_weight, gate_up_weight, down_weight, acc[H:], d, F, float(norm_eps), float(o_norm_eps),
        H=H, V=V, NV=ssq.shape[1], BD=BD, **mlp, **pdl)
    return acc[H:]
