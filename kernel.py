"""
Triton kernels for Kaczmarz Linear Attention (KLA): chunkwise forward and backward, and a decode step. Imports only
torch and Triton (copy it alone into another project).

Per head, with the state S (K x V) in float32 and beta_t = eta_t / (||k_t||^2 + eps) (KLA) or eta_t (GDN):

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T (scale q_t)

Chunkwise form (chunk of C = 64 tokens, b = the cumulative sum of g inside the chunk, S0 the state
entering the chunk, Gamma_ij = exp(b_i - b_j) for i >= j, else 0):

    Ar  = (I + StrictTril(Diag(beta) K K^T))^-1       gate-free; the decay is put back elementwise:
    P   = Gamma o (Ar Diag(beta))                      = (I + StrictTril(Diag(beta) (K K^T o Gamma)))^-1 Diag(beta)
    Vn  = V - Diag(exp b) K S0                         (C x V) the residuals against the decayed state
    U   = P Vn                                         (C x V) the "new values" beta_t e_t
    O   = scale (Diag(exp b) Q S0 + (Gamma o Q K^T) U)
    S1  = exp(b_C) S0 + K^T Diag(exp(b_C - b)) U

Kernels (q, k (B, T, H, K), v (B, T, H, V), g, eta (B, T, H), states (B, H, K, V)); grid (chunks, B*H) unless said:
    _prep_kernel       b (log2 domain), beta, and Ar inverted in float32 (16 x 16 blocks merged 16 -> 32 -> 64).
    _fwd_pre_kernel    the state-free parts W = P Diag(exp b) K, U0 = P V and Aqk = Gamma o QK^T.
    _fwd_kernel        grid (V / BV, B*H): the chunks in order, S in registers: U = U0 - W S, O, S1; saves S0.
    _fwd_o_kernel      O from the saved states, when _fwd_kernel leaves it out (CONFIGS's "fuse_o").
    _bwd_pre_kernel    dV0 = scale P^T Aqk^T dO and Wd = P^T Diag(exp(b_C - b)) K.
    _bwd_state_kernel  grid (V / BV, B*H): the chunks backwards, dS in registers: dv = dV0 + Wd dS1, dS0.
    _bwd_cc_kernel     the value loop (needs S0, dS1): dO Vn^T, dU Vn^T, Uc and exp(b_C) <S0, dS1>.
    _bwd_wy_kernel     the C x C algebra: dA, the WY backward, dbeta, dg (reverse cumsum), deta.
    _bwd_dqk_kernel    grid (K / BKB, chunks, B*H): dq, dk of BKB key columns, and the gate terms needing S0, dS1.
    _bwd_dg_kernel     sums those over the key blocks into dg.
    _step_kernel       grid (V / BV, B*H): one decoding token, the state read and written once.
The step size (_beta, _dbeta) and the one-token step (_delta_step) are shared with kernel_decode.py: a new
step-size rule changes model.kla_beta and those two. Block sizes, warps and stages: the table CONFIGS, a reason a row.

Packed sequences (cu_seqlens, VARLEN): each sequence has chunks of its own (_varlen_layout), found in place through a
chunk table (_chunk_rows); a program of the sequential kernels walks one sequence's chunks (_seq_program). No copies.

On Hopper with Triton 3.4 to 3.7.0 a tl.trans of a tl.dot result feeding another dot is miscompiled (fla #640): only
loaded tiles are transposed into a dot here (E in _bwd_wy_kernel into a sum); dA^T Q loads dA o Gamma transposed.
"""

import math
import numbers
import os
import warnings
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

C_CHUNK = 64
if C_CHUNK != 4 * 16:  # _prep_kernel inverts four 16 x 16 diagonal blocks, merged 16 -> 32 -> 64 (_inv_block_merge)
    raise ImportError(f"C_CHUNK = {C_CHUNK}: the inverse in _prep_kernel is written for chunks of 64 tokens")
SMS = 132  # streaming multiprocessors of an H100 / H200: one wave of the sequential kernels' programs
# exp(-104) is below float32's smallest number (2^-149): a decay across a gate at or below the floor is exactly 0,
# as for g = -inf, which is raised to it so that the cumulative sums of g stay finite (-inf - -inf is NaN)
GATE_FLOOR = tl.constexpr(-104.)

# -----------------------------------------------------------------------------
# launch configurations: one row per (kernel, case) with the reason; _config picks the case from the shape. BV and
# BKB are caps, lowered to V's power of two (at least 16) and to BK. The measurements: docs/kernel.md, "Choices".

CONFIGS = {
    ("prep", "16-bit"): dict(num_warps=1),  # _prep_kernel: more warps lose (the substitution's reductions cross warps)
    ("prep", "fp32"): dict(num_warps=2),  # float32 tiles take twice the registers (not measured)
    # _fwd_pre_kernel, _fwd_o_kernel, _bwd_pre_kernel: BV value columns a step
    ("pre", "16-bit"): dict(BV=64, num_warps=4),  # wide steps: fewer passes over the chunk's C x C tiles
    ("pre", "fp32"): dict(BV=16, num_warps=4),  # float32 tiles in registers
    # _fwd_kernel, the sequential forward: BV value columns a program
    ("fwd", "fp32"): dict(BV=16, num_warps=4, num_stages=2),  # float32 tiles in registers
    ("fwd", "many programs"): dict(BV=64, num_warps=4, num_stages=3),  # fewer programs read W, U0, Aqk per output
    ("fwd", "few programs, one wave at 16"): dict(BV=16, num_warps=4, num_stages=3),  # more programs fill the SMs
    ("fwd", "few programs"): dict(BV=32, num_warps=4, num_stages=3),  # 16 columns would take a second wave
    # _bwd_state_kernel, the sequential backward: as the forward, every load of its step pipelined
    ("bwd_state", "fp32"): dict(BV=16, num_warps=4, num_stages=2),
    ("bwd_state", "many programs"): dict(BV=64, num_warps=4, num_stages=3),
    ("bwd_state", "few programs, one wave at 16"): dict(BV=16, num_warps=4, num_stages=3),
    ("bwd_state", "few programs"): dict(BV=32, num_warps=4, num_stages=3),
    # whether _fwd_kernel adds the output itself (FUSE_O) or leaves it to _fwd_o_kernel from the saved states
    ("fuse_o", "fills the GPU"): dict(FUSE_O=True),  # the programs at 16 columns fill the SMs: no second pass
    ("fuse_o", "few programs, states saved or long"): dict(FUSE_O=False),  # fewer bytes a step of the serial loop
    ("fuse_o", "few programs"): dict(FUSE_O=True),  # short forward-only calls: no consistent gain from the split
    ("bwd_cc", "fp32"): dict(BV=16, num_warps=4, num_stages=1),  # _bwd_cc_kernel (value loop): float32 tiles
    ("bwd_cc", "K <= 64"): dict(BV=64, num_warps=4, num_stages=1),  # fewer, wider steps beat BV 16's fewer spills
    ("bwd_cc", "K >= 96"): dict(BV=64, num_warps=4, num_stages=2),  # the second stage pays from K = 96 on
    # _bwd_wy_kernel, the C x C algebra: no loop to pipeline (3 stages: Triton's default)
    ("bwd_wy", "fp32"): dict(num_warps=4, num_stages=3),  # float32 tiles in registers
    ("bwd_wy", "K <= 64"): dict(num_warps=8, num_stages=3),  # faster at small heads
    ("bwd_wy", "K >= 96"): dict(num_warps=4, num_stages=3),  # two programs an SM at 4 warps, no spills
    # _bwd_dqk_kernel: BKB key columns a program, BV value columns a step
    ("bwd_dqk", "fp32"): dict(BKB=32, BV=16, num_warps=4, num_stages=1),  # float32 tiles in registers
    ("bwd_dqk", "K <= 64"): dict(BKB=64, BV=32, num_warps=8, num_stages=1),  # 2 stages were slower here
    # two programs a chunk at K = 128 read dO, dVn, Uc, dAg, E + E^T half as often as four; 64 columns at any V
    ("bwd_dqk", "K >= 96"): dict(BKB=64, BV=64, num_warps=4, num_stages=2, exact_bv=True),
    ("step", "any"): dict(BV=32, num_warps=4),  # _step_kernel: the state read and written once, in small tiles
}


def _config(name, BK, V, fp32=False, BH=0, save=False, N=0):
    """CONFIGS's row for kernel `name`: BH (batch or sequence) x heads, save: states kept for a backward, N chunks."""
    few = BH * triton.cdiv(V, 32) < SMS  # the sequential kernels at 32 columns would leave SMs idle
    if name == "fuse_o":
        case = ("fills the GPU" if not few or BH * triton.cdiv(V, 16) >= 128 else
                "few programs, states saved or long" if save or N >= 256 else "few programs")
    elif name == "step":
        case = "any"
    elif fp32:
        case = "fp32"
    elif name in ("fwd", "bwd_state"):
        case = ("many programs" if not few else
                "few programs, one wave at 16" if BH * triton.cdiv(V, 16) <= SMS else "few programs")
    elif name in ("bwd_cc", "bwd_wy", "bwd_dqk"):
        case = "K >= 96" if BK >= 128 else "K <= 64"
    else:
        case = "16-bit"
    row = dict(CONFIGS[name, case])
    if "BV" in row and not row.pop("exact_bv", False):
        row["BV"] = min(row["BV"], max(16, triton.next_power_of_2(V)))
    if "BKB" in row:
        row["BKB"] = min(row["BKB"], BK)
    return row


