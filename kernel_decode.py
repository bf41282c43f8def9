"""
Triton kernels for decoding the KLA (or GDN) model one token at a time: the whole block around the KLA step
(kernel.py holds the KLA kernels themselves; this file imports it, model.py uses both).

    kla_decode_mixer   one kernel for any batch: the mixer between its input and output projections (the short
                       convolutions, the norms of q (and for GDN k), eta, the decay, beta, the state step, the
                       output's RMSNorm and SiLU gate); grid (B*H).
    kla_decode_model   batch 1: the whole model, from the token's embedding to its logits, as one persistent
                       kernel (_decode_model_kernel): five steps a block (the input projection with its RMSNorm
                       and the short convolutions; the state step; the heads' RMSNorm and gate, the output
                       projection and the residual; RMSNorm and the MLP's first projection; SwiGLU, its second
                       projection and the residual), then the final RMSNorm and lm_head. Every program streams
                       its share of a step's weights, requested before it waits for all programs to finish the
                       step before (a counter a step in global memory). Without a cooperative launch (or in
                       Triton's interpreter) the same kernel runs one launch a step.
    decode_linear      batch 1: one linear layer as a stream of its weights, with an RMSNorm or SwiGLU before it
                       and a residual add after.

Each step's code is one function (_in_proj_step, _state_step, _out_proj_step, _linear_step) for both launches.
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
def _wait(ctr, j, SYNC: tl.constexpr):
    """Where a decoding step's program has requested what no earlier step writes (its weights) and waits for
    the step before it; everything else it reads or writes comes after. SYNC 0: nothing to wait for (one
    kernel a step, launched in order). SYNC 1, a programmatic dependent launch (Hopper; DECODE_PDL): wait for
    the previous kernel's completion and memory, then let the next kernel start; as each kernel lets the
    next one start only after its own wait, a kernel starts only once the kernel two before it has
    completed. SYNC 2, the persistent kernel (DECODE_PERSISTENT): wait until every program has counted itself
    done with step j in ctr[j] (_arrive; j < 0, the first step, waits for nothing)."""
    if SYNC == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if SYNC == 2:
        if j >= 0:
            while _load_acquire(ctr + j) < tl.num_programs(0):
                pass


@triton.jit
def _load_acquire(p):
    """*p (int32) read with acquire semantics at GPU scope by every thread: what the programs that counted
    themselves there wrote before is visible to this thread's reads after (a plain read in a poll, no
    read-modify-write on the one counter every program polls)."""
    v = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [p + tl.zeros([1], tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    return tl.max(v, 0)


@triton.jit
def _arrive(ctr, j):
    """The persistent kernel: this program is done with step j (after all its threads' writes)."""
    tl.debug_barrier()
    tl.atomic_add(ctr + j, 1, sem="release", scope="gpu")


@triton.jit
def _rows(w, blk, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """Rows blk * BN ... blk * BN + BN - 1 of a row-major (N, K) weight (K <= BK), zero outside."""
    rn = blk * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    return tl.load(w + rn[:, None].to(tl.int64) * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.)


@triton.jit
def _linear_input(x, norm_w, K, norm_eps, NORM: tl.constexpr, SWIGLU: tl.constexpr, BK: tl.constexpr):
    """A projection's input (BK,) in float32: x, or RMSNorm(x) * norm_w (NORM), or SiLU(x[:K]) * x[K:]
    (SWIGLU), rounded to x's dtype as the unfused path rounds it. Activations are read past L1 (.cg): in the
    persistent kernel other programs wrote them since."""
    rk = tl.arange(0, BK)
    mk = rk < K
    h = tl.load(x + rk, mask=mk, other=0., cache_modifier=".cg").to(tl.float32)
    if SWIGLU:
        h = h * tl.sigmoid(h) * tl.load(x + K + rk, mask=mk, other=0., cache_modifier=".cg").to(tl.float32)
    if NORM:
        h = h / tl.sqrt(tl.sum(h * h, 0) / K + norm_eps) * tl.load(norm_w + rk, mask=mk, other=0.).to(tl.float32)
    return h.to(x.dtype.element_ty).to(tl.float32)


@triton.jit
def _linear_rows(wt, h, blk, y, res, N, RES: tl.constexpr, BN: tl.constexpr):
    """y[rows] = wt h (+ res[rows], the product rounded first) for the BN rows of block blk."""
    rn = blk * BN + tl.arange(0, BN)
    mn = rn < N
    acc = tl.sum(wt.to(tl.float32) * h[None, :], 1)
    if RES:
        acc = acc.to(y.dtype.element_ty).to(tl.float32) + tl.load(res + rn, mask=mn, other=0.,
                                                                   cache_modifier=".cg").to(tl.float32)
    tl.store(y + rn, acc.to(y.dtype.element_ty), mask=mn)


@triton.jit
def _linear_step(pid, P, x, w, y, norm_w, res, N, K, norm_eps, ctr, j, NORM: tl.constexpr, SWIGLU: tl.constexpr,
                 RES: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SYNC: tl.constexpr):
    """y = W h (+ res) for one token (see _linear_input), K <= BK: program pid of P takes row blocks pid,
    pid + P, ...; the first one's weights requested before the wait (_wait), so that they stream in while the
    step before finishes, and each next one's before the block before it is used."""
    wt = _rows(w, pid, N, K, BN, BK)
    _wait(ctr, j, SYNC)
    h = _linear_input(x, norm_w, K, norm_eps, NORM, SWIGLU, BK)
    for blk in range(pid, tl.cdiv(N, BN), P):
        nxt = _rows(w, blk + P, N, K, BN, BK)  # the next block requested before this one is used
        _linear_rows(wt, h, blk, y, res, N, RES, BN)
        wt = nxt


@triton.jit
def _conv_rows(blk, cq, ckk, cvv, wq, wk, wv, HK: tl.constexpr, HV: tl.constexpr, W: tl.constexpr,
               BN: tl.constexpr):
    """The input projection's rows of block blk that feed a short convolution (the first 2 HK + HV: q, k, v),
    each row's channel window in its buffer (row 0's pointer), that buffer's row length, and its weights."""
    rn = blk * BN + tl.arange(0, BN)
    iq = rn < HK
    ik = (rn >= HK) & (rn < 2 * HK)
    iv = (rn >= 2 * HK) & (rn < 2 * HK + HV)
    ch = tl.where(iq, rn, tl.where(ik, rn - HK, rn - 2 * HK))  # the row's channel in its q, k or v buffer
    buf = tl.where(iq, cq, tl.where(ik, ckk, cvv)) + ch
    return iq | ik | iv, buf, tl.where(iv, HV, HK), tl.where(iq, wq, tl.where(ik, wk, wv)) + ch * W


@triton.jit
def _in_proj_load(blk, w, cq, ckk, cvv, wq, wk, wv, N, K, HK: tl.constexpr, HV: tl.constexpr, W: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr):
    """What block blk of the input projection reads that no other step writes: its weights, its channels'
    windows (the last W - 1 inputs, and the same shifted by one row) and convolution weights. Only this step
    writes the windows, at the previous token."""
    conv, buf, C, cw = _conv_rows(blk, cq, ckk, cvv, wq, wk, wv, HK, HV, W, BN)
    rw = tl.arange(0, BW)
    win = tl.load(buf[None, :] + rw[:, None] * C[None, :], mask=(rw[:, None] < W - 1) & conv[None, :], other=0.)
    nxt = tl.load(buf[None, :] + (rw[:, None] + 1) * C[None, :], mask=(rw[:, None] < W - 2) & conv[None, :], other=0.)
    cwt = tl.load(cw[None, :] + rw[:, None], mask=(rw[:, None] < W) & conv[None, :], other=0.).to(tl.float32)
    return _rows(w, blk, N, K, BN, BK), win, nxt, cwt


@triton.jit
def _in_proj_rows(wt, win, nxt, cwt, h, blk, y, cq, ckk, cvv, wq, wk, wv, N, HK: tl.constexpr, HV: tl.constexpr,
                  W: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr):
    """Block blk of y = W h, then on the q, k, v rows the short convolution + SiLU, the windows shifted in place
    (each channel is one program's)."""
    conv, buf, C, cw = _conv_rows(blk, cq, ckk, cvv, wq, wk, wv, HK, HV, W, BN)
    rn = blk * BN + tl.arange(0, BN)
    rw = tl.arange(0, BW)
    acc = tl.sum(wt.to(tl.float32) * h[None, :], 1).to(y.dtype.element_ty).to(tl.float32)
    win = tl.where(rw[:, None] == W - 1, acc[None, :], win.to(tl.float32))  # row W - 1: the new input
    yc = tl.sum(win * cwt, 0)
    nxt = tl.where(rw[:, None] == W - 2, acc[None, :].to(nxt.dtype), nxt)  # the window shifted by one row
    tl.debug_barrier()  # every thread has read the window before any row is overwritten
    tl.store(buf[None, :] + rw[:, None] * C[None, :], nxt, mask=(rw[:, None] < W - 1) & conv[None, :])
    acc = tl.where(conv, yc * tl.sigmoid(yc), acc)
    tl.store(y + rn, acc.to(y.dtype.element_ty), mask=rn < N)


@triton.jit
def _in_proj_step(pid, P, x, w, norm_w, y, cq, ckk, cvv, wq, wk, wv, N, K, norm_eps, ctr, j, HK: tl.constexpr,
                  HV: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr,
                  SYNC: tl.constexpr):
    """The mixer's input projection with what surrounds it, K <= BK: y = W (RMSNorm(x) * norm_w), the short
    convolutions + SiLU on its q, k, v rows (_in_proj_rows); row blocks as _linear_step takes them."""
    wt, win, nxt, cwt = _in_proj_load(pid, w, cq, ckk, cvv, wq, wk, wv, N, K, HK, HV, W, BN, BK, BW)
    _wait(ctr, j, SYNC)
    h = _linear_input(x, norm_w, K, norm_eps, True, False, BK)
    _in_proj_rows(wt, win, nxt, cwt, h, pid, y, cq, ckk, cvv, wq, wk, wv, N, HK, HV, W, BN, BW)
    for blk in range(pid + P, tl.cdiv(N, BN), P):
        wt, win, nxt, cwt = _in_proj_load(blk, w, cq, ckk, cvv, wq, wk, wv, N, K, HK, HV, W, BN, BK, BW)
        _in_proj_rows(wt, win, nxt, cwt, h, blk, y, cq, ckk, cvv, wq, wk, wv, N, HK, HV, W, BN, BW)


@triton.jit
def _state_load(blk, state, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Block blk = (head, value block) of the states (H, K, V), zero past the last head. Only the state step
    writes the state, at the previous token."""
    NV: tl.constexpr = (V + BV - 1) // BV
    i_h, i_v = (blk // NV).to(tl.int64), blk % NV
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    ms = (rk[:, None] < K) & (rv[None, :] < V) & ((blk + tl.zeros([1], tl.int32)) < H * NV)[None, :]
    return tl.load(state + i_h * K * V + rk[:, None] * V + rv[None, :], mask=ms, other=0.)


@triton.jit
def _state_rows(S, blk, xc, a_log, dt_bias, eta_bias, state, o, ssq, scale, eps, H: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KACZ: tl.constexpr):
    """One token's delta-rule step on block blk's BV value columns of one head's state S (in place), from
    xc = [q | k | v | gate | eta | decay], the input projection's output after its convolutions: q (and for
    GDN k) normalised, eta, the decay, beta; o the unnormalised output, and ssq (H, V / BV) the sums of
    squares of its BV values as o holds them (the output projection applies the head's RMSNorm and gate from
    them). Past the last head: nothing written."""
    NV: tl.constexpr = (V + BV - 1) // BV
    live = (blk + tl.zeros([1], tl.int32)) < H * NV  # (1,): a mask for the vector stores
    i_h, i_v = tl.minimum(blk // NV, H - 1).to(tl.int64), blk % NV
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    q = tl.load(xc + i_h * K + rk, mask=mk, other=0., cache_modifier=".cg").to(tl.float32)
    k = tl.load(xc + H * K + i_h * K + rk, mask=mk, other=0., cache_modifier=".cg").to(tl.float32)
    v = tl.load(xc + 2 * H * K + i_h * V + rv, mask=mv, other=0., cache_modifier=".cg").to(tl.float32)
    eta = tl.load(xc + 2 * H * K + 2 * H * V + i_h, cache_modifier=".cg").to(tl.float32)
    a = tl.load(xc + 2 * H * K + 2 * H * V + H + i_h, cache_modifier=".cg").to(tl.float32)
    eta = tl.sigmoid(eta + tl.load(eta_bias + i_h).to(tl.float32))
    a += tl.load(dt_bias + i_h).to(tl.float32)
    g = -tl.exp(tl.load(a_log + i_h).to(tl.float32)) * tl.where(a > 20., a, tl.log(1. + tl.exp(a)))  # softplus
    q = q / tl.maximum(tl.sqrt(tl.sum(q * q, 0)), 1e-12)
    if not KACZ:
        k = k / tl.maximum(tl.sqrt(tl.sum(k * k, 0)), 1e-12)
    beta = _beta(tl.sum(k * k, 0), eta, eps, KACZ)
    S, out = _delta_step(S, tl.exp(g), q, k, v, beta, scale)
    tl.store(state + i_h * K * V + rk[:, None] * V + rv[None, :], S, mask=mk[:, None] & mv[None, :] & live[None, :])
    out = out.to(o.dtype.element_ty)  # each state element written by the thread that read it
    tl.store(o + i_h * V + rv, out, mask=mv & live)
    out = tl.where(mv, out.to(tl.float32), 0.)
    tl.store(ssq + i_h * NV + i_v + tl.zeros([1], tl.int32), tl.sum(out * out, 0) + tl.zeros([1], tl.float32), mask=live)


@triton.jit
def _state_step(pid, P, xc, a_log, dt_bias, eta_bias, state, o, ssq, scale, eps, ctr, j, H: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KACZ: tl.constexpr,
                SYNC: tl.constexpr):
    """The state step (_state_rows) over the H * V / BV blocks, program pid of P taking blocks pid, pid + P, ...,
    the first one's state requested before the wait."""
    NV: tl.constexpr = (V + BV - 1) // BV
    S = _state_load(pid, state, H, K, V, BK, BV)
    _wait(ctr, j, SYNC)
    _state_rows(S, pid, xc, a_log, dt_bias, eta_bias, state, o, ssq, scale, eps, H, K, V, BK, BV, KACZ)
    for blk in range(pid + P, H * NV, P):
        _state_rows(_state_load(blk, state, H, K, V, BK, BV), blk, xc, a_log, dt_bias, eta_bias, state, o, ssq,
                    scale, eps, H, K, V, BK, BV, KACZ)


@triton.jit
def _out_proj_step(pid, P, o, ssq, gate, w, norm_w, res, y, N, K, norm_eps, ctr, j, V: tl.constexpr,
                   NV: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SYNC: tl.constexpr):
    """The mixer's output projection with what precedes and follows it (K = H V <= BK): y = W (RMSNorm of each
    head's V values of o * norm_w * SiLU(gate)) + res, each head's mean square from the state step's NV
    partial sums ssq (H, NV); row blocks as _linear_step takes them."""
    wt = _rows(w, pid, N, K, BN, BK)
    _wait(ctr, j, SYNC)
    rk = tl.arange(0, BK)
    mk = rk < K
    h = tl.load(o + rk, mask=mk, other=0., cache_modifier=".cg").to(tl.float32)
    gt = tl.load(gate + rk, mask=mk, other=0., cache_modifier=".cg").to(tl.float32)
    head = rk // V
    sumsq = tl.zeros([BK], dtype=tl.float32)
    for i in tl.static_range(NV):  # each column's head's sum of squares: NV independent (cached) loads
        sumsq += tl.load(ssq + head * NV + i, mask=mk, other=0., cache_modifier=".cg")
    h = h / tl.sqrt(sumsq / V + norm_eps) * tl.load(norm_w + rk % V, mask=mk, other=0.).to(tl.float32) * gt * tl.sigmoid(gt)
    h = h.to(o.dtype.element_ty).to(tl.float32)
    _linear_rows(wt, h, pid, y, res, N, True, BN)
    for blk in range(pid + P, tl.cdiv(N, BN), P):
        _linear_rows(_rows(w, blk, N, K, BN, BK), h, blk, y, res, N, True, BN)


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
                          SYNC: tl.constexpr):
    """y = W h (+ res) for one token, BN outputs a program: W (N, K) row-major (nn.Linear's weight); h is x,
    or RMSNorm(x) * norm_w (NORM), or SiLU(x[:K]) * x[K:] (SWIGLU). At batch 1 the product is a stream of
    the weights: with K <= BK (ONE) each program requests its rows whole, before anything else, so that
    their latency overlaps the input's (_linear_step); else it walks K in blocks of BK."""
    if ONE:
        _linear_step(tl.program_id(0), tl.num_programs(0), x, w, y, norm_w, res, N, K, norm_eps, x, 0, NORM, SWIGLU,
                     RES, BN, BK, SYNC)
    else:
        _wait(x, 0, SYNC)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        mn = rn < N
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
def _at(base, t, i):
    """Layer pointer: base (layer 0's tensor of its kind) plus entry i of the layer's row t of the offset
    table, counted in 16 bytes (so that the compiler knows the pointer 16-byte aligned and vectorises)."""
    U: tl.constexpr = 128 // base.dtype.element_ty.primitive_bitwidth
    return base + tl.load(t + i) * U


@triton.jit
def _decode_model_kernel(x, xc, o, ssq, hid, logits, ctr, tab, s0, s1, n_layer,
                         norm1_w, in_w, cq, ckk, cvv, wq, wk, wv, a_log, dt_bias, eta_bias, state, o_norm_w, o_w,
                         norm2_w, up_w, down_w, norm_f_w, head_w,
                         D, N_IN, HID, VOCAB, norm_eps, o_norm_eps, scale, eps,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
                         BK_D: tl.constexpr, BK_HEAD: tl.constexpr, BV: tl.constexpr, BK_O: tl.constexpr,
                         BK_HID: tl.constexpr, BN_IN: tl.constexpr, BN_O: tl.constexpr, BN_UP: tl.constexpr,
                         BN_DOWN: tl.constexpr, BN_HEAD: tl.constexpr, KACZ: tl.constexpr, SYNC: tl.constexpr):
    """Batch-1 decoding of the whole model, steps s0 ... s1 - 1 of one token: step 5 l + 0 ... 4 of layer l are
    RMSNorm + the input projection + the short convolutions (_in_proj_step), the state step (_state_step),
    the heads' RMSNorm and gate + the output projection + the residual (_out_proj_step), RMSNorm + the MLP's
    first projection, SwiGLU + its second projection + the residual (_linear_step); step 5 n_layer is the
    final RMSNorm + lm_head. x (D,) the residual stream, updated in place; xc, o, ssq, hid the steps'
    outputs; the layers' tensors are layer 0's pointers plus their row of tab (_at). With SYNC 2 one
    persistent launch runs every step, every program resident (a cooperative launch), each step waiting
    for all programs to finish the one before (_wait: ctr counts them; the last program out resets the
    counters); else one launch a step."""
    pid, P = tl.program_id(0), tl.num_programs(0)
    NV: tl.constexpr = (V + BV - 1) // BV
    for s in range(s0, s1):
        t = tab + (s // 5) * 17
        j = s - s0 - 1  # the step to wait for (-1: none, the first of this launch)
        if s == 5 * n_layer:
            _linear_step(pid, P, x, head_w, logits, norm_f_w, x, VOCAB, D, norm_eps, ctr, j, True, False, False,
                         BN_HEAD, BK_D, SYNC)
        elif s % 5 == 0:
            _in_proj_step(pid, P, x, _at(in_w, t, 1), _at(norm1_w, t, 0), xc, _at(cq, t, 2), _at(ckk, t, 3),
                          _at(cvv, t, 4), _at(wq, t, 5), _at(wk, t, 6), _at(wv, t, 7), N_IN, D, norm_eps, ctr, j,
                          H * K, H * V, W, BN_IN, BK_D, BW, SYNC)
        elif s % 5 == 1:
            _state_step(pid, P, xc, _at(a_log, t, 8), _at(dt_bias, t, 9), _at(eta_bias, t, 10), _at(state, t, 11),
                        o, ssq, scale, eps, ctr, j, H, K, V, BK_HEAD, BV, KACZ, SYNC)
        elif s % 5 == 2:
            _out_proj_step(pid, P, o, ssq, xc + 2 * H * K + H * V, _at(o_w, t, 13), _at(o_norm_w, t, 12), x, x, D,
                           H * V, o_norm_eps, ctr, j, V, NV, BN_O, BK_O, SYNC)
        elif s % 5 == 3:
            _linear_step(pid, P, x, _at(up_w, t, 15), hid, _at(norm2_w, t, 14), x, 2 * HID, D, norm_eps, ctr, j,
                         True, False, False, BN_UP, BK_D, SYNC)
        else:
            _linear_step(pid, P, hid, _at(down_w, t, 16), x, x, x, D, HID, norm_eps, ctr, j, False, True, True,
                         BN_DOWN, BK_HID, SYNC)
        if SYNC == 2:
            _arrive(ctr, s - s0)
    if SYNC == 2:
        done = tl.atomic_add(ctr + s1 - s0, 1, sem="acq_rel", scope="gpu")
        if done == P - 1:  # the last program out: every other one has passed its last wait
            r = tl.arange(0, 256)
            for i in range(0, s1 - s0 + 1, 256):
                tl.store(ctr + i + r, 0, mask=i + r <= s1 - s0)


# -----------------------------------------------------------------------------
# launch


# Batch-1 decoding (kla_decode_model, decode_linear): one persistent launch a token where the GPU can keep every
# program resident (a cooperative launch); else one launch a step, as programmatic dependent launches on Hopper
# and later (see _wait). bench.py --persistent=0 / --pdl=0 turn them off to time the difference
DECODE_PERSISTENT = True
DECODE_PDL = True
DECODE_PROGRAMS_PER_SM = 1  # the persistent kernel's programs on each SM, of DECODE_WARPS warps
DECODE_WARPS = 8
DECODE_TILE = 32768  # the persistent kernel's most weights a program holds of a step (rows x columns)
DECODE_HEAD_ROWS = 16  # the persistent kernel's rows of lm_head a block


def _interpreted(x):
    return not x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pdl(x):
    """The launch options of a batch-1 decoding kernel: SYNC=1 with launch_pdl where DECODE_PDL applies."""
    on = DECODE_PDL and not _interpreted(x) and _hopper(x.device.index if x.device.index is not None
                                                          else torch.cuda.current_device())[0]
    return dict(SYNC=1, launch_pdl=True) if on else dict(SYNC=0)


@functools.lru_cache
def _hopper(index):
    """Whether this GPU (compute capability 9 or more) and this Triton do PDL (gdc_wait, the launch_pdl
    option), and whether Triton does cooperative launches (the launch_cooperative_grid option)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        fields = CUDAOptions.__dataclass_fields__
        pdl, coop = hasattr(tl.extra.cuda, "gdc_wait") and "launch_pdl" in fields, "launch_cooperative_grid" in fields
    except (ImportError, AttributeError):
        pdl = coop = False
    sm90 = torch.cuda.get_device_capability(index)[0] >= 9
    return pdl and sm90, coop


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


# what kla_decode_model takes of each layer, in the order of _decode_model_kernel's offset table
LAYER_KEYS = ("norm1", "in_proj", "conv_q", "conv_k", "conv_v", "w_q", "w_k", "w_v", "A_log", "dt_bias", "eta_bias",
              "state", "o_norm", "o_proj", "norm2", "gate_up", "down")
_TABLES = {}  # (device, the layers' pointers) -> (offset table, step counters): made outside any CUDA graph


def _tables(layers, device, steps):
    """The offset table (L, 17) int64 of kla_decode_model's layers, each tensor's distance from layer 0's of
    its kind in 16 bytes, and the persistent kernel's step counters (zero between launches), kept for the
    same layers' next tokens (a CUDA graph replays them)."""
    key = (str(device),) + tuple(layer[k].data_ptr() for layer in layers for k in LAYER_KEYS)
    if key not in _TABLES:
        rows = []
        for i, layer in enumerate(layers):
            rows.append([])
            for k in LAYER_KEYS:
                off = layer[k].data_ptr() - layers[0][k].data_ptr()
                if off % 16:
                    raise ValueError(f"layer {i}'s {k} must start a multiple of 16 bytes from layer 0's, "
                                     f"got {off} bytes")
                rows[-1].append(off // 16)
        if len(_TABLES) >= 8:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = (torch.tensor(rows, dtype=torch.int64, device=device),
                        torch.zeros(steps + 1, dtype=torch.int32, device=device))
    return _TABLES[key]


def kla_decode_model(x, layers, norm_f_weight, head_weight, *, n_head, eps=1e-6, norm_eps=1e-6, o_norm_eps=None,
                     scale=None, kaczmarz=True):
    """One token at batch 1 through every block of the KLA (or GDN) model and its head, from the token's
    embedding x (1, d), which is overwritten (the residual stream); returns the logits (1, vocab). layers: a
    dict per block of its tensors under LAYER_KEYS: norm1 (d,), in_proj (>= 2 H K + 2 H V + 2 H, d) with
    outputs [q | k | v | gate | eta | decay | padding], the convolution buffers conv_q, conv_k (1, W - 1, H K),
    conv_v (1, W - 1, H V) and the state (1, H, K, V) float32 (updated in place), the convolution weights
    w_q, w_k (H K, W), w_v (H V, W), A_log, dt_bias, eta_bias (H,), o_norm (V,), o_proj (d, H V), norm2 (d,),
    gate_up (2 F, d), down (d, F); the final norm norm_f_weight (d,) and head_weight (vocab, d). norm_eps is
    the RMSNorms' epsilon, o_norm_eps the heads' (norm_eps when None). All steps run as one persistent kernel
    on GPUs that can keep its programs resident (DECODE_PERSISTENT), else as one kernel a step
    (_decode_model_kernel). model.GPT computes the same in PyTorch."""
    H, L = n_head, len(layers)
    o_norm_eps = norm_eps if o_norm_eps is None else o_norm_eps
    if L < 1 or not all(set(LAYER_KEYS) <= set(layer) for layer in layers):
        raise ValueError(f"layers must be a non-empty list of dicts with keys {LAYER_KEYS}")
    first = layers[0]
    (HK, W), HV = first["w_q"].shape, first["w_v"].shape[0]
    K, V = HK // H, HV // H
    d = x.shape[-1]
    F = first["down"].shape[1]
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous (1, d) tensor, got {tuple(x.shape)}")
    if HK % H or HV % H or W < 2:
        raise ValueError(f"w_q, w_v must be (H K, W), (H V, W) with W >= 2 and H = {H}, got {tuple(first['w_q'].shape)}, "
                         f"{tuple(first['w_v'].shape)}")
    shapes = {"norm1": (d,), "in_proj": (max(first["in_proj"].shape[0], 2 * HK + 2 * HV + 2 * H), d),
              "w_q": (HK, W), "w_k": (HK, W), "w_v": (HV, W), "A_log": (H,), "dt_bias": (H,), "eta_bias": (H,),
              "o_norm": (V,), "o_proj": (d, HV), "norm2": (d,), "gate_up": (2 * F, d), "down": (d, F)}
    for i, layer in enumerate(layers):
        for k in LAYER_KEYS:
            t, want = layer[k], first[k]
            if (tuple(t.shape) != shapes.get(k, tuple(want.shape)) or t.dtype != want.dtype
                    or not t.is_contiguous() or t.device != x.device):
                raise ValueError(f"layer {i}'s {k} must be a contiguous {want.dtype} tensor of shape "
                                 f"{shapes.get(k, tuple(want.shape))} on {x.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        _check_cache(layer["conv_q"], layer["conv_k"], layer["conv_v"], layer["state"], 1, H, K, V, W, x.dtype)
    if not first["w_q"].dtype == first["w_k"].dtype == first["w_v"].dtype:
        raise ValueError(f"the convolution weights must share a dtype, got {first['w_q'].dtype}, {first['w_k'].dtype}, "
                         f"{first['w_v'].dtype}")
    for k in ("in_proj", "o_proj", "gate_up", "down"):
        if first[k].dtype != x.dtype:
            raise ValueError(f"{k} must be of x's dtype {x.dtype}, got {first[k].dtype}")
    if head_weight.dim() != 2 or head_weight.shape[1] != d or head_weight.dtype != x.dtype or not head_weight.is_contiguous():
        raise ValueError(f"head_weight must be a contiguous {x.dtype} (vocab, {d}) tensor, got {head_weight.dtype} "
                         f"{tuple(head_weight.shape)}")
    if tuple(norm_f_weight.shape) != (d,):
        raise ValueError(f"norm_f_weight must have shape ({d},), got {tuple(norm_f_weight.shape)}")
    if max(d, HV, F) > 4096:
        raise ValueError(f"kla_decode_model takes d, H V and the MLP's width up to 4096, got {d}, {HV}, {F}")
    steps = 5 * L + 1
    tab, ctr = _tables(layers, x.device, steps)
    N_in, vocab = first["in_proj"].shape[0], head_weight.shape[0]
    xc = torch.empty(N_in, device=x.device, dtype=x.dtype)
    o = torch.empty(HV, device=x.device, dtype=x.dtype)
    hid = torch.empty(2 * F, device=x.device, dtype=x.dtype)
    logits = torch.empty(1, vocab, device=x.device, dtype=x.dtype)
    BK_D, BK_O, BK_HID = (triton.next_power_of_2(n) for n in (d, HV, F))
    meta = dict(H=H, K=K, V=V, W=W, BW=max(2, triton.next_power_of_2(W)), BK_D=BK_D, BK_HEAD=_block_k(K),
                BK_O=BK_O, BK_HID=BK_HID, KACZ=bool(kaczmarz))
    sizes = [d, N_in, F, vocab, float(norm_eps), float(o_norm_eps), float(K ** -0.5 if scale is None else scale),
             float(eps)]
    tensors = [first[k] for k in LAYER_KEYS] + [norm_f_weight, head_weight]
    persistent = DECODE_PERSISTENT and not _interpreted(x) and _hopper(x.device.index if x.device.index is not None
                                                                         else torch.cuda.current_device())[1]
    if persistent:  # P programs, each step's rows in about P blocks of at most DECODE_TILE weights
        P = torch.cuda.get_device_properties(x.device).multi_processor_count * DECODE_PROGRAMS_PER_SM
        bn = lambda N, BK: max(1, min(triton.next_power_of_2(triton.cdiv(N, P)), DECODE_TILE // BK))
        BV = min(triton.next_power_of_2(V), max(8, triton.next_power_of_2(triton.cdiv(H * V, P))))
        ssq = torch.empty(H * triton.cdiv(V, BV), device=x.device, dtype=torch.float32)
        _decode_model_kernel[(P,)](
            x, xc, o, ssq, hid, logits, ctr, tab, 0, steps, L, *tensors, *sizes, BV=BV, BN_IN=bn(N_in, BK_D),
            BN_O=bn(d, BK_O), BN_UP=bn(2 * F, BK_D), BN_DOWN=bn(d, BK_HID), BN_HEAD=min(DECODE_HEAD_ROWS, bn(vocab, BK_D)),
            SYNC=2, num_warps=DECODE_WARPS, launch_cooperative_grid=True, **meta)
        return logits
    # one launch a step, each as many programs as it has blocks of rows (_linear_config; the state step's
    # blocks of 32 values), as the interpreter runs too
    BV = min(32, triton.next_power_of_2(V))
    ssq = torch.empty(H * triton.cdiv(V, BV), device=x.device, dtype=torch.float32)
    cfg = {"in": _linear_config(N_in, d), "o": _linear_config(d, HV), "up": _linear_config(2 * F, d),
           "down": _linear_config(d, F), "head": _linear_config(vocab, d)}
    rows = dict(BN_IN=cfg["in"][0], BN_O=cfg["o"][0], BN_UP=cfg["up"][0], BN_DOWN=cfg["down"][0],
                BN_HEAD=cfg["head"][0])
    for s in range(steps):
        kind, N = ("head", vocab) if s == 5 * L else [("in", N_in), ("state", 0), ("o", d), ("up", 2 * F),
                                                          ("down", d)][s % 5]
        grid, warps = (H * triton.cdiv(V, BV), 4) if kind == "state" else (triton.cdiv(N, cfg[kind][0]), cfg[kind][2])
        _decode_model_kernel[(grid,)](x, xc, o, ssq, hid, logits, ctr, tab, s, s + 1, L, *tensors, *sizes, BV=BV,
                                      **rows, num_warps=warps, **meta, **_pdl(x))
    return logits
