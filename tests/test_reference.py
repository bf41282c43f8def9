"""
The reference functions of model.py (recurrent, chunkwise) against KLA.md's recurrence and each other in float64:
outputs, final state, every gradient; the Kaczmarz step's properties; packed sequences; the step-size rules; input errors.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernel
import model
from model import kla_chunkwise, kla_recurrent

from helpers import NAMES, SEQ_LENS, make_inputs, outputs_and_grads, packed_inputs, rel_err, separately


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