# -----------------------------------------------------------------------------
# helpers


@triton.jit
def _beta(r2, eta, eps, KACZ: tl.constexpr):
    """The delta-rule step size from the squared key norm r2 = ||k||^2, as model.kla_beta: Kaczmarz's
    eta / (r2 + eps) (KACZ), 0 where r2 + eps = 0 (eps = 0 and a zero key: no write); or GDN's eta."""
    beta = eta
    if KACZ:
        d = r2 + eps
        beta = tl.where(d > 0, eta / d, 0.)
    return beta


@triton.jit
def _dbeta(r2, eta, beta, eps, KACZ: tl.constexpr):
    """(d beta / d eta, d beta / d r2) of _beta at r2, eta and its value beta, for the chain rule
    (d beta / d k = 2 k d beta / d r2)."""
    d_eta, d_r2 = 1., 0.
    if KACZ:
        d = r2 + eps
        d_eta = tl.where(d > 0, 1.0 / d, 0.)
        d_r2 = -beta * d_eta
    return d_eta, d_r2


@triton.jit
def _delta_step(S, decay, q, k, v, beta, scale):
    """One token of the recurrence on a float32 state tile S (K x BV) with q, k (K,), v (BV,): the new state
    decay S + beta k (v - decay S^T k)^T, and the output S^T (scale q) (BV,)."""
    S = S * decay
    e = v - tl.sum(S * k[:, None], 0)
    S += (beta * k)[:, None] * e[None, :]
    return S, tl.sum(S * q[:, None], 0) * scale


@triton.jit
def _ld(base, rows, cols, n_rows, n_cols, stride_r, stride_c):
    """A 2-D tile, zero outside (n_rows, n_cols)."""
    m = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(base + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=m, other=0.)


@triton.jit
def _st(base, rows, cols, n_rows, n_cols, stride_r, stride_c, x):
    m = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(base + rows[:, None] * stride_r + cols[None, :] * stride_c, x.to(base.dtype.element_ty), mask=m)


