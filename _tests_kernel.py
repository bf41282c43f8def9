"""kernel.py in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, against the float64 reference
model.kla_recurrent: output, final state and every gradient, at small sizes. Run: python -m pytest _tests_kernel.py
Only float32 inputs here: the interpreter computes bf16 dots wrongly (Triton 3.9: a 16 x 16 bf16 product of
randn is off by 1e10), so the bf16 path is checked on the GPU by test_gpu.py."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import math

import pytest
import torch

pytest.importorskip("triton")
import kernel  # noqa: E402
import model  # noqa: E402


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def make_inputs(B, T, H, K, V, knorm, h0, seed=0):
    """Unit q; k with norms log-uniform in knorm; log decays in [-0.5, 0]; eta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    lo, hi = math.log(knorm[0]), math.log(knorm[1])
    k = k * torch.exp(lo + (hi - lo) * torch.rand(B, T, H, 1, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    g = -0.5 * torch.rand(B, T, H, generator=gen)
    eta = torch.rand(B, T, H, generator=gen)
    s0 = torch.randn(B, H, K, V, generator=gen) if h0 else None
    return q, k, v, g, eta, s0


def run_both(q, k, v, g, eta, s0, kaczmarz, dtype=torch.float32, seed=1):
    """Forward and backward of kernel.kla_chunk (inputs in dtype) and of the float64 reference."""
    ours = [x.to(dtype) for x in (q, k, v)] + [g, eta] + ([s0] if s0 is not None else [])
    ours = [x.clone().requires_grad_() for x in ours]
    ref = [x.detach().double().requires_grad_() for x in ours]
    o, ht = kernel.kla_chunk(*ours[:5], initial_state=ours[5] if s0 is not None else None,
                             output_final_state=True, kaczmarz=kaczmarz)
    o_ref, ht_ref = model.kla_recurrent(*ref[:5], initial_state=ref[5] if s0 is not None else None,
                                        output_final_state=True, kaczmarz=kaczmarz)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(ht_ref.shape, generator=gen, dtype=torch.float64)
    torch.autograd.backward([o, ht], [do.to(o.dtype), dht.float()])
    torch.autograd.backward([o_ref, ht_ref], [do, dht])
    errs = {"o": rel(o, o_ref), "ht": rel(ht, ht_ref)}
    for name, a, b in zip(["dq", "dk", "dv", "dg", "deta", "dh0"], ours, ref):
        assert a.grad is not None and a.grad.dtype == a.dtype and a.grad.shape == a.shape, name
        errs[name] = rel(a.grad, b.grad)
    return errs


CASES = [  # (B, T, H, K, V, initial state, kaczmarz, key norms)
    (1, 1, 2, 32, 32, True, True, (1e-2, 1e2)),
    (1, 1, 1, 32, 16, False, True, (0.5, 2.0)),
    (2, 50, 2, 32, 32, True, True, (1e-2, 1e2)),
    (1, 64, 1, 64, 32, False, True, (1e-2, 1e2)),
    (1, 130, 2, 48, 40, True, True, (0.1, 10.0)),
    (1, 100, 1, 32, 64, True, False, (1.0, 1.0)),
    (1, 200, 1, 16, 16, False, False, (0.3, 1.0)),
]


@pytest.mark.parametrize("B,T,H,K,V,h0,kaczmarz,knorm", CASES)
def test_chunk_fp32_matches_float64(B, T, H, K, V, h0, kaczmarz, knorm):
    errs = run_both(*make_inputs(B, T, H, K, V, knorm, h0), kaczmarz)
    bad = {n: e for n, e in errs.items() if not e < 1e-4}
    assert not bad, f"relative errors above 1e-4: {bad} (all: {errs})"


def test_chunk_no_grad_noncontiguous_and_scale():
    q, k, v, g, eta, s0 = make_inputs(1, 70, 2, 32, 32, (0.1, 10.0), True)
    # (B, H, T, D) storage viewed as (B, T, H, D): non-contiguous inputs
    qn, kn, vn = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    gn, en = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (g, eta))
    assert not qn.is_contiguous()
    with torch.no_grad():
        o, ht = kernel.kla_chunk(qn, kn, vn, gn, en, scale=0.3, initial_state=s0, output_final_state=True)
        o_nf, none = kernel.kla_chunk(qn, kn, vn, gn, en, scale=0.3, initial_state=s0)
    o_ref, ht_ref = model.kla_recurrent(*(x.double() for x in (q, k, v, g, eta)), scale=0.3,
                                        initial_state=s0.double(), output_final_state=True)
    assert none is None and o.dtype == q.dtype and ht.dtype == torch.float32
    assert rel(o, o_ref) < 1e-5 and rel(ht, ht_ref) < 1e-5 and torch.equal(o, o_nf)


@pytest.mark.parametrize("kaczmarz", [True, False])
def test_step_matches_recurrent(kaczmarz):
    q, k, v, g, eta, s0 = make_inputs(3, 1, 2, 48, 40, (1e-2, 1e2) if kaczmarz else (1.0, 1.0), True)
    o, s1 = kernel.kla_step(q, k, v, g, eta, s0, kaczmarz=kaczmarz)
    o_ref, s1_ref = model.kla_recurrent(*(x.double() for x in (q, k, v, g, eta)), initial_state=s0.double(),
                                        output_final_state=True, kaczmarz=kaczmarz)
    assert o.shape == (3, 1, 2, 40) and s1.dtype == torch.float32
    assert rel(o, o_ref) < 1e-5 and rel(s1, s1_ref) < 1e-5


def test_errors_name_the_tensor():
    q, k, v, g, eta, s0 = make_inputs(1, 8, 2, 32, 16, (1.0, 1.0), True)
    with pytest.raises(ValueError, match="k must have q's shape"):
        kernel.kla_chunk(q, k[..., :16], v, g, eta)
    with pytest.raises(ValueError, match="v must be"):
        kernel.kla_chunk(q, k, v[:, :4], g, eta)
    with pytest.raises(ValueError, match="eta must be"):
        kernel.kla_chunk(q, k, v, g, eta[:, :4])
    with pytest.raises(ValueError, match="q has dtype torch.float64"):
        kernel.kla_chunk(q.double(), k, v, g, eta)
    with pytest.raises(ValueError, match="K <= 128"):
        big = torch.randn(1, 8, 2, 160)
        kernel.kla_chunk(big, big, v, g, eta)
    with pytest.raises(ValueError, match="initial_state must be"):
        kernel.kla_chunk(q, k, v, g, eta, initial_state=s0[..., :8])
    with pytest.raises(ValueError, match="empty"):
        kernel.kla_chunk(q[:, :0], k[:, :0], v[:, :0], g[:, :0], eta[:, :0])
    with pytest.raises(ValueError, match="one token"):
        kernel.kla_step(q, k, v, g, eta, s0)
