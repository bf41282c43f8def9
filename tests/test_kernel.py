"""
kernel.py and kernel_decode.py in Triton's interpreter on CPU tensors (conftest.py sets TRITON_INTERPRET), against the
float64 reference: float32, and bf16 as the GPU computes it; the decoding fusions against the layers' PyTorch code.
"""

import json
import os
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernel
import kernel_decode
import model
from engine import Engine
from model import GPT, kla_chunkwise, kla_recurrent

from helpers import (
    NAMES, ROOT, SEQ_LENS, make_inputs, outputs_and_grads, packed_inputs, rel_err, run, separately, tiny_config,
    tiny_gpt,
)


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
    sys.path.insert(0, os.path.join(ROOT, "tools"))
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