@triton.jit
def _seq_program(cu, cs, order, H, N, T, C: tl.constexpr, VARLEN: tl.constexpr):
    """The sequential kernels' program along axis 1: (i_p, the index of its state, (sequence or batch) * H + head;
    i_bh, its rows in the per-(batch, head) buffers; its chunks n0 .. n1 - 1; xb and xe: chunk n's tokens are rows
    xb + n C ... of q, k, v, o, those from xe on masked). VARLEN: the programs take the packed sequences longest
    first (order), so that no long one starts in the last wave, and each walks only its own chunks
    cs[seq] .. cs[seq + 1] - 1, whose tokens start at cu[seq] (cu_seqlens)."""
    i_p = tl.program_id(1).to(tl.int64)
    i_bh, n0, n1, xb, xe = i_p, 0, N, 0, T
    if VARLEN:
        i_s = tl.load(order + i_p // H).to(tl.int64)
        i_bh = i_p % H
        i_p = i_s * H + i_bh
        n0, n1 = tl.load(cs + i_s), tl.load(cs + i_s + 1)
        xb, xe = tl.load(cu + i_s) - n0 * C, tl.load(cu + i_s + 1)
    return i_p, i_bh, n0, n1, xb, xe


@triton.jit
def _chunk_rows(cr, i_n, T, N, C: tl.constexpr, VARLEN: tl.constexpr):
    """The token-parallel kernels' chunk i_n: its first token's row in q, k, v, o and the end of its sequence (rows
    from there on are masked: zeros in, nothing out). VARLEN: from the chunk table cr (_varlen_layout), so that the
    packed tokens are read and written where they lie, with no copy into the chunk-aligned buffers' layout."""
    x0, xe = i_n * C, T
    if VARLEN:
        x0, xe = tl.load(cr + i_n), tl.load(cr + N + i_n)
    return x0, xe


@triton.jit
def _inv_block_merge(s, o0: tl.constexpr, n: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr):
    """The lower-left n x n block of the inverse of the 2n x 2n diagonal block at row o0 of the chunk's scratch s:
    -I22 A21 I11, from the inverses I11, I22 of its diagonal halves (already in s) and A21 (still in s)."""
    r = tl.arange(0, n)
    i11 = tl.load(s + (o0 + r[:, None]) * C + o0 + r[None, :])
    i22 = tl.load(s + (o0 + n + r[:, None]) * C + o0 + n + r[None, :])
    a21 = tl.load(s + (o0 + n + r[:, None]) * C + o0 + r[None, :])
    return -tl.dot(i22, tl.dot(a21, i11, input_precision=PREC), input_precision=PREC)


# -----------------------------------------------------------------------------
# kernels


@triton.jit(do_not_specialize=["T", "Tp"])
def _prep_kernel(k, g, eta, bl_out, beta_out, ar_out, sa, cr, T, H, Tp, eps,
                 K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, KACZ: tl.constexpr, VARLEN: tl.constexpr,
                 PREC: tl.constexpr):
    """b (log2 domain), beta, and Ar = (I + A)^-1, A = StrictTril(Diag(beta) K K^T), in float32. A comes from one
    C x C product and goes to the chunk's float32 scratch sa (ar_out itself for float32 input), from which the
    four 16 x 16 diagonal blocks are loaded once and inverted together by forward substitution (their inverse held
    transposed: no layout conversion in the loop), then merged into the inverses of the 32 x 32 and the 64 x 64
    blocks (_inv_block_merge)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: offsets pass 2**31
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_n * C
    x0, xe = _chunk_rows(cr, i_n, T, Tp // C, C, VARLEN)
    r = tl.arange(0, C)
    m = x0 + r < xe
    tok = (i_b * T + x0 + r) * H + i_h
    gg = tl.maximum(tl.load(g + tok, mask=m, other=0.), GATE_FLOOR)
    # the cumulative sum as a masked row sum (tl.cumsum next to tl.sum has crashed Triton 3.6)
    bl = tl.sum(tl.where(r[:, None] >= r[None, :], gg[None, :], 0.), 1) * 1.4426950408889634  # log2(e)
    tl.store(bl_out + i_bh * Tp + t0 + r, bl)
    bk = _ld(k + (i_b * T * H + i_h) * K, x0 + r, tl.arange(0, BK), xe, K, H * K, 1)
    kf = bk.to(tl.float32)
    beta = _beta(tl.sum(kf * kf, 1), tl.load(eta + tok, mask=m, other=0.), eps, KACZ)
    tl.store(beta_out + i_bh * Tp + t0 + r, beta)
    A = tl.dot(bk, tl.trans(bk), input_precision=PREC) * beta[:, None]
    s = sa + (i_bh * Tp + t0) * C
    tl.store(s + r[:, None] * C + r[None, :], tl.where(r[:, None] > r[None, :], A, 0.))
    tl.debug_barrier()  # A is in the scratch
    # the diagonal blocks b = 0..3 at once: row i of (I + A_bb)^-1 is e_i - sum_{j < i} A_bb[i, j] (row j)
    rb, r16 = tl.arange(0, 4) * 16, tl.arange(0, 16)
    Ab = tl.load(s + (rb[:, None, None] + r16[None, :, None]) * C + rb[:, None, None] + r16[None, None, :])
    # E[b, c, j] = (I + A_bb)^-1 [j, c]: row i of the inverse is column i of E, a reduction along E's last axis
    E = tl.zeros([4, 16, 16], dtype=tl.float32) + (r16[:, None] == r16[None, :]).to(tl.float32)[None, :, :]
    for i in tl.static_range(1, 16):
        a = tl.sum(tl.where(r16[None, :, None] == i, Ab, 0.), 1)  # A_bb[i, :] (zero from column i on)
        E = tl.where(r16[None, None, :] == i, E - tl.sum(E * a[:, None, :], 2)[:, :, None], E)
    tl.debug_barrier()  # every row of the diagonal blocks of A is read
    tl.store(s + (rb[:, None, None] + r16[None, None, :]) * C + rb[:, None, None] + r16[None, :, None], E)
    tl.debug_barrier()
    X0 = _inv_block_merge(s, 0, 16, C, PREC)
    X1 = _inv_block_merge(s, 32, 16, C, PREC)
    tl.debug_barrier()  # the blocks (1, 0) and (3, 2) of A are read
    tl.store(s + (16 + r16[:, None]) * C + r16[None, :], X0)
    tl.store(s + (48 + r16[:, None]) * C + 32 + r16[None, :], X1)
    tl.debug_barrier()  # the scratch holds the inverses of the two 32 x 32 diagonal blocks
    X = _inv_block_merge(s, 0, 32, C, PREC)
    r32 = tl.arange(0, 32)
    I11 = tl.load(s + r32[:, None] * C + r32[None, :])
    I22 = tl.load(s + (32 + r32[:, None]) * C + 32 + r32[None, :])
    tl.debug_barrier()  # everything read before ar_out (which may be sa) is written
    ar = ar_out + (i_bh * Tp + t0) * C
    dt = ar_out.dtype.element_ty
    tl.store(ar + r32[:, None] * C + r32[None, :], I11.to(dt))
    tl.store(ar + r32[:, None] * C + 32 + r32[None, :], tl.zeros([32, 32], dtype=dt))
    tl.store(ar + (32 + r32[:, None]) * C + r32[None, :], X.to(dt))
    tl.store(ar + (32 + r32[:, None]) * C + 32 + r32[None, :], I22.to(dt))


@triton.jit(do_not_specialize=["T", "Tp"])
def _fwd_pre_kernel(q, k, v, bl_ptr, beta_ptr, ar, w, u0, aqk, cr, T, H, Tp,
                    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    VARLEN: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Token-parallel: everything of a chunk that does not depend on the state entering it,
        W = P Diag(exp b) K,  U0 = P V,  Aqk = Gamma o QK^T (C x C, causal),
    so that the sequential kernel only computes U = U0 - W S, the state update and O = scale (Diag(exp b) Q S +
    Aqk U) from the U it already has."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: offsets pass 2**31
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_n * C
    dt = DT
    r = tl.arange(0, C)
    rt, ck = t0 + r, tl.arange(0, BK)
    x0, xe = _chunk_rows(cr, i_n, T, Tp // C, C, VARLEN)
    rx = x0 + r  # token rows
    qk_off, v_off = (i_b * T * H + i_h) * K, (i_b * T * H + i_h) * V
    causal = r[:, None] >= r[None, :]
    bq = _ld(q + qk_off, rx, ck, xe, K, H * K, 1).to(dt)
    bk = _ld(k + qk_off, rx, ck, xe, K, H * K, 1).to(dt)
    bl = tl.load(bl_ptr + i_bh * Tp + rt)
    beta = tl.load(beta_ptr + i_bh * Tp + rt)
    bar = tl.load(ar + (i_bh * Tp + rt[:, None]) * C + r[None, :]).to(tl.float32)
    eb = tl.exp2(bl)
    gam = tl.exp2(tl.where(causal, bl[:, None] - bl[None, :], float("-inf")))  # masked before exp2
    P = (bar * beta[None, :] * gam).to(dt)
    Aqk = tl.where(causal, tl.dot(bq, tl.trans(bk), input_precision=PREC) * gam, 0.)
    tl.store(aqk + (i_bh * Tp + rt[:, None]) * C + r[None, :], Aqk.to(aqk.dtype.element_ty))
    W = tl.dot(P, (bk * eb[:, None]).to(dt), input_precision=PREC)
    _st(w + i_bh * Tp * K, rt, ck, Tp, K, K, 1, W)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        bv = _ld(v + v_off, rx, cv, xe, V, H * V, 1).to(dt)
        _st(u0 + i_bh * Tp * V, rt, cv, Tp, V, V, 1, tl.dot(P, bv, input_precision=PREC))


@triton.jit
def _chunk_out(bq, Sb, baqk, U, eb, scale, PREC: tl.constexpr, DT: tl.constexpr):
    """A chunk's output O = scale (Diag(exp b) Q S0 + Aqk U) (C x BV) from its state S0 (Sb, in DT) and its new
    values U."""
    o = eb[:, None] * tl.dot(bq, Sb, input_precision=PREC) + tl.dot(baqk, U.to(DT), input_precision=PREC)
    return o * scale


@triton.jit(do_not_specialize=["T", "Tp"])
def _fwd_kernel(q, k, bl_ptr, w, u0, aqk, h0, o, ht, hs, cu, cs, order, T, H, Tp, scale,
                K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                USE_H0: tl.constexpr, STORE_HT: tl.constexpr, SAVE_H: tl.constexpr, FUSE_O: tl.constexpr,
                VARLEN: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Sequential over chunks, state S (K x BV) in float32 registers:
        U = U0 - W S,  S <- exp(b_C) S + K^T Diag(exp(b_C - b)) U,  O = scale (Diag(exp b) Q S + Aqk U).
    FUSE_O = False leaves O to _fwd_o_kernel (S0 of every chunk must then be saved): fewer bytes per step.
    VARLEN: packed sequences laid out chunk-aligned (batch 1), a program per (sequence, head) walking only that
    sequence's chunks (_seq_program), so the sequences run in parallel."""
    i_v = tl.program_id(0)
    N = Tp // C
    i_p, i_bh, n0, n1, xb, xe = _seq_program(cu, cs, order, H, N, T, C, VARLEN)
    i_b, i_h = i_bh // H, i_bh % H
    dt = DT
    r = tl.arange(0, C)
    ck, cv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    qk_off, o_off = (i_b * T * H + i_h) * K, (i_b * T * H + i_h) * V
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        S += _ld(h0 + i_p * K * V, ck, cv, K, V, V, 1).to(tl.float32)
    for n in range(n0, n1):
        t0 = n * C
        rt, rx = t0 + r, xb + t0 + r  # rows of the chunk buffers, token rows
        if SAVE_H:
            _st(hs + (i_bh * N + n) * K * V, ck, cv, K, V, V, 1, S)
        bw = _ld(w + i_bh * Tp * K, rt, ck, Tp, K, K, 1).to(dt)
        bu = _ld(u0 + i_bh * Tp * V, rt, cv, Tp, V, V, 1).to(tl.float32)
        bk = _ld(k + qk_off, rx, ck, xe, K, H * K, 1).to(dt)
        bl = tl.load(bl_ptr + i_bh * Tp + rt)
        blC = tl.load(bl_ptr + i_bh * Tp + t0 + C - 1)
        Sb = S.to(dt)
        U = bu - tl.dot(bw, Sb, input_precision=PREC)
        if FUSE_O:
            bq = _ld(q + qk_off, rx, ck, xe, K, H * K, 1).to(dt)
            baqk = tl.load(aqk + (i_bh * Tp + rt[:, None]) * C + r[None, :]).to(dt)
            _st(o + o_off, rx, cv, xe, V, H * V, 1, _chunk_out(bq, Sb, baqk, U, tl.exp2(bl), scale, PREC, dt))
        S = tl.exp2(blC) * S + tl.dot(tl.trans(bk), (U * tl.exp2(blC - bl)[:, None]).to(dt), input_precision=PREC)
    if STORE_HT:
        _st(ht + i_p * K * V, ck, cv, K, V, V, 1, S)


@triton.jit(do_not_specialize=["T", "Tp"])
def _fwd_o_kernel(q, bl_ptr, w, u0, aqk, hs, o, cr, T, H, Tp, scale,
                  K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  VARLEN: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Token-parallel O = scale (Diag(exp b) Q S0 + Aqk (U0 - W S0)) with the saved S0 of each chunk, for
    FUSE_O = False."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    N = Tp // C
    r = tl.arange(0, C)
    rt, ck = i_n * C + r, tl.arange(0, BK)
    x0, xe = _chunk_rows(cr, i_n, T, N, C, VARLEN)
    rx = x0 + r  # token rows
    qk_off, o_off = (i_b * T * H + i_h) * K, (i_b * T * H + i_h) * V
    bq = _ld(q + qk_off, rx, ck, xe, K, H * K, 1).to(DT)
    bw = _ld(w + i_bh * Tp * K, rt, ck, Tp, K, K, 1).to(DT)
    baqk = tl.load(aqk + (i_bh * Tp + rt[:, None]) * C + r[None, :]).to(DT)
    eb = tl.exp2(tl.load(bl_ptr + i_bh * Tp + rt))
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        S0 = _ld(hs + (i_bh * N + i_n) * K * V, ck, cv, K, V, V, 1).to(DT)
        U = _ld(u0 + i_bh * Tp * V, rt, cv, Tp, V, V, 1).to(tl.float32) - tl.dot(bw, S0, input_precision=PREC)
        _st(o + o_off, rx, cv, xe, V, H * V, 1, _chunk_out(bq, S0, baqk, U, eb, scale, PREC, DT))


@triton.jit(do_not_specialize=["T", "Tp"])
def _bwd_pre_kernel(k, do, bl_ptr, beta_ptr, ar, aqk, wd, dv0, cr, T, H, Tp, scale,
                    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    VARLEN: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Token-parallel: dU = scale Aqk^T dO + Diag(exp(b_C - b)) K dS1 and dVn = P^T dU, so
        dVn = dV0 + Wd dS1,  dV0 = scale P^T Aqk^T dO,  Wd = P^T Diag(exp(b_C - b)) K,
    with Aqk = Gamma o QK^T as the forward kept it (read transposed)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: offsets pass 2**31
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_n * C
    dt = DT
    r = tl.arange(0, C)
    rt, ck = t0 + r, tl.arange(0, BK)
    x0, xe = _chunk_rows(cr, i_n, T, Tp // C, C, VARLEN)
    rx = x0 + r  # token rows
    qk_off, v_off = (i_b * T * H + i_h) * K, (i_b * T * H + i_h) * V
    causal_t = r[:, None] <= r[None, :]  # [j, i]: i >= j
    bk = _ld(k + qk_off, rx, ck, xe, K, H * K, 1).to(dt)
    bl = tl.load(bl_ptr + i_bh * Tp + rt)
    beta = tl.load(beta_ptr + i_bh * Tp + rt)
    blC = tl.load(bl_ptr + i_bh * Tp + t0 + C - 1)
    bar_t = tl.load(ar + (i_bh * Tp + t0 + r[None, :]) * C + r[:, None]).to(tl.float32)  # Ar^T
    Aqk_t = tl.load(aqk + (i_bh * Tp + t0 + r[None, :]) * C + r[:, None]).to(dt)  # Aqk^T (zero above i >= j)
    gam_t = tl.exp2(tl.where(causal_t, bl[None, :] - bl[:, None], float("-inf")))
    P_t = (bar_t * beta[:, None] * gam_t).to(dt)
    Wd = tl.dot(P_t, (bk * tl.exp2(blC - bl)[:, None]).to(dt), input_precision=PREC)
    _st(wd + i_bh * Tp * K, rt, ck, Tp, K, K, 1, Wd)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        bdo = _ld(do + v_off, rx, cv, xe, V, H * V, 1).to(dt)
        dU0 = tl.dot(Aqk_t, bdo, input_precision=PREC)
        _st(dv0 + i_bh * Tp * V, rt, cv, Tp, V, V, 1, scale * tl.dot(P_t, dU0.to(dt), input_precision=PREC))


@triton.jit(do_not_specialize=["T", "Tp"])
def _bwd_state_kernel(q, k, do, bl_ptr, wd, dv0, dht, dv, dhs, dh0, cu, cs, order, T, H, Tp, scale,
                      K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
                      DT: tl.constexpr):
    """Sequential over chunks in reverse, dS (K x BV) in float32 registers: dVn = dV0 + Wd dS1 (= dv),
    dS0 = exp(b_C) dS1 + scale (Diag(exp b) Q)^T dO - (Diag(exp b) K)^T dVn.
    VARLEN (as _fwd_kernel): each program walks back over its own sequence's chunks.
    Every load of a step is issued stages ahead (cp.async), which Triton does only for loads that feed a
    product's operands: dV0 enters as dV0 - Wd (-dS1), since as the product's accumulator it would be loaded
    synchronously; b_C, a scalar, is loaded a step ahead by hand (`python tools/ptxas_report.py --loops`)."""
    i_v = tl.program_id(0)
    N = Tp // C
    i_p, i_bh, n0, n1, xb, xe = _seq_program(cu, cs, order, H, N, T, C, VARLEN)
    i_b, i_h = i_bh // H, i_bh % H
    dt = DT
    r = tl.arange(0, C)
    ck, cv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    qk_off, v_off = (i_b * T * H + i_h) * K, (i_b * T * H + i_h) * V
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        dS += _ld(dht + i_p * K * V, ck, cv, K, V, V, 1).to(tl.float32)
    blC = tl.load(bl_ptr + i_bh * Tp + n1 * C - 1, mask=n1 > n0, other=0.0)  # b_C of the last chunk
    for n in range(n1 - 1, n0 - 1, -1):
        t0 = n * C
        rt, rx = t0 + r, xb + t0 + r  # rows of the chunk buffers, token rows
        blC_next = tl.load(bl_ptr + i_bh * Tp + t0 - 1, mask=n > n0, other=0.0)  # b_C of chunk n - 1
        _st(dhs + (i_bh * N + n) * K * V, ck, cv, K, V, V, 1, dS)
        bwd = _ld(wd + i_bh * Tp * K, rt, ck, Tp, K, K, 1).to(dt)
        bdv = _ld(dv0 + i_bh * Tp * V, rt, cv, Tp, V, V, 1).to(tl.float32)
        bk = _ld(k + qk_off, rx, ck, xe, K, H * K, 1).to(dt)
        bl = tl.load(bl_ptr + i_bh * Tp + rt)
        eb = tl.exp2(bl)
        dVn = bdv - tl.dot(bwd, (-dS).to(dt), input_precision=PREC)  # not dV0 + Wd dS1: see the docstring
        _st(dv + v_off, rx, cv, xe, V, H * V, 1, dVn)
        bq = _ld(q + qk_off, rx, ck, xe, K, H * K, 1).to(dt)
        bdo = _ld(do + v_off, rx, cv, xe, V, H * V, 1).to(dt)
        dS = tl.exp2(blC) * dS + tl.dot(tl.trans(bq), (bdo * (scale * eb)[:, None]).to(dt), input_precision=PREC)
        dS -= tl.dot(tl.trans(bk), (dVn * eb[:, None]).to(dt), input_precision=PREC)
        blC = blC_next
    if STORE_DH0:
        _st(dh0 + i_p * K * V, ck, cv, K, V, V, 1, dS)


@triton.jit(do_not_specialize=["T", "Tp"])
def _bwd_cc_kernel(k, v, do, bl_ptr, beta_ptr, ar, aqk, hs, dhs, uc, dovn, dp, ssc, cr, T, H, Tp, scale,
                   K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   VARLEN: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Backward, part 1 (grid (chunks, B*H)): the reductions over the value dimension that need S0 and dS1
    of the chunk. Only two C x C float32 accumulators live across the value loop, the transposes Vn dO^T and
    Vn dU^T (no C x K one; Vn enters both products as computed, dU^T is built from transposes of loaded tiles:
    one K-deep product a value block fewer than with Vn^T). Writes
        Uc = Diag(exp(b_C - b)) U (C x V), dO Vn^T and dU Vn^T (C x C), and exp(b_C) <S0, dS1>, the gate
        gradient's term of the decay across the chunk (its other terms that need S0 or dS1 come from
        _bwd_dqk_kernel's accumulators, which keeps this loop's registers free of spills)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: offsets pass 2**31
    i_b, i_h = i_bh // H, i_bh % H
    N = Tp // C
    t0 = i_n * C
    dt = DT
    r = tl.arange(0, C)
    rt, ck = t0 + r, tl.arange(0, BK)
    x0, xe = _chunk_rows(cr, i_n, T, N, C, VARLEN)
    rx = x0 + r  # token rows
    qk_off, v_off = (i_b * T * H + i_h) * K, (i_b * T * H + i_h) * V
    h_off = (i_bh * N + i_n) * K * V
    ar_off = (i_bh * Tp + t0) * C
    causal = r[:, None] >= r[None, :]
    bk = _ld(k + qk_off, rx, ck, xe, K, H * K, 1).to(dt)
    bl = tl.load(bl_ptr + i_bh * Tp + rt)
    beta = tl.load(beta_ptr + i_bh * Tp + rt)
    blC = tl.load(bl_ptr + i_bh * Tp + t0 + C - 1)
    eb = tl.exp2(bl)
    ecb = tl.exp2(blC - bl)
    gam = tl.exp2(tl.where(causal, bl[:, None] - bl[None, :], float("-inf")))
    baqk = tl.load(aqk + ar_off + r[:, None] * C + r[None, :]).to(dt)  # the forward's Gamma o QK^T
    bar = tl.load(ar + ar_off + r[:, None] * C + r[None, :]).to(tl.float32)
    P = (bar * beta[None, :] * gam).to(dt)

    dOVn_t = tl.zeros([C, C], dtype=tl.float32)   # (dO Vn^T)^T = Vn dO^T
    dP_t = tl.zeros([C, C], dtype=tl.float32)     # (dU Vn^T)^T = Vn dU^T
    sS = tl.zeros([BV], dtype=tl.float32)       # column sums of S0 o dS1
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        S0 = _ld(hs + h_off, ck, cv, K, V, V, 1)
        dS1 = _ld(dhs + h_off, ck, cv, K, V, V, 1)
        sS += tl.sum(S0.to(tl.float32) * dS1.to(tl.float32), 0)
        S0 = S0.to(dt)
        dS1 = dS1.to(dt)
        bv = _ld(v + v_off, rx, cv, xe, V, H * V, 1).to(dt)
        bdo = _ld(do + v_off, rx, cv, xe, V, H * V, 1).to(dt)
        kS = tl.dot(bk, S0, input_precision=PREC)
        Vn = (bv.to(tl.float32) - eb[:, None] * kS).to(dt)
        U = tl.dot(P, Vn, input_precision=PREC)
        _st(uc + i_bh * Tp * V, rt, cv, Tp, V, V, 1, U * ecb[:, None])
        # dU^T = scale dO^T (Gamma o QK^T) + (Diag(e^{b_C - b}) K dS1)^T from the transposes of loaded tiles
        kdS_t = tl.dot(tl.trans(dS1), tl.trans(bk), input_precision=PREC) * ecb[None, :]
        dU_t = scale * tl.dot(tl.trans(bdo), baqk, input_precision=PREC) + kdS_t
        dOVn_t = tl.dot(Vn, tl.trans(bdo), acc=dOVn_t, input_precision=PREC)
        dP_t = tl.dot(Vn, dU_t.to(dt), acc=dP_t, input_precision=PREC)

    # stored transposed: dO Vn^T and dU Vn^T in the buffers' row order
    tl.store(dovn + i_bh * Tp * C + rt[None, :] * C + r[:, None], dOVn_t.to(dovn.dtype.element_ty))
    tl.store(dp + i_bh * Tp * C + rt[None, :] * C + r[:, None], dP_t.to(dp.dtype.element_ty))
    tl.store(ssc + i_bh * N + i_n, tl.exp2(blC) * tl.sum(sS, 0))


@triton.jit(do_not_specialize=["T", "Tp"])
def _bwd_wy_kernel(k, g, eta, bl_ptr, beta_ptr, ar, aqk, dovn, dp, dag, emat, coef, dg, deta, cr, T, H, Tp,
                   scale, eps, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, KACZ: tl.constexpr,
                   VARLEN: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Backward, part 2 (grid (chunks, B*H)): the C x C algebra of a chunk. From _bwd_cc_kernel's dO Vn^T and
    dU Vn^T: the output path dA = scale dO U^T, the WY backward dA0, dbeta and the beta chain rule, dg (reverse
    cumsum of this kernel's terms) and deta (final). Writes for _bwd_dqk_kernel dAg = dA o Gamma (causal),
    E + E^T with E = Diag(beta) dA0 (strictly lower) and the per-position coefficient of k in dk. Every operand is
    requested at the start, before the first product: one round trip to memory, not one between products."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # int64: offsets pass 2**31
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_n * C
    dt = DT
    r = tl.arange(0, C)
    rt, ck = t0 + r, tl.arange(0, BK)
    x0, xe = _chunk_rows(cr, i_n, T, Tp // C, C, VARLEN)
    rx = x0 + r  # token rows
    qk_off = (i_b * T * H + i_h) * K
    ar_off = (i_bh * Tp + t0) * C
    causal = r[:, None] >= r[None, :]
    causal_t = r[:, None] <= r[None, :]  # [j, i]: i >= j
    bl = tl.load(bl_ptr + i_bh * Tp + rt)
    beta = tl.load(beta_ptr + i_bh * Tp + rt)
    m = rx < xe
    bar_t = tl.load(ar + ar_off + r[None, :] * C + r[:, None]).to(tl.float32)  # Ar^T
    bar = tl.load(ar + ar_off + r[:, None] * C + r[None, :]).to(tl.float32)
    dOVn = tl.load(dovn + ar_off + r[:, None] * C + r[None, :]).to(dt)
    baqk = tl.load(aqk + ar_off + r[:, None] * C + r[None, :]).to(tl.float32)
    bdp = tl.load(dp + ar_off + r[:, None] * C + r[None, :]).to(tl.float32)
    bk = _ld(k + qk_off, rx, ck, xe, K, H * K, 1).to(dt)
    eta_c = tl.load(eta + (i_b * T + rx) * H + i_h, mask=m, other=0.)
    bg = tl.load(g + (i_b * T + rx) * H + i_h, mask=m, other=0.)
    # output path: dA = scale dO U^T = scale (dO Vn^T) P^T (causal); dq, dk take dA o Gamma and its transpose
    gam_t = tl.exp2(tl.where(causal_t, bl[None, :] - bl[:, None], float("-inf")))
    P_t = (bar_t * beta[:, None] * gam_t).to(dt)
    dA = tl.where(causal, scale * tl.dot(dOVn, P_t, input_precision=PREC), 0.)
    gam = tl.exp2(tl.where(causal, bl[:, None] - bl[None, :], float("-inf")))
    tl.store(dag + ar_off + r[:, None] * C + r[None, :], (dA * gam).to(dag.dtype.element_ty))
    F = dA * baqk  # dA o Gamma o QK^T (dA is causal)
    db = tl.sum(F, 1) - tl.sum(F, 0)  # d / d b (natural log domain)
    # WY path: P = Gamma o (Ar Diag(beta)), Ar = (I + A0)^-1, A0 = StrictTril(Diag(beta) K K^T)
    dM = tl.where(causal, bdp * gam, 0.)
    F = dM * bar * beta[None, :]
    db += tl.sum(F, 1) - tl.sum(F, 0)
    dbeta = tl.sum(dM * bar, 0)
    dA0 = -tl.dot(bar_t, tl.dot(dM * beta[None, :], bar_t, input_precision=PREC), input_precision=PREC)
    dA0 = tl.where(r[:, None] > r[None, :], dA0, 0.)
    dbeta += tl.sum(dA0 * tl.dot(bk, tl.trans(bk), input_precision=PREC), 1)
    # dk += (E + E^T) K in _bwd_dqk_kernel: E + E^T stored once (the transpose of a computed matrix into a sum)
    E = dA0 * beta[:, None]
    tl.store(emat + ar_off + r[:, None] * C + r[None, :], (E + tl.trans(E)).to(emat.dtype.element_ty))
    # the chain rule through beta(||k||^2, eta): deta, and dk += 2 dbeta (d beta / d r2) k in _bwd_dqk_kernel
    kf = bk.to(tl.float32)
    d_eta, d_r2 = _dbeta(tl.sum(kf * kf, 1), eta_c, beta, eps, KACZ)
    bdeta = dbeta * d_eta
    if KACZ:
        tl.store(coef + i_bh * Tp + rt, 2.0 * dbeta * d_r2)
    # b = cumsum(g): dg_j = sum_{i >= j} db_i; 0 below the floor that _prep_kernel raised g to
    bdg = tl.sum(tl.where(causal, db[:, None], 0.), 0)
    bdg = tl.where(bg < GATE_FLOOR, 0., bdg)
    tl.store(dg + (i_b * T + rx) * H + i_h, bdg, mask=m)
    tl.store(deta + (i_b * T + rx) * H + i_h, bdeta, mask=m)


@triton.jit(do_not_specialize=["T", "Tp"])
def _bwd_dqk_kernel(q, k, do, dv, bl_ptr, hs, dhs, uc, dag, emat, coef, dq, dk, qdp, qdc, cr, T, H, Tp, scale,
                    K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BKB: tl.constexpr, BV: tl.constexpr,
                    KACZ: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Backward, part 2 (grid (K / BKB, chunks, B*H)): dq and dk of BKB key columns of one chunk, three
    C x BKB accumulators (dO S0^T, dVn S0^T, Uc dS1^T), from _bwd_cc_kernel's Uc and _bwd_wy_kernel's dAg,
    E + E^T and beta coefficient:
        dq = scale Diag(exp b) dO S0^T + dAg K
        dk = Uc dS1^T - Diag(exp b) dVn S0^T + dAg^T Q + (E + E^T) K + Diag(coef) K
    Every transposed operand is a tile loaded from memory (dAg^T is loaded transposed). Also the gate gradient's
    terms that need S0 or dS1, over its key columns, from its accumulators: the rows exp(b) (scale (dO S0^T) o Q
    - (dVn S0^T) o K) - (Uc dS1^T) o K (qdp) and the sum of the last (qdc), which _bwd_dg_kernel adds into dg
    (not in _bwd_cc_kernel's value loop: registers, and a synchronous load). The epilogue's tiles are requested
    together after the value loop, before its first product: one memory round trip, not one between products."""
    i_k, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    N = Tp // C
    t0 = i_n * C
    dt = DT
    r = tl.arange(0, C)
    rt, ck = t0 + r, i_k * BKB + tl.arange(0, BKB)
    x0, xe = _chunk_rows(cr, i_n, T, N, C, VARLEN)
    rx = x0 + r  # token rows
    qk_off, v_off = (i_b * T * H + i_h) * K, (i_b * T * H + i_h) * V
    h_off = (i_bh * N + i_n) * K * V
    ar_off = (i_bh * Tp + t0) * C
    neb = -tl.exp2(tl.load(bl_ptr + i_bh * Tp + rt))
    X = tl.zeros([C, BKB], dtype=tl.float32)    # dO S0^T
    Y = tl.zeros([C, BKB], dtype=tl.float32)    # dVn S0^T
    bdk = tl.zeros([C, BKB], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        S0_t = tl.trans(_ld(hs + h_off, ck, cv, K, V, V, 1).to(dt))  # transposes of loaded tiles
        dS1_t = tl.trans(_ld(dhs + h_off, ck, cv, K, V, V, 1).to(dt))
        bdo = _ld(do + v_off, rx, cv, xe, V, H * V, 1).to(dt)
        bdv = _ld(dv + v_off, rx, cv, xe, V, H * V, 1).to(dt)
        buc = _ld(uc + i_bh * Tp * V, rt, cv, Tp, V, V, 1).to(dt)
        X = tl.dot(bdo, S0_t, acc=X, input_precision=PREC)
        Y = tl.dot(bdv, S0_t, acc=Y, input_precision=PREC)
        bdk = tl.dot(buc, dS1_t, acc=bdk, input_precision=PREC)
    bk = _ld(k + qk_off, rx, ck, xe, K, H * K, 1).to(dt)
    dAg = tl.load(dag + ar_off + r[:, None] * C + r[None, :]).to(dt)  # the tiles, all before the first product
    bq = _ld(q + qk_off, rx, ck, xe, K, H * K, 1).to(dt)
    dAg_t = tl.load(dag + ar_off + r[None, :] * C + r[:, None]).to(dt)
    EE = tl.load(emat + ar_off + r[:, None] * C + r[None, :]).to(dt)
    cS = tl.sum(bdk * bk.to(tl.float32), 1)  # rows of (Uc dS1^T) o K: exp(b_C - b_i) k_i^T dS1 u_i, these keys
    bdk += neb[:, None] * Y
    bdq = tl.dot(dAg, bk, acc=X * (-scale * neb)[:, None], input_precision=PREC)
    _st(dq + qk_off, rx, ck, xe, K, H * K, 1, bdq)
    # the docstring's gate terms: rows of dO o (Q S0) = rows of (dO S0^T) o Q, dVn o (K S0) likewise, times exp(b)
    i_q = i_k * tl.num_programs(2) + i_bh
    qd = scale * tl.sum(X * bq.to(tl.float32), 1) - tl.sum(Y * bk.to(tl.float32), 1)
    tl.store(qdp + i_q * Tp + rt, -neb * qd - cS)
    tl.store(qdc + i_q * N + i_n, tl.sum(cS, 0))
    bdk = tl.dot(dAg_t, bq, acc=bdk, input_precision=PREC)
    bdk = tl.dot(EE, bk, acc=bdk, input_precision=PREC)
    if KACZ:
        bdk += tl.load(coef + i_bh * Tp + rt)[:, None] * bk.to(tl.float32)
    _st(dk + qk_off, rx, ck, xe, K, H * K, 1, bdk)


@triton.jit(do_not_specialize=["T", "Tp"])
def _bwd_dg_kernel(qdp, qdc, ssc, g, dg, cr, T, H, Tp, NKB: tl.constexpr, C: tl.constexpr,
                   VARLEN: tl.constexpr):
    """Grid (chunks, B*H): adds to dg the reverse cumulative sum of the gate terms d / d b that need S0 or dS1:
    _bwd_dqk_kernel's rows (qdp) and per-chunk sums (qdc) over its key blocks, the sums and _bwd_cc_kernel's
    exp(b_C) <S0, dS1> (ssc) at the chunk's last position."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    r = tl.arange(0, C)
    rt = i_n * C + r
    x0, xe = _chunk_rows(cr, i_n, T, Tp // C, C, VARLEN)
    rx = x0 + r
    m = rx < xe
    db = tl.zeros([C], dtype=tl.float32)
    tot = tl.load(ssc + i_bh * (Tp // C) + i_n)
    for i_k in tl.static_range(NKB):
        db += tl.load(qdp + (i_k * tl.num_programs(1) + i_bh) * Tp + rt)
        tot += tl.load(qdc + (i_k * tl.num_programs(1) + i_bh) * (Tp // C) + i_n)
    db += tl.where(r == C - 1, tot, 0.)
    bdg = tl.sum(tl.where(r[:, None] >= r[None, :], db[:, None], 0.), 0)
    tok = (i_b * T + rx) * H + i_h
    bdg = tl.where(tl.load(g + tok, mask=m, other=0.) < GATE_FLOOR, 0., bdg)
    tl.store(dg + tok, tl.load(dg + tok, mask=m, other=0.) + bdg, mask=m)


@triton.jit
def _step_kernel(q, k, v, g, eta, s_in, o, s_out, scale, eps,
                 K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KACZ: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    bq = tl.load(q + i_bh * K + rk, mask=mk, other=0.).to(tl.float32)
    bk = tl.load(k + i_bh * K + rk, mask=mk, other=0.).to(tl.float32)
    bv = tl.load(v + i_bh * V + rv, mask=mv, other=0.).to(tl.float32)
    gg = tl.load(g + i_bh).to(tl.float32)
    beta = _beta(tl.sum(bk * bk, 0), tl.load(eta + i_bh).to(tl.float32), eps, KACZ)
    offs = i_bh * K * V + rk[:, None] * V + rv[None, :]
    ms = mk[:, None] & mv[None, :]
    S, out = _delta_step(tl.load(s_in + offs, mask=ms, other=0.).to(tl.float32), tl.exp(gg), bq, bk, bv, beta, scale)
    tl.store(o + i_bh * V + rv, out.to(o.dtype.element_ty), mask=mv)
    tl.store(s_out + offs, S, mask=ms)


# -----------------------------------------------------------------------------
# launch


_interpreter_warned = [False]  # the interpreter's bf16 warning is given once a process
_layout_cache = [None]  # (values, device, layout) of the last cu_seqlens: a model's layers share one copy to the device


def _check(q, k, v, g, eta, state, eps, step=False, cu_seqlens=None, scale=None):
    """A ValueError naming the first input the kernels cannot take, else cu_seqlens's layout or None. No sync (CUDA
    graphs): g <= 0 is not checked; only cu_seqlens is read back (_check_cu_seqlens)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("eta", eta)):
        if not torch.is_tensor(x) or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{name} has dtype {getattr(x, 'dtype', type(x))}; the Triton kernel takes bfloat16, "
                             "float16 or float32 (use model.kla_chunkwise for float64)")
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q must be (B, T, H, K) and v (B, T, H, V), got {tuple(q.shape)} and {tuple(v.shape)}")
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if not q.is_cuda and not interpreted:
        raise ValueError(f"q is on {q.device}: the Triton kernels take CUDA tensors (model.kla_chunkwise runs on any "
                         "device; TRITON_INTERPRET=1 runs the kernels on the CPU, slowly)")
    (B, T, H, K), V = q.shape, v.shape[-1]
    if H == 0 or K == 0 or V == 0:
        raise ValueError(f"the heads are empty: H = {H}, K = {K}, V = {V}; each must be at least 1")
    state_name = "state" if step else "initial_state"
    if step and state is None:
        raise ValueError("kla_step needs the state, a float32 tensor of shape (B, H, K, V) (zeros to start)")
    layout = None if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, q)
    n_state = B if layout is None else layout[-1]  # (N, H, K, V) states with N packed sequences
    want = {"k": (B, T, H, K), "v": (B, T, H, V), "g": (B, T, H), "eta": (B, T, H), state_name: (n_state, H, K, V)}
    for (name, shape), x in zip(want.items(), (k, v, g, eta, state)):
        if x is not None and (not torch.is_tensor(x) or tuple(x.shape) != shape or x.device != q.device):
            raise ValueError(f"{name} must be a tensor of shape {shape} on {q.device} (B, T, H, K from q, V from v), "
                             f"got {getattr(x, 'shape', type(x))} on {getattr(x, 'device', None)}")
    if state is not None and not state.is_floating_point():
        raise ValueError(f"{state_name} must be floating point, got {state.dtype}")
    if B == 0 or T == 0:
        raise ValueError(f"the input is empty: (B, T) = ({B}, {T})")
    if step and T != 1:
        raise ValueError(f"kla_step takes one token: q must be (B, 1, H, K), got T = {T}")
    if K > 128 or V > 1024:
        raise ValueError(f"head sizes K = {K}, V = {V}; the kernel supports K <= 128 and V <= 1024")
    if not (isinstance(eps, numbers.Real) and eps >= 0):
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    if scale is not None and not (isinstance(scale, numbers.Real) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number (None: K^-0.5), got {scale!r}")
    dtypes = {x.dtype for x in (q, k, v)} & {torch.bfloat16, torch.float16}
    if interpreted and dtypes and not _interpreter_warned[0]:
        _interpreter_warned[0] = True
        warnings.warn(f"{min(dtypes, key=str)} inputs under TRITON_INTERPRET=1: Triton's interpreter multiplies bf16 "
                      "tiles wrongly, so the kernels' results are garbage there (use float32, or model.kla_chunkwise)")
    return layout


def _check_cu_seqlens(cu_seqlens, q):
    """_varlen_layout's layout, or a ValueError as checks.check_cu_seqlens's; the last values' layout is kept."""
    if not torch.is_tensor(cu_seqlens) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be an int32 or int64 tensor, got {getattr(cu_seqlens, 'dtype', type(cu_seqlens))}")
    if cu_seqlens.dim() != 1 or len(cu_seqlens) < 2:
        raise ValueError(f"cu_seqlens must be 1-D of length N + 1 >= 2, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, q on {q.device}")
    if q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed in a batch of 1, got B = {q.shape[0]}")
    bounds = cu_seqlens.tolist()
    cached = _layout_cache[0]
    if cached is not None and cached[0] == bounds and cached[1] == q.device and bounds[-1] == q.shape[1]:
        return cached[2]
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds[0]}")
    if any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty sequence), got {bounds}")
    if bounds[-1] != q.shape[1]:
        raise ValueError(f"cu_seqlens must end at T = {q.shape[1]}, got {bounds[-1]}")
    layout = _varlen_layout(bounds, q.device)
    _layout_cache[0] = (bounds, q.device, layout)
    return layout


def _varlen_layout(bounds, device):
    """Sequence n takes chunks cs[n] .. cs[n + 1] - 1. Returns (cu_seqlens (N + 1,) int32, cs (N + 1,), the sequences
    from the most chunks to the fewest (N,) for _seq_program, the chunk table cr (2 n_chunks,) for _chunk_rows: each
    chunk's first token, then its sequence's end; n_chunks, N), built on the host, copied to the device once."""
    C = C_CHUNK
    cu = torch.tensor(bounds)
    lens = cu[1:] - cu[:-1]
    n_ch = (lens + C - 1) // C
    cs = torch.cat([cu.new_zeros(1), n_ch.cumsum(0)])
    n_chunks, N = int(cs[-1]), len(lens)
    seq = torch.repeat_interleave(torch.arange(N), n_ch)  # the sequence of every chunk
    first = cu[seq] + (torch.arange(n_chunks) - cs[seq]) * C
    order = torch.argsort(cs[:-1] - cs[1:], stable=True)  # most chunks first
    parts = torch.cat([cu, cs, order, first, cu[seq + 1]]).int().to(device).split([N + 1, N + 1, N, 2 * n_chunks])
    return *parts, n_chunks, N


def _common_dtype(q, k, v):
    """q, k, v in one dtype, the narrowest of theirs: the kernels pick their precision from it."""
    dt = min((q.dtype, k.dtype, v.dtype), key=lambda d: torch.finfo(d).bits)
    return (x.to(dt) for x in (q, k, v))


def _block_k(K):
    return max(16, triton.next_power_of_2(K))


def _precision(x):
    """(float32?, tl.dot's input_precision, operand type, stored buffers' dtype): float16 widened to bfloat16 (KLA's
    1 / ||k||^2 range)."""
    if x.dtype == torch.float32:
        return True, "ieee", tl.float32, torch.float32
    return False, "tf32", tl.bfloat16, torch.bfloat16


def _chunk_forward(q, k, v, g, eta, h0, cu, cs, order, cr, scale, eps, output_final_state, kaczmarz, save, N, n_state):
    """The forward kernels on contiguous q, k, v (one dtype), float32 g, eta, h0: (o, final states, and for the backward
    b, beta, the inverses, chunk states, Aqk; None if absent). cu, cs, order, cr, N, n_state: kla_chunk's `packed`."""
    (B, T, H, K), V = q.shape, v.shape[-1]
    C, BK, Tp, varlen = C_CHUNK, _block_k(K), N * C_CHUNK, cu is not None  # Tp: the chunk buffers' rows
    dev, (fp32, prec, dt, sdt) = q.device, _precision(q)  # sdt: the stored inverses and states
    bl, beta = (torch.empty(B * H, Tp, device=dev, dtype=torch.float32) for _ in range(2))
    ar = torch.empty(B * H, Tp, C, device=dev, dtype=sdt)
    sa = ar if fp32 else torch.empty(B * H, Tp, C, device=dev, dtype=torch.float32)  # A in float32
    _prep_kernel[(N, B * H)](k, g, eta, bl, beta, ar, sa, cr, T, H, Tp, eps, K=K, C=C, BK=BK, KACZ=kaczmarz,
                             VARLEN=varlen, PREC=prec, **_config("prep", BK, V, fp32))
    del sa
    o = torch.empty(B, T, H, V, device=dev, dtype=q.dtype)
    ht = torch.empty(n_state, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    fuse_o = _config("fuse_o", BK, V, fp32, n_state * H, save, N)["FUSE_O"]
    hs = torch.empty(B * H, N, K, V, device=dev, dtype=sdt) if save or not fuse_o else None
    w, u0, aqk = (torch.empty(B * H, Tp, n, device=dev, dtype=sdt) for n in (K, V, C))
    pre = _config("pre", BK, V, fp32)
    _fwd_pre_kernel[(N, B * H)](q, k, v, bl, beta, ar, w, u0, aqk, cr, T, H, Tp, K=K, V=V, C=C, BK=BK,
                                VARLEN=varlen, PREC=prec, DT=dt, **pre)
    seq = _config("fwd", BK, V, fp32, n_state * H)
    _fwd_kernel[(triton.cdiv(V, seq["BV"]), n_state * H)](q, k, bl, w, u0, aqk, h0, o, ht, hs, cu, cs, order, T, H,
        Tp, scale, K=K, V=V, C=C, BK=BK, USE_H0=h0 is not None, STORE_HT=output_final_state, SAVE_H=hs is not None,
        FUSE_O=fuse_o, VARLEN=varlen, PREC=prec, DT=dt, **seq)
    if not fuse_o:
        _fwd_o_kernel[(N, B * H)](q, bl, w, u0, aqk, hs, o, cr, T, H, Tp, scale, K=K, V=V, C=C, BK=BK,
                                  VARLEN=varlen, PREC=prec, DT=dt, **pre)
    return o, ht, bl, beta, ar, hs, aqk if save else None


def _chunk_backward(do, dht, q, k, v, g, eta, bl, beta, ar, hs, aqk, cu, cs, order, cr, scale, eps, kaczmarz,
                    has_h0, N, n_state):
    """The backward kernels: (dq, dk, dv, dg, deta, dh0 or None), dg, deta, dh0 in float32."""
    (B, T, H, K), V = q.shape, v.shape[-1]
    C, BK, Tp, varlen = C_CHUNK, _block_k(K), N * C_CHUNK, cu is not None
    dev, (fp32, prec, dt, sdt) = q.device, _precision(q)  # do contiguous (_chunk_grad)
    dv, dhs = torch.empty_like(v), torch.empty_like(hs)
    dh0 = torch.empty(n_state, H, K, V, device=dev, dtype=torch.float32) if has_h0 else None
    dht = None if dht is None else dht.float().contiguous()
    wd, dv0 = (torch.empty(B * H, Tp, n, device=dev, dtype=sdt) for n in (K, V))
    _bwd_pre_kernel[(N, B * H)](k, do, bl, beta, ar, aqk, wd, dv0, cr, T, H, Tp, scale, K=K, V=V, C=C, BK=BK,
                                VARLEN=varlen, PREC=prec, DT=dt, **_config("pre", BK, V, fp32))
    seq = _config("bwd_state", BK, V, fp32, n_state * H)
    _bwd_state_kernel[(triton.cdiv(V, seq["BV"]), n_state * H)](
        q, k, do, bl, wd, dv0, dht, dv, dhs, dh0, cu, cs, order, T, H, Tp, scale, K=K, V=V, C=C, BK=BK,
        USE_DHT=dht is not None, STORE_DH0=has_h0, VARLEN=varlen, PREC=prec, DT=dt, **seq)
    del wd, dv0
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dg, deta = (torch.empty(B, T, H, device=dev, dtype=torch.float32) for _ in range(2))
    # dU Vn^T (dp) in bf16 like the other C x C buffers: faster than float32, within the float64 checks (docs/kernel.md)
    uc, dovn, dag, emat, dp = (torch.empty(B * H, Tp, n, device=dev, dtype=sdt) for n in (V, C, C, C, C))
    coef, ssc = (torch.empty(B * H, n, device=dev, dtype=torch.float32) for n in (Tp, N))
    _bwd_cc_kernel[(N, B * H)](k, v, do, bl, beta, ar, aqk, hs, dhs, uc, dovn, dp, ssc, cr, T, H, Tp, scale, K=K,
                               V=V, C=C, BK=BK, VARLEN=varlen, PREC=prec, DT=dt, **_config("bwd_cc", BK, V, fp32))
    _bwd_wy_kernel[(N, B * H)](k, g, eta, bl, beta, ar, aqk, dovn, dp, dag, emat, coef, dg, deta, cr, T, H, Tp, scale,
                               eps, K=K, C=C, BK=BK, KACZ=kaczmarz, VARLEN=varlen, PREC=prec, DT=dt,
                               **_config("bwd_wy", BK, V, fp32))
    del dovn, dp
    dqk = _config("bwd_dqk", BK, V, fp32)
    NKB = triton.cdiv(K, dqk["BKB"])
    qdp, qdc = (torch.empty(NKB, B * H, n, device=dev, dtype=torch.float32) for n in (Tp, N))
    _bwd_dqk_kernel[(NKB, N, B * H)](q, k, do, dv, bl, hs, dhs, uc, dag, emat, coef, dq, dk, qdp, qdc, cr, T, H, Tp,
                                     scale, K=K, V=V, C=C, KACZ=kaczmarz, VARLEN=varlen, PREC=prec, DT=dt, **dqk)
    _bwd_dg_kernel[(N, B * H)](qdp, qdc, ssc, g, dg, cr, T, H, Tp, NKB=NKB, C=C, VARLEN=varlen)
    return dq, dk, dv, dg, deta, dh0


_T, _OT = torch.Tensor, Optional[torch.Tensor]
_Six, _Seven = Tuple[(_T,) * 6], Tuple[(_T,) * 7]


def _filled(q, out):
    """The outputs with empty tensors for the missing ones (an operator returns tensors only)."""
    return tuple(q.new_empty(0, dtype=torch.float32) if x is None else x for x in out)


# The kernels as two PyTorch operators with an autograd formula, so that torch.compile sees one opaque call (no
# graph break: a whole model compiles to one graph, which CUDA graphs can replay). Missing outputs: empty tensors.
@torch.library.custom_op("kla::chunk", mutates_args=())
def _chunk_op(q: _T, k: _T, v: _T, g: _T, eta: _T, h0: _OT, cu: _OT, cs: _OT, order: _OT, cr: _OT, scale: float,
              eps: float, output_final_state: bool, kaczmarz: bool, save: bool, N: int, n_state: int) -> _Seven:
    return _filled(q, _chunk_forward(q, k, v, g, eta, h0, cu, cs, order, cr, scale, eps, output_final_state,
                                     kaczmarz, save, N, n_state))


@_chunk_op.register_fake
def _(q, k, v, g, eta, h0, cu, cs, order, cr, scale, eps, output_final_state, kaczmarz, save, N, n_state):
    (B, T, H, K), V, C = q.shape, v.shape[-1], C_CHUNK
    f32, (fp32, _, _, sdt) = torch.float32, _precision(q)
    fuse_o = _config("fuse_o", _block_k(K), V, fp32, n_state * H, save, N)["FUSE_O"]
    return (q.new_empty(B, T, H, V),
            q.new_empty(n_state, H, K, V, dtype=f32) if output_final_state else q.new_empty(0, dtype=f32),
            q.new_empty(B * H, N * C, dtype=f32), q.new_empty(B * H, N * C, dtype=f32),
            q.new_empty(B * H, N * C, C, dtype=sdt),
            q.new_empty(B * H, N, K, V, dtype=sdt) if save or not fuse_o else q.new_empty(0, dtype=f32),
            q.new_empty(B * H, N * C, C, dtype=sdt) if save else q.new_empty(0, dtype=f32))


@torch.library.custom_op("kla::chunk_backward", mutates_args=())
def _chunk_backward_op(do: _T, dht: _OT, q: _T, k: _T, v: _T, g: _T, eta: _T, bl: _T, beta: _T, ar: _T, hs: _T,
                       aqk: _T, cu: _OT, cs: _OT, order: _OT, cr: _OT, scale: float, eps: float, kaczmarz: bool,
                       has_h0: bool, N: int, n_state: int) -> _Six:
    return _filled(q, _chunk_backward(do, dht, q, k, v, g, eta, bl, beta, ar, hs, aqk, cu, cs, order, cr, scale, eps,
                                      kaczmarz, has_h0, N, n_state))


@_chunk_backward_op.register_fake
def _(do, dht, q, k, v, g, eta, bl, beta, ar, hs, aqk, cu, cs, order, cr, scale, eps, kaczmarz, has_h0, N, n_state):
    H, K, V = q.shape[2], q.shape[3], v.shape[-1]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g), torch.empty_like(eta),
            q.new_empty(n_state, H, K, V, dtype=torch.float32) if has_h0 else q.new_empty(0, dtype=torch.float32))


def _chunk_setup_context(ctx, inputs, output):
    q, k, v, g, eta, h0, cu, cs, order, cr, scale, eps, _, kaczmarz, _, N, n_state = inputs
    ctx.save_for_backward(q, k, v, g, eta, *output[2:], cu, cs, order, cr)
    ctx.meta = (scale, eps, kaczmarz, h0 is not None, N, n_state)
    # no zero gradients made for the outputs kept for the backward, nor for o or the final state left unused (time)
    ctx.mark_non_differentiable(*output[2:])
    ctx.set_materialize_grads(False)


def _chunk_grad(ctx, do, dht, *_, backward=_chunk_backward_op):
    q, k, v, g, eta, bl, beta, ar, hs, aqk, cu, cs, order, cr = ctx.saved_tensors
    scale, eps, kaczmarz, has_h0, N, n_state = ctx.meta
    dht = dht if dht is not None and dht.numel() else None  # no final state, or not used
    do = torch.zeros_like(v) if do is None else do  # only the final state used (o is shaped and typed as v)
    dq, dk, dv, dg, deta, dh0 = backward(do.contiguous(), dht, q, k, v, g, eta, bl, beta, ar, hs, aqk, cu, cs, order,
                                         cr, scale, eps, kaczmarz, has_h0, N, n_state)
    return (dq, dk, dv, dg, deta, dh0 if has_h0 else None) + (None,) * 11


_chunk_op.register_autograd(_chunk_grad, setup_context=_chunk_setup_context)


class _ChunkFunction(torch.autograd.Function):
    """The operators' forward and autograd formula without their dispatch (host time) for eager calls."""
    @staticmethod
    def forward(q, *args):
        return _filled(q, _chunk_forward(q, *args))

    setup_context = staticmethod(_chunk_setup_context)

    @staticmethod
    def backward(ctx, *grads):
        return _chunk_grad(ctx, *grads, backward=_chunk_backward)


def kla_chunk(q, k, v, g, eta, *, eps=1e-6, scale=None, initial_state=None, output_final_state=False,
              kaczmarz=True, cu_seqlens=None):
    """Chunkwise KLA (kaczmarz=True) or gated delta rule (kaczmarz=False) on CUDA (or Triton's interpreter), with
    model.kla_chunkwise's layout, defaults and return value: (o (B, T, H, V) in q's dtype, final state (B, H, K, V)
    float32 or None), differentiable in q, k, v, g, eta, initial_state; q, k, v are cast to the narrowest of their
    dtypes (a float32 q under autocast). cu_seqlens (N + 1,) int32 / int64, read back to the host (not in CUDA graphs):
    sequence n at tokens cu_seqlens[n]:cu_seqlens[n + 1] of a batch of 1, states (N, H, K, V) (initial: or zeros)."""
    layout = _check(q, k, v, g, eta, initial_state, eps, cu_seqlens=cu_seqlens, scale=scale)
    q, k, v = (x.contiguous() for x in _common_dtype(q, k, v))
    g, eta = g.float().contiguous(), eta.float().contiguous()
    h0 = None if initial_state is None else initial_state.float().contiguous()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    save = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, eta, h0))
    packed = (None,) * 4 + (triton.cdiv(q.shape[1], C_CHUNK), q.shape[0]) if layout is None else layout
    # torch.compile traces the operator; eager calls skip its dispatch, and without a gradient autograd too
    chunk = _chunk_op if torch.compiler.is_compiling() else _ChunkFunction.apply if save else _chunk_forward
    o, ht, *_ = chunk(q, k, v, g, eta, h0, *packed[:4], float(scale), float(eps), bool(output_final_state),
                      bool(kaczmarz), save, *packed[4:])
    return o, (ht if output_final_state else None)


def kla_step(q, k, v, g, eta, state, *, eps=1e-6, scale=None, kaczmarz=True, out_state=None):
    """One decoding step: q, k (B, 1, H, K), v (B, 1, H, V), g, eta (B, 1, H), state (B, H, K, V) float32 -> (o
    (B, 1, H, V), new state). out_state: a contiguous float32 (B, H, K, V) tensor for the new state, possibly state
    itself (each program reads its block before writing it). No host synchronisation (CUDA graphs); no gradient."""
    _check(q, k, v, g, eta, state, eps, step=True, scale=scale)
    (B, _, H, K), V = q.shape, v.shape[-1]
    if out_state is not None and (not torch.is_tensor(out_state) or out_state.dtype != torch.float32
                                  or tuple(out_state.shape) != (B, H, K, V) or out_state.device != q.device
                                  or not out_state.is_contiguous()):
        got = (f"{out_state.dtype} {tuple(out_state.shape)} on {out_state.device}"
               f"{'' if out_state.is_contiguous() else ' (strided)'}" if torch.is_tensor(out_state) else type(out_state))
        raise ValueError(f"out_state must be a contiguous float32 tensor of shape {(B, H, K, V)} on {q.device}, "
                         f"got {got}")
    q, k, v, g, eta, state = (x.contiguous() for x in (*_common_dtype(q, k, v), g, eta, state))
    scale = K ** -0.5 if scale is None else scale
    o = torch.empty(B, 1, H, V, device=q.device, dtype=q.dtype)
    new_state = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32) if out_state is None else out_state
    step = _config("step", _block_k(K), V)
    _step_kernel[(triton.cdiv(V, step["BV"]), B * H)](q, k, v, g, eta, state, o, new_state, float(scale), float(eps),
                                                      K=K, V=V, BK=_block_k(K), KACZ=bool(kaczmarz), **step)
    return o, new_state
