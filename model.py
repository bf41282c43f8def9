"""
Kaczmarz Linear Attention (KLA) language model, in one file.

KLA is Gated DeltaNet with one change: the delta-rule step size is the Kaczmarz projection
beta_t = eta_t / (||k_t||^2 + eps), with raw (un-normalised) keys. Per head, with state S (K x V):

    S~_t = exp(g_t) S_{t-1}                 g_t <= 0, the log decay
    e_t  = v_t - S~_t^T k_t                 residual of the current prediction
    S_t  = S~_t + beta_t k_t e_t^T          beta_t = eta_t / (||k_t||^2 + eps)   (KLA)
                                            beta_t = eta_t, q and k L2-normalised (GDN)
    o_t  = S_t^T (scale q_t)

References:
1) "Kaczmarz Linear Attention", Zou, Ren, Liu, arXiv 2605.08587 (2026).
2) "Gated Delta Networks: Improving Mamba2 with Delta Rule", Yang, Kautz, Hatamizadeh (2024).
3) "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", Yang et al. (2024):
   the chunkwise WY / UT-transform algorithm used by kla_chunkwise.
4) nanoGPT (Karpathy) for the shape of this file.

The mixer is switchable (GPTConfig.mixer): 'kla', 'gdn' (the same layer with q, k normalised and
beta = eta) and 'attn' (causal softmax attention with RoPE, the Transformer++ baseline). Everything
else in the model is shared, so comparisons between them are fair. For the ablation of the step size
alone, GPTConfig.step_rule picks beta's rule in the KLA / GDN layer (STEP_RULES) and decay=False sets g = 0.
"""

import math
import numbers
import warnings
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

# -----------------------------------------------------------------------------
# The reference functions. Layout: q, k (B, T, H, K); v (B, T, H, V); g, eta (B, T, H);
# states (B, H, K, V) in float32 (float64 for float64 inputs). Both return (o, final_state or None).


def check_inputs(q, k, v, g, eta, initial_state=None, eps=0.0, cu_seqlens=None, scale=None):
    """Raise a ValueError naming the first input that breaks the contract; last, g <= 0 (a value check:
    on a GPU it waits for the data). Returns cu_seqlens as a list (None without it)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("eta", eta)):
        if not torch.is_tensor(x) or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
    if q.dim() != 4:
        raise ValueError(f"q must be (B, T, H, K), got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be (B, T, H, V) = ({B}, {T}, {H}, V), got shape {tuple(v.shape)}")
    for name, x in (("g", g), ("eta", eta)):
        if x.shape != q.shape[:3]:
            raise ValueError(f"{name} must be (B, T, H) = ({B}, {T}, {H}), got shape {tuple(x.shape)}")
    if B == 0 or T == 0:
        raise ValueError(f"the input is empty: (B, T) = ({B}, {T})")
    bounds = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, q)
    if initial_state is not None:
        want = (B if bounds is None else len(bounds) - 1, H, K, v.shape[-1])
        if not torch.is_tensor(initial_state) or tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be ({'B' if bounds is None else 'N'}, H, K, V) = {want}, "
                             f"got {tuple(getattr(initial_state, 'shape', ()))}")
        if not initial_state.is_floating_point():
            raise ValueError(f"initial_state must be floating point, got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device}, q on {q.device}")
    if not (isinstance(eps, numbers.Real) and eps >= 0):
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    if scale is not None and not (isinstance(scale, numbers.Real) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number (None: K^-0.5), got {scale!r}")
    if (g > 0).any():  # NaN passes, as NaN weights make it in training: the loss is then NaN, which train.py reports
        raise ValueError(f"g is a log decay and must be <= 0, but its maximum is {g.max().item():.3g}")
    return bounds


def check_cu_seqlens(cu_seqlens, q):
    """The boundaries of packed sequences as a list [0, t_1, ..., T] (a host read), or a ValueError naming
    what is wrong: cu_seqlens must be an int32 / int64 tensor (N + 1,) on q's device, 0 first, strictly
    increasing, last T, with q of batch 1. kernel.py checks the same (it imports no project module)."""
    if not torch.is_tensor(cu_seqlens) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be an int32 or int64 tensor, got {getattr(cu_seqlens, 'dtype', type(cu_seqlens))}")
    if cu_seqlens.dim() != 1 or len(cu_seqlens) < 2:
        raise ValueError(f"cu_seqlens must be 1-D of length N + 1 >= 2, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, q on {q.device}")
    if q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed in a batch of 1, got B = {q.shape[0]}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds[0]}")
    if any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty sequence), got {bounds}")
    if bounds[-1] != q.shape[1]:
        raise ValueError(f"cu_seqlens must end at T = {q.shape[1]}, got {bounds[-1]}")
    return bounds


def _per_sequence(fn, bounds, q, k, v, g, eta, initial_state, output_final_state, **kw):
    """Packed sequences (batch 1, boundaries bounds from check_cu_seqlens) run one at a time by fn, each from
    its own initial_state[n] (or zeros): outputs concatenated along T, final states stacked (N, H, K, V)."""
    outs, states = [], []
    for n, (t0, t1) in enumerate(zip(bounds[:-1], bounds[1:])):
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, S = fn(*(x[:, t0:t1] for x in (q, k, v, g, eta)), initial_state=h0, output_final_state=True, **kw)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, 1), (torch.cat(states) if output_final_state else None)


# The step-size rules of the delta rule (GPTConfig.step_rule), beta from eta and the keys:
#   'kaczmarz'  eta / (||k||^2 + eps) on raw keys (KLA)
#   'unit'      eta on L2-normalised keys (GDN)
#   'raw'       eta on raw keys
#   'scalar'    sigmoid of a learned per-head parameter (eta the same at every token) on raw keys
#   'longhorn'  eta / (1 + eta ||k||^2) on raw keys (Longhorn's)
# The functions below take k and eta as given: the layer normalises the keys ('unit') and makes eta.
STEP_RULES = ("kaczmarz", "unit", "raw", "scalar", "longhorn")


def step_rule(rule, kaczmarz=True):
    """rule (one of STEP_RULES, else a ValueError); without one, KLA's 'kaczmarz' or (kaczmarz=False) GDN's 'unit'."""
    rule = rule or ("kaczmarz" if kaczmarz else "unit")
    if rule not in STEP_RULES:
        raise ValueError(f"rule must be one of {', '.join(STEP_RULES)}, got {rule!r}")
    return rule


def kla_beta(k, eta, eps=1e-6, kaczmarz=True, rule=None):
    """The delta-rule step size beta (B, T, H) of a rule (step_rule(rule, kaczmarz)): only 'kaczmarz' and
    'longhorn' compute it from the keys; the others are beta = eta.
    With eps = 0 a zero key has nothing to project onto: beta = 0 there (no write), not 0 * inf."""
    rule = step_rule(rule, kaczmarz)
    if rule == "longhorn":
        return eta / (1 + eta * k.pow(2).sum(-1))
    if rule != "kaczmarz":
        return eta
    r2 = k.pow(2).sum(-1) + eps
    return torch.where(r2 > 0, eta / r2.clamp_min(torch.finfo(r2.dtype).tiny), 0.0)


def _upcast(q, k, v, g, eta, initial_state):
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=dtype) if initial_state is None else initial_state.to(dtype)
    return dtype, (x.to(dtype) for x in (q, k, v, g, eta)), S


def kla_recurrent(q, k, v, g, eta, *, eps=1e-6, scale=None, initial_state=None,
                  output_final_state=False, kaczmarz=True, cu_seqlens=None, rule=None):
    """Token-by-token reference: the recurrence exactly as written in the module docstring, with the step
    size of rule (STEP_RULES; without one, kaczmarz picks KLA's or GDN's: see kla_beta).
    cu_seqlens (N + 1,): q etc. hold N sequences packed in a batch of 1, sequence n at tokens
    cu_seqlens[n]:cu_seqlens[n + 1], starting from initial_state[n] ((N, H, K, V), or zeros); the final
    state is then (N, H, K, V). The same in kla_chunkwise."""
    bounds = check_inputs(q, k, v, g, eta, initial_state, eps, cu_seqlens, scale)
    if bounds is not None:
        return _per_sequence(kla_recurrent, bounds, q, k, v, g, eta, initial_state, output_final_state,
                             eps=eps, scale=scale, kaczmarz=kaczmarz, rule=rule)
    out_dtype, T = q.dtype, q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype, (q, k, v, g, eta), S = _upcast(q, k, v, g, eta, initial_state)
    beta = kla_beta(k, eta, eps, kaczmarz, rule)  # (B, T, H)
    outs = []
    for t in range(T):
        k_t = k[:, t]  # (B, H, K)
        S = S * g[:, t].exp()[..., None, None]
        e = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k_t)  # (B, H, V)
        S = S + beta[:, t, :, None, None] * k_t[..., :, None] * e[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale))
    o = torch.stack(outs, 1).to(out_dtype)  # (B, T, H, V)
    return o, (S if output_final_state else None)


GATE_FLOOR = -1000.0  # exp(-1000) is 0 in float64: a gate at or below it forgets all, as g = -inf does


def kla_chunkwise(q, k, v, g, eta, *, eps=1e-6, scale=None, initial_state=None,
                  output_final_state=False, kaczmarz=True, chunk_size=64, cu_seqlens=None, rule=None):
    """Chunkwise reference (WY / UT transform); rule as in kla_recurrent. Inside a chunk of C tokens with b = cumsum(g):
        A = StrictTril(Diag(beta) (K K^T * Gamma)),  Gamma_ij = exp(b_i - b_j)
        U = (I + A)^-1 Diag(beta) (V - Diag(exp b) K S0)         (the "new values", beta e_t)
        O = scale (Diag(exp b) Q S0 + Tril(Q K^T * Gamma) U)
        S = exp(b_C) S0 + K^T Diag(exp(b_C - b)) U
    The parts of U that do not depend on S0 are solved for all chunks at once; only the short
    recurrence over S is sequential."""
    bounds = check_inputs(q, k, v, g, eta, initial_state, eps, cu_seqlens, scale)
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if bounds is not None:
        return _per_sequence(kla_chunkwise, bounds, q, k, v, g, eta, initial_state, output_final_state,
                             eps=eps, scale=scale, kaczmarz=kaczmarz, chunk_size=chunk_size, rule=rule)
    out_dtype, (B, T, H, K), V, C = q.dtype, q.shape, v.shape[-1], chunk_size
    scale = K ** -0.5 if scale is None else scale
    dtype, (q, k, v, g, eta), S = _upcast(q, k, v, g, eta, initial_state)
    beta = kla_beta(k, eta, eps, kaczmarz, rule)
    # pad T to a multiple of C: padded tokens have k = v = q = 0, g = 0, beta = 0 and change nothing
    pad, N = (-T) % C, (T + C - 1) // C
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2).reshape(B, H, N, C, -1) for x in (q, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(1, 2).reshape(B, H, N, C) for x in (g, beta))  # (B, H, N, C)
    # b in float64: beside strongly negative gates (b ~ -1e4 n) float32 would keep too few digits of the small
    # ones for the ratios exp(b_i - b_j); a gate of -inf (a decay of exactly 0) is raised to GATE_FLOOR, where
    # exp is 0 as well, so that b stays finite (-inf - -inf is NaN)
    b = g.double().clamp_min(GATE_FLOOR).cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # (B, H, N, C, C), masked before exp: exp(b_i - b_j) for j > i could overflow
    gamma = (b[..., :, None] - b[..., None, :]).masked_fill(~causal, float("-inf")).to(dtype).exp()
    A = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * gamma).tril(-1)
    eye = torch.eye(C, dtype=dtype, device=q.device)
    decay_out = b.exp().to(dtype)  # (B, H, N, C)
    rhs = torch.cat([beta[..., None] * v, (beta * decay_out)[..., None] * k], -1)  # (B, H, N, C, V + K)
    U0, W = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True).split([V, K], -1)
    attn = (q @ k.transpose(-1, -2)) * gamma  # (B, H, N, C, C)
    decay_state = (b[..., -1:] - b).exp().to(dtype)[..., None]  # (B, H, N, C, 1)
    outs = []
    for n in range(N):
        u = U0[:, :, n] - W[:, :, n] @ S  # (B, H, C, V)
        outs.append(scale * ((q[:, :, n] * decay_out[:, :, n, :, None]) @ S + attn[:, :, n] @ u))
        S = decay_out[:, :, n, -1, None, None] * S + (k[:, :, n] * decay_state[:, :, n]).transpose(-1, -2) @ u
    o = torch.stack(outs, 2).reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2).contiguous().to(out_dtype)  # (B, T, H, V)
    return o, (S if output_final_state else None)


# The Triton kernels, on CUDA the default path. Only a missing Triton falls back to PyTorch: an error inside
# kernel.py or kernel_decode.py is raised, not hidden behind the slow path.
try:
    import triton  # noqa: F401
except ModuleNotFoundError as err:
    if err.name != "triton":
        raise
    kernel = kernel_decode = None
    _no_triton = err
else:
    import kernel
    import kernel_decode


def linear_attention(q, k, v, g, eta, *, backend="chunkwise", eps=1e-6, initial_state=None,
                     output_final_state=False, kaczmarz=True, chunk_size=64, cu_seqlens=None, rule=None):
    """One entry point for the mixer: backend 'triton', 'chunkwise', 'recurrent', or 'auto' (Triton for
    CUDA tensors when it is installed). A single token with a carried state (decoding) takes the O(1) step; on the
    Triton path, without autograd, that step writes the new state into initial_state (and returns it).
    cu_seqlens (N + 1,): packed sequences in a batch of 1, each from its own state (see kla_recurrent).
    rule: the step size (step_rule(rule, kaczmarz)); the kernels compute 'kaczmarz' and take beta = eta for the
    others: 'longhorn's beta is computed here in float32 (its gradient by autograd) and given to them as eta."""
    rule = step_rule(rule, kaczmarz)
    if backend == "auto":
        backend = "triton" if q.is_cuda and kernel is not None else "chunkwise"
    kw = dict(eps=eps, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if backend == "triton":
        if rule == "longhorn":  # the kernel's own input check (no synchronisation) before eta is replaced
            kernel._check(q, k, v, g, eta, initial_state, eps, cu_seqlens=cu_seqlens)
            eta = kla_beta(k.float(), eta.float(), rule=rule).to(eta.dtype)
        return _triton_attention(q, k, v, g, eta, kaczmarz=rule == "kaczmarz", **kw)  # the rest are beta = eta
    if backend == "recurrent" or q.shape[1] == 1:
        return kla_recurrent(q, k, v, g, eta, rule=rule, **kw)
    return kla_chunkwise(q, k, v, g, eta, chunk_size=chunk_size, rule=rule, **kw)


def _triton_attention(q, k, v, g, eta, *, eps, initial_state, output_final_state, kaczmarz, cu_seqlens=None):
    if q.shape[1] == 1 and initial_state is not None and cu_seqlens is None:
        return _triton_step(q, k, v, g, eta, initial_state, eps=eps, kaczmarz=kaczmarz)
    # a PyTorch operator (kla::chunk) that torch.compile keeps whole in the model's graph
    return kernel.kla_chunk(q, k, v, g, eta, eps=eps, initial_state=initial_state,
                            output_final_state=output_final_state, kaczmarz=kaczmarz, cu_seqlens=cu_seqlens)


@torch.compiler.disable  # the state may be updated in place
def _triton_step(q, k, v, g, eta, state, *, eps, kaczmarz):
    """Decoding: the state is updated in place when it can be."""
    inplace = state.is_contiguous() and state.dtype == torch.float32 and not torch.is_grad_enabled()
    return kernel.kla_step(q, k, v, g, eta, state, eps=eps, kaczmarz=kaczmarz, out_state=state if inplace else None)


def resolve_backend(backend, device_type):
    """'auto' means the Triton kernel on CUDA, else the chunkwise reference. Decided once per model."""
    if backend not in ("auto", "triton", "chunkwise", "recurrent"):
        raise ValueError(f"backend must be 'auto', 'triton', 'chunkwise' or 'recurrent', got {backend!r}")
    if backend == "auto":
        backend = "triton" if device_type == "cuda" else "chunkwise"
        if backend == "triton" and kernel is None:
            warnings.warn(f"Triton is not installed ({_no_triton}); falling back to the PyTorch chunkwise path, "
                          "which is much slower")
            backend = "chunkwise"
    if backend == "triton" and kernel is None:
        raise RuntimeError(f"backend='triton' needs Triton: {_no_triton}")
    return backend


# -----------------------------------------------------------------------------
# The model


@dataclass
class GPTConfig:
    block_size: int = 1024     # training context; the recurrent mixers have no limit at inference
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 6
    n_embd: int = 768
    mixer: str = "kla"         # 'kla' | 'gdn' | 'attn'
    step_rule: str = ""        # KLA / GDN's step size, one of STEP_RULES; '': the mixer's own ('kaczmarz' for kla, 'unit' for gdn)
    decay: bool = True         # KLA / GDN's learned decay; False: g = 0 (with step_rule 'unit': DeltaNet)
    expand_k: float = 0.75     # key width of all heads / n_embd (the authors' KLA setting)
    expand_v: float = 1.5      # value width of all heads / n_embd
    conv_size: int = 4         # short causal convolution on q, k, v
    mlp_hidden: int = 0        # SwiGLU width; 0 means 8/3 * n_embd rounded up to a multiple of 64
    kla_eps: float = 1e-6      # the eps of beta = eta / (||k||^2 + eps)
    chunk_size: int = 64       # the chunkwise reference's; the Triton kernel's chunks are 64 tokens
    backend: str = "auto"      # 'auto' (Triton on CUDA), 'triton', 'chunkwise' or 'recurrent'
    decode_fused: bool = True  # Triton backend, decoding: the mixer between its projections as one kernel,
                               # and at batch 1 the whole block as three (GPT._decode_fused)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dropout: float = 0.0       # on the embeddings and on each residual branch's output (nanoGPT's), training only
    recompute: bool = False    # training: each block's mixer branch recomputed in the backward instead of its
                               # activations kept (torch.utils.checkpoint): less memory, one more mixer forward
    recompute_elementwise: bool = False  # training, KLA / GDN: only the elementwise work around the kernel
                               # recomputed in the backward (DeltaMixer.inputs, .gated), no kernel or matmul run again
    fused_loss: bool = False   # training (with targets and autograd): the loss and its gradient computed in the forward
                               # a chunk of rows at a time (FusedCrossEntropy), no (B, T, vocab) logits kept; the
                               # forward then returns logits None

    def __post_init__(self):
        if self.mixer not in ("kla", "gdn", "attn"):
            raise ValueError(f"mixer must be 'kla', 'gdn' or 'attn', got {self.mixer!r}")
        if self.step_rule not in ("", *STEP_RULES) or (self.step_rule and self.mixer == "attn"):
            raise ValueError(f"step_rule must be '' (the mixer's own) or, with mixer 'kla' or 'gdn', one of "
                             f"{', '.join(STEP_RULES)}; got {self.step_rule!r} with mixer {self.mixer!r}")
        if self.recompute_elementwise and self.mixer == "attn":
            raise ValueError("recompute_elementwise is for the KLA / GDN layer (mixer 'kla' or 'gdn'), not 'attn'")
        if not isinstance(self.decay, bool) or (not self.decay and self.mixer == "attn"):
            raise ValueError(f"decay must be True or False (False only with mixer 'kla' or 'gdn'); got {self.decay!r} "
                             f"with mixer {self.mixer!r}")
        if not self.conv_size >= 2:
            raise ValueError(f"conv_size must be an integer >= 2 (the current token and one before it at least), "
                             f"got {self.conv_size!r}")
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "chunk_size"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("kla_eps", "norm_eps"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.mixer != "attn":
            for name in ("expand_k", "expand_v"):
                width = getattr(self, name) * self.n_embd
                if width != int(width) or int(width) % self.n_head:
                    raise ValueError(f"{name} * n_embd = {width} must be an integer divisible by n_head ({self.n_head})")


def doc_seqlens(x, eot):
    """The cu_seqlens of a batch of token ids x (B, T) read as one packed row (1, B T): a document starts at
    every row and after every end-of-text token eot. int32 (N + 1,), on x's device (from a CPU x: no device read)."""
    B, T = x.shape
    starts = torch.ones(B, T, dtype=torch.bool, device=x.device)
    starts[:, 1:] = x[:, :-1] == eot
    return F.pad(starts.flatten().nonzero().flatten(), (0, 1), value=B * T).int()


def document_positions(cu_seqlens, T):
    """For T packed tokens with boundaries cu_seqlens (N + 1,): each token's document and its position
    in it, (T,) each. Computed on the device, so that torch.compile traces it."""
    doc = torch.zeros(T, dtype=torch.long, device=cu_seqlens.device)
    doc[cu_seqlens[1:-1].long()] = 1
    doc = doc.cumsum(0)
    return doc, torch.arange(T, device=doc.device) - cu_seqlens.long()[doc]


class ShortConv(nn.Module):
    """Depthwise causal convolution + SiLU over (B, T, C), written as a sum of shifted products: on a
    GPU that is a few elementwise passes, where a grouped nn.Conv1d's weight gradient can be slow.
    The last size - 1 inputs are the decoding state. With cu_seqlens (packed documents, B = 1) the window
    starts afresh at each document: an input shifted by s is left out where the position in the document is < s;
    the state is then each document's own last size - 1 inputs (N, size - 1, C), zeros before its start."""

    def __init__(self, dim, size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, size).uniform_(-size ** -0.5, size ** -0.5))  # nn.Conv1d's init

    def forward(self, x, state=None, cu_seqlens=None):
        B, T, C = x.shape
        size = self.weight.shape[1]
        if state is None:
            state = x.new_zeros(B, size - 1, C)
        x = torch.cat([state.to(x.dtype), x], 1)  # (B, size - 1 + T, C)
        w = self.weight.to(x.dtype)
        pos = None if cu_seqlens is None else document_positions(cu_seqlens, T)[1][:, None]  # (T, 1)
        y = None
        for i in range(size):
            term = x[:, i:i + T] * w[:, i]  # the input shifted by size - 1 - i
            if pos is not None and i < size - 1:
                term = term.masked_fill(pos < size - 1 - i, 0)
            y = term if y is None else y + term
        if cu_seqlens is None:
            return F.silu(y), x[:, T:]
        at = cu_seqlens[1:, None].long() + torch.arange(size - 1, device=x.device)  # rows of x: each document's last inputs
        tails = x[0, at].masked_fill((at - (size - 1) < cu_seqlens[:-1, None])[..., None], 0)
        return F.silu(y), tails


class DeltaMixer(nn.Module):
    """The KLA layer (mixer='kla'), or Gated DeltaNet's (mixer='gdn') with q, k normalised and beta = eta; with
    config.step_rule any rule of STEP_RULES, and with config.decay False no decay."""

    def __init__(self, config):
        super().__init__()
        H, d = config.n_head, config.n_embd
        self.n_head, self.eps, self.decay = H, config.kla_eps, config.decay
        self.rule = config.step_rule or ("kaczmarz" if config.mixer == "kla" else "unit")
        self.chunk_size, self.backend = config.chunk_size, config.backend
        self.dk, self.dv = int(config.expand_k * d) // H, int(config.expand_v * d) // H
        # one input projection for q, k, v, the output gate, eta and the decay (one matmul; one GEMV when
        # decoding), then a short convolution each for q, k, v (each output its own contiguous tensor, as the
        # kernel wants them: no copies, nothing saved twice for the backward); no eta for the 'scalar' rule, no
        # decay without it
        self.split = [H * self.dk, H * self.dk, H * self.dv, H * self.dv, H * (self.rule != "scalar"),
                      H * self.decay]  # q k v gate eta decay
        # padded with unused outputs to a multiple of 8 (rows of 16-byte multiples in bf16, as Hopper's TMA
        # GEMMs need): unpadded, 3468 outputs at GPT-2 small's size, cuBLAS ran an sm80 kernel at 240 TFLOP/s
        # in a 128K-token prefill (bench.py --section=prefill_profile)
        self.split.append(-sum(self.split) % 8)
        self.in_proj = nn.Linear(d, sum(self.split), bias=False)
        self.q_conv = ShortConv(H * self.dk, config.conv_size)
        self.k_conv = ShortConv(H * self.dk, config.conv_size)
        self.v_conv = ShortConv(H * self.dv, config.conv_size)
        if self.rule == "scalar":
            self.eta_logit = nn.Parameter(torch.zeros(H))  # eta = sigmoid(eta_logit), the same at every token
        else:
            self.eta_bias = nn.Parameter(torch.zeros(H))  # eta = sigmoid(x W_eta + eta_bias)
        if self.decay:  # Mamba2 decay: g = -A softplus(x W_a + dt_bias), A ~ U(0, 16), dt log-uniform in [1e-3, 1e-1]
            self.A_log = nn.Parameter(torch.empty(H).uniform_(0, 16).log())
            dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.o_norm = nn.RMSNorm(self.dv, eps=config.norm_eps)
        self.o_proj = nn.Linear(H * self.dv, d, bias=False)
        self.recompute = config.recompute_elementwise

    def forward(self, x, cache=None, cu_seqlens=None):
        """x (B, T, C); cache: this layer's decoding state, read and updated in place; cu_seqlens: packed
        documents in a batch of 1, the state and the convolutions reset at each (with an empty cache: it is left
        holding each document's own state, a batch of N)."""
        B, T, _ = x.shape
        st = {} if cache is None else cache
        q, k, v, gate, b, a, _ = self.in_proj(x).split(self.split, -1)
        recompute = self.recompute and cache is None and torch.is_grad_enabled()
        q, k, v, g, eta = self.elementwise(recompute, self.inputs, q, k, v, b, a, cache, cu_seqlens)
        if cache is not None:  # contiguous buffers, which the fused decoding step updates in place
            st["q_conv"], st["k_conv"], st["v_conv"] = (st[n].contiguous() for n in ("q_conv", "k_conv", "v_conv"))
        o, st["state"] = linear_attention(q, k, v, g, eta, backend=self.backend, eps=self.eps,
                                          initial_state=st.get("state"), output_final_state=cache is not None,
                                          rule=self.rule, chunk_size=self.chunk_size, cu_seqlens=cu_seqlens)
        return self.o_proj(self.elementwise(recompute, self.gated, o, gate, x.dtype).reshape(B, T, -1))

    @staticmethod
    def elementwise(recompute, fn, *args):
        """fn(*args); with recompute (recompute_elementwise, training) recomputed in the backward instead of its
        activations kept. tools/train_memory.py, bf16 autocast, bytes kept a token and layer: eager, inputs keeps
        in_proj's output (6944) in place of 10716, gated the kernel's output (2304) in place of 23096 (the layer
        46.6 KB -> 22.0 KB, of which the kernel's own 8.9 KB); compiled, whose partitioner recomputes some of it
        already, 9.4 KB less."""
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args)

    def inputs(self, q, k, v, b, a, cache, cu_seqlens):
        """The kernel's q, k, v (B, T, H, d), g and eta (B, T, H) from in_proj's outputs: the short convolutions (their
        decoding states into cache), q's (and for 'unit' k's) normalisation, the step size's eta and the decay."""
        B, T, _ = q.shape
        st = {} if cache is None else cache
        H, dk, dv = self.n_head, self.dk, self.dv
        q, st["q_conv"] = self.q_conv(q, st.get("q_conv"), cu_seqlens)
        k, st["k_conv"] = self.k_conv(k, st.get("k_conv"), cu_seqlens)
        v, st["v_conv"] = self.v_conv(v, st.get("v_conv"), cu_seqlens)
        # (B, T, H, dk); back to v's dtype, since CUDA autocast runs the norm in float32
        q = F.normalize(q.reshape(B, T, H, dk), dim=-1).to(v.dtype)
        k = k.reshape(B, T, H, dk)  # KLA: raw keys, that is the point
        if self.rule == "unit":
            k = F.normalize(k, dim=-1).to(v.dtype)
        v = v.reshape(B, T, H, dv)
        if self.rule == "scalar":
            eta = torch.sigmoid(self.eta_logit.float()).expand(B, T, H)
        else:
            eta = torch.sigmoid(b.float() + self.eta_bias)  # (B, T, H)
        if self.decay:
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        else:
            g = eta.new_zeros(B, T, H)
        return q, k, v, g, eta

    def gated(self, o, gate, dtype):
        """The heads' outputs o (B, T, H, dv) in dtype (the layer input's), normalised and gated by SiLU of gate."""
        return self.o_norm(o.to(dtype)) * F.silu(gate.reshape(o.shape))


@torch.library.custom_op("kla::decode_mixer", mutates_args=("conv_q", "conv_k", "conv_v", "state"))
def _decode_mixer_op(xp: torch.Tensor, conv_q: torch.Tensor, conv_k: torch.Tensor, conv_v: torch.Tensor,
                     w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     eta_bias: torch.Tensor, norm_weight: torch.Tensor, state: torch.Tensor, n_head: int, eps: float,
                     norm_eps: float, kaczmarz: bool) -> torch.Tensor:
    """kernel_decode.kla_decode_mixer as a PyTorch operator that updates the cache's buffers in place, so that
    torch.compile keeps a decoding step whole (one graph around the twelve mixers, their norms and residual
    adds fused with their neighbours) where a graph break at each mixer left them as separate kernels."""
    return kernel_decode.kla_decode_mixer(xp, conv_q, conv_k, conv_v, w_q, w_k, w_v, A_log, dt_bias, eta_bias,
                                          norm_weight, state, n_head=n_head, eps=eps, norm_eps=norm_eps,
                                          kaczmarz=kaczmarz)


@_decode_mixer_op.register_fake
def _(xp, conv_q, conv_k, conv_v, w_q, w_k, w_v, A_log, dt_bias, eta_bias, norm_weight, state, n_head, eps, norm_eps,
      kaczmarz):
    return xp.new_empty(xp.shape[0], state.shape[1] * state.shape[3])


def _decode_mixer(m, xp, st):
    """The lines of DeltaMixer m's forward between its two projections for one token (xp (B, in_proj's outputs)),
    as one kernel (kernel_decode.kla_decode_mixer): the output (B, H dv) before o_proj."""
    return _decode_mixer_op(xp[:, :sum(m.split[:-1])], st["q_conv"], st["k_conv"], st["v_conv"], m.q_conv.weight,
                            m.k_conv.weight, m.v_conv.weight, m.A_log, m.dt_bias, m.eta_bias, m.o_norm.weight,
                            st["state"], m.n_head, m.eps, m.o_norm.eps, m.rule == "kaczmarz")


# cuDNN's attention is left out: it builds an execution plan for every new shape, and decoding makes a new
# key length every token (bench.py's generate section times both)
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def rope(x, pos, theta):
    """Rotary position embedding on (B, T, H, D) at the positions pos (T,) (rotate-half form)."""
    D = x.shape[-1]
    freqs = theta ** -(torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = pos.float()[:, None] * freqs  # (T, D/2)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x.float().chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def document_block_mask(doc):
    """FlexAttention's block mask of causal attention within documents, doc (T,) each token's document."""
    def causal_in_document(b, h, i, j):
        return (doc[i] == doc[j]) & (i >= j)
    return create_block_mask(causal_in_document, None, None, len(doc), len(doc), device=doc.device)


# FlexAttention and its block mask are fast only compiled (each compiled on its first call)
_flex_attention, _document_block_mask = torch.compile(flex_attention), torch.compile(document_block_mask)


class Attention(nn.Module):
    """Causal softmax attention with RoPE (the Transformer++ baseline); the cache holds keys and values."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.theta = config.n_head, config.rope_theta
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.o_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, cache=None, cu_seqlens=None):
        """x (B, T, C); cache: the keys and values so far, extended in place; cu_seqlens: packed documents in
        a batch of 1 (without a cache), each attending to itself only, its positions from 0."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).unbind(2)  # (B, T, H, D)
        if cu_seqlens is not None:
            return self.o_proj(self.attend_documents(q, k, v, cu_seqlens).reshape(B, T, C))
        past = 0 if cache is None else cache.get("n", 0)
        pos = torch.arange(past, past + T, device=x.device)
        q, k = rope(q, pos, self.theta), rope(k, pos, self.theta)
        if cache is not None:  # keys and values in buffers that grow by doubling, written in place
            if "k" not in cache or past + T > cache["k"].shape[1]:
                cap = past + T + 256 if past == 0 else 2 * (past + T)
                for name in ("k", "v"):
                    buf = k.new_empty(B, cap, *k.shape[2:])
                    if past:
                        buf[:, :past] = cache[name][:, :past]
                    cache[name] = buf
            cache["k"][:, past:past + T], cache["v"][:, past:past + T] = k, v
            cache["n"] = past + T
            k, v = cache["k"][:, :past + T], cache["v"][:, :past + T]
        # causal with the queries aligned to the end of the keys (the newest tokens)
        mask = None if past == 0 or T == 1 else torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
        with sdpa_kernel(SDPA_BACKENDS):
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=mask, is_causal=past == 0 and T > 1)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))

    def attend_documents(self, q, k, v, cu_seqlens):
        """Causal attention within each packed document: q, k, v (1, T, H, D) -> (1, T, H, D). On CUDA
        FlexAttention with a document block mask (the blocks between documents are skipped); elsewhere SDPA with
        the same mask dense (T x T), since FlexAttention has no backward on the CPU."""
        doc, pos = document_positions(cu_seqlens, q.shape[1])
        q, k, v = rope(q, pos, self.theta).transpose(1, 2), rope(k, pos, self.theta).transpose(1, 2), v.transpose(1, 2)
        if q.is_cuda:
            y = _flex_attention(q, k, v, block_mask=_document_block_mask(doc))  # (1, H, T, D)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=(doc[:, None] == doc).tril())
        return y.transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.mlp_hidden or 64 * math.ceil(8 * config.n_embd / 3 / 64)
        self.gate_up = nn.Linear(config.n_embd, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mixer = Attention(config) if config.mixer == "attn" else DeltaMixer(config)
        self.norm2 = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)
        self.recompute = config.recompute

    def mix(self, x, cache=None, cu_seqlens=None):
        return self.drop(self.mixer(self.norm1(x), cache, cu_seqlens))

    def forward(self, x, cache=None, cu_seqlens=None):
        if self.recompute and cache is None and torch.is_grad_enabled():  # the same dropout mask when recomputed
            x = x + torch.utils.checkpoint.checkpoint(self.mix, x, None, cu_seqlens, use_reentrant=False)
        else:
            x = x + self.mix(x, cache, cu_seqlens)
        return x + self.drop(self.mlp(self.norm2(x)))


# The segment of a long prompt that KLA / GDN read at a time (GPT.stream, sample.py): their prefill's memory stays flat in
# the prompt's length. On an H200 (GPT-2 small, bf16, batch 1; python3 tools/prefill_segments.py,
# results/bench_h200/prefill_segments.md), 16384 tokens with the CUDA graph of a segment take 1.05 / 1.07 / 1.08x the
# one pass at 32K / 64K / 128K, peak 1.67 -> 1.83 GiB against the one pass's 1.15 -> 3.67; 8192 take 1.24-1.27x at
# 0.98 -> 1.16 GiB, 32768 1.03-1.05x at 3.01 -> 3.10 GiB (more than the one pass's 2.00 at 64K).
PREFILL_SEGMENT = 16384

# Logits a chunk of the loss (FusedCrossEntropy, evaluation): 5,336 rows at vocabulary 50304. The fused loss's
# forward + backward alone at 32 x 2048 tokens, width 768, compiled, on an H200 (python3 tools/loss_bench.py,
# results/bench_h200/loss.md): 2^27 33.7 ms at 0.48 GiB, 2^28 31.1 ms at 0.98 GiB, 2^29 30.1 ms at 1.98 GiB, against
# 30.9 ms and 6.05 GiB for the logits and F.cross_entropy (each chunk adds its float32 weight gradient to the sum).
LOSS_CHUNK = 2**28


def chunked_cross_entropy(logits, targets):
    """F.cross_entropy(logits.float(), targets, ignore_index=-1) (the mean) of logits (..., vocab) without gradients,
    a chunk of LOSS_CHUNK logits at a time: the float32 copy and its log-softmax never exist for every row at once
    (at 32 x 1024 tokens and vocabulary 50304, 1.1 GB of temporaries in place of 13.2 GB)."""
    logits, targets = logits.flatten(0, -2), targets.reshape(-1)
    rows, total = max(1, LOSS_CHUNK // logits.shape[-1]), 0.0
    for i in range(0, logits.shape[0], rows):
        total = total + F.cross_entropy(logits[i:i + rows].float(), targets[i:i + rows], ignore_index=-1,
                                        reduction="sum")
    return total / (targets != -1).sum()


@torch.library.custom_op("kla::add_mm", mutates_args=())
def _add_mm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b, acc float32 and a, b bf16 on CUDA: one GEMM that adds its float32 product to acc (an operator,
    since torch.compile's fake tensors do not take torch.addmm's out_dtype)."""
    return torch.addmm(acc, a, b, out_dtype=acc.dtype)


@_add_mm_fp32.register_fake
def _(acc, a, b):
    return torch.empty_like(acc)


def _add_mm(acc, a, b):
    """acc + a @ b for a float32 acc and a, b in it dtype or a lower one: the product in float32, on CUDA in one GEMM."""
    if a.dtype != acc.dtype and acc.is_cuda:
        return _add_mm_fp32(acc, a, b)
    return acc + a.to(acc.dtype) @ b.to(acc.dtype)


class FusedCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of F.linear(x, weight) (x (N, C), the tied lm_head's weight (vocab, C)) against targets
    (N,) (-1 ignored), as GPT.forward computes it, with its gradients computed in the forward a chunk of rows at a
    time: only the gradients are kept for the backward (N x C and vocab x C, float32), not the logits and their
    float32 log-softmax (GPTConfig.fused_loss; at vocabulary 50304 and bf16 autocast 3 KB a token kept in place of
    201 KB eager, of 101 KB (the bf16 logits) compiled, and no logits-sized gradients in the backward). The same
    matmuls as without it, none run again."""

    @staticmethod
    def forward(ctx, x, weight, targets):
        n, loss, rows = (targets != -1).sum(), 0.0, max(1, LOSS_CHUNK // weight.shape[0])
        on = x.device.type
        dtype = torch.get_autocast_dtype(on) if torch.is_autocast_enabled(on) else weight.dtype  # lm_head's
        dx, dw = torch.empty_like(x), torch.zeros_like(weight)
        with torch.autocast(on, enabled=False):  # the casts written out: the weight's made once, not at each matmul
            w = weight.to(dtype)
            for i in range(0, x.shape[0], rows):
                xi, t = x[i:i + rows].to(dtype), targets[i:i + rows]
                logits = xi @ w.t()
                z, at, valid = logits.float(), t.clamp_min(0)[:, None], (t != -1)[:, None]
                lse = z.logsumexp(-1, keepdim=True)
                loss = loss + ((lse - z.gather(1, at)) * valid).sum()
                # (p - onehot(t)) / n, the one-hot as a comparison: one elementwise pass (a scatter_add is a pass more)
                onehot = torch.arange(z.shape[1], device=z.device) == at
                dz = ((z - lse).exp().sub(onehot.to(z.dtype)) * (valid / n)).to(dtype)
                dx[i:i + rows] = dz @ w
                dw = _add_mm(dw, dz.t(), xi)
        ctx.save_for_backward(dx, dw)
        return loss / n

    @staticmethod
    def backward(ctx, grad):
        dx, dw = ctx.saved_tensors
        return dx * grad, dw * grad, None


class GPT(nn.Module):

    def __init__(self, config, **switches):
        super().__init__()
        self.config = config = replace(config, **switches)  # backend, recompute_elementwise, fused_loss
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.norm_f = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.segment_graphs = {}  # prefill's CUDA-graph steps, made once per shape (prefill with cuda_graph)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("o_proj.weight") or name.endswith("mlp.down.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters())  # the tied embedding counts once

    def set_backend(self, device_type):
        """Choose the linear-attention path once for this device (see resolve_backend)."""
        backend = resolve_backend(self.config.backend, device_type)
        mixer = self.blocks[0].mixer
        if backend == "triton" and isinstance(mixer, DeltaMixer) and (mixer.dk > 128 or mixer.dv > 1024):
            raise ValueError(f"heads of d_k {mixer.dk}, d_v {mixer.dv}: the Triton kernel takes d_k <= 128 and d_v <= 1024; "
                             "use more heads, or backend='chunkwise'")
        for block in self.blocks:
            if isinstance(block.mixer, DeltaMixer):
                block.mixer.backend = backend
        return backend

    def forward(self, idx, targets=None, cache=None, cu_seqlens=None):
        """idx (B, T) token ids. With targets: logits at every position and the mean loss (targets of -1
        are ignored). Without: logits at the last position only. cache: a list of one dict per layer,
        read and updated in place, so that a later call continues the sequence (see new_cache).
        cu_seqlens (N + 1,): idx (1, T) holds N documents packed (see doc_seqlens), each read as if alone:
        the states and convolutions of KLA / GDN reset at each, attention stays within each. With an empty cache
        as well (KLA / GDN): N prompts of different lengths read at once (prefill), the cache then holds a batch of
        N (each prompt's state and convolution inputs) and the logits are those of each prompt's last token (N, 1, vocab)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T) token ids, got shape {tuple(idx.shape)}")
        if cu_seqlens is not None:
            if cache is not None and (self.config.mixer == "attn" or any(cache)):
                raise ValueError("cu_seqlens with a cache reads packed prompts into an empty cache, for KLA / GDN "
                                 f"only; got mixer {self.config.mixer!r} and a cache that "
                                 f"{'holds a state' if any(cache) else 'is empty'}")
            check_cu_seqlens(cu_seqlens, idx)
        if targets is None and self._decodes_fused(idx, cache):
            return self._decode_fused(idx, cache), None
        x = self.drop(self.wte(idx))  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache[i], cu_seqlens)
        x = self.norm_f(x)
        if targets is None:
            last = x[:, -1:, :] if cu_seqlens is None else x[0, cu_seqlens[1:].long() - 1, None]  # (B or N, 1, C)
            return self.lm_head(last), None
        if self.config.fused_loss and torch.is_grad_enabled():  # training: no logits kept, none returned
            return None, FusedCrossEntropy.apply(x.flatten(0, 1), self.lm_head.weight, targets.reshape(-1))
        logits = self.lm_head(x)
        if not torch.is_grad_enabled():  # evaluation: the float32 log-softmax made a chunk of rows at a time
            return logits, chunked_cross_entropy(logits, targets)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def _decodes_fused(self, idx, cache):
        """Whether this call decodes one token through kernel_decode's kernels (GPTConfig.decode_fused): KLA or
        GDN on the Triton backend, a cache that holds a state, no autograd. The kernels make eta and the decay from
        the layer's projections and beta from KLA's or GDN's rule: other rules and decay=False decode unfused."""
        return (cache is not None and idx.shape[1] == 1 and self.config.decode_fused and self.config.mixer != "attn"
                and self.blocks[0].mixer.backend == "triton" and "state" in cache[0] and not torch.is_grad_enabled()
                and not (self.training and self.config.dropout)  # the kernels apply no dropout
                and self.blocks[0].mixer.rule in ("kaczmarz", "unit") and self.config.decay)

    def _decode_fused(self, idx, cache):
        """forward for one token (B, 1) through the fused decoding kernels; the logits (B, 1, vocab). At batch 1,
        with the weights and the cache's buffers in one dtype (not under autocast), every block and the head run
        as kernels alone (_decode_fused_batch1); else each mixer runs between its projections as one kernel
        (kernel_decode.kla_decode_mixer) and the rest of the model as its layers."""
        x = self.wte(idx)  # (B, 1, C)
        if x.shape[0] == 1 and x.dtype == cache[0]["q_conv"].dtype:
            return self._decode_fused_batch1(x, cache)
        B = x.shape[0]
        for block, st in zip(self.blocks, cache):
            m = block.mixer
            o = _decode_mixer(m, m.in_proj(block.norm1(x)).view(B, -1), st)  # (B, H dv)
            x = x + m.o_proj(o.view(B, 1, -1))
            x = x + block.mlp(block.norm2(x))
        return self.lm_head(self.norm_f(x))

    @torch.compiler.disable  # Triton kernels that update the cache's buffers in place
    def _decode_fused_batch1(self, x, cache):
        """Each block as three kernels (kernel_decode.kla_decode_block): RMSNorm + the mixer's input projection + the
        short convolutions; the state step, each head's values over several programs, with their share of the output
        projection; the heads' RMSNorm, the residual, RMSNorm and the MLP with the residual. The residual stream
        between blocks in float32. Then norm_f + lm_head as one more (kernel_decode.decode_linear)."""
        x = x.view(1, -1)
        for block, st in zip(self.blocks, cache):
            m = block.mixer
            x = kernel_decode.kla_decode_block(
                x, block.norm1.weight, m.in_proj.weight, st["q_conv"], st["k_conv"], st["v_conv"], m.q_conv.weight,
                m.k_conv.weight, m.v_conv.weight, m.A_log, m.dt_bias, m.eta_bias, st["state"], m.o_norm.weight,
                m.o_proj.weight, block.norm2.weight, block.mlp.gate_up.weight, block.mlp.down.weight,
                n_head=m.n_head, eps=m.eps, norm_eps=block.norm1.eps, o_norm_eps=m.o_norm.eps,
                kaczmarz=m.rule == "kaczmarz")
        return kernel_decode.decode_linear(x, self.lm_head.weight, norm_weight=self.norm_f.weight,
                                           norm_eps=self.norm_f.eps).view(1, 1, -1)

    def new_cache(self):
        return [dict() for _ in self.blocks]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        # matrices (linear, embedding, conv weights) decay; vectors (norms, biases, A_log, dt_bias) do not
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")

    def flops_per_token(self, T):
        """Forward + backward FLOPs per token at sequence length T: 6 N for the weights, plus the
        mixer's own matmuls (causal attention, or the chunkwise delta rule of KLA / GDN)."""
        cfg, d = self.config, self.config.n_embd
        if cfg.mixer == "attn":
            mixer = 2 * 2 * d * T / 2  # QK^T and AV, causal half
        else:
            dk, dv, C = cfg.expand_k * d / cfg.n_head, cfg.expand_v * d / cfg.n_head, min(cfg.chunk_size, T)
            # per head: K K^T, Q K^T, T (V, K), intra-chunk attn @ U (4C(dk+dv)), K S, Q S, K^T U (6 dk dv)
            mixer = cfg.n_head * (4 * C * (dk + dv) + 6 * dk * dv)
        return 6 * self.get_num_params() + 3 * cfg.n_layer * mixer

    def estimate_mfu(self, tokens_per_iter, dt, peak_flops):
        """Model FLOPs utilisation: achieved FLOP/s over peak_flops (e.g. 989e12 for H100/H200 bf16)."""
        return self.flops_per_token(self.config.block_size) * tokens_per_iter / dt / peak_flops

    @classmethod
    def from_checkpoint(cls, checkpoint, **overrides):
        """The model of a checkpoint dict from run_safety.read_checkpoint; overrides change config fields that do not
        change the weights, such as backend. (Weights of a torch.compile'd model, saved by other code, have
        their keys under '_orig_mod.'.)"""
        args = {**checkpoint["model_args"], **overrides}
        unknown = sorted(args.keys() - {f.name for f in fields(GPTConfig)})
        if unknown:
            raise ValueError(f"checkpoint's model_args hold {unknown[:4]}, which this model.py does not know; it was "
                             "written by a different version of the model")
        try:
            config = GPTConfig(**args)
        except TypeError as err:  # a value of another type than the field's, e.g. n_layer '4'
            raise ValueError(f"checkpoint's model_args do not fit this model.py ({err}): a damaged file") from None
        model = cls(config)
        state = {k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items()}
        ours = model.state_dict()
        missing, unexpected = ours.keys() - state.keys(), state.keys() - ours.keys()
        resized = {k for k in ours.keys() & state.keys() if state[k].shape != ours[k].shape}
        if missing or unexpected or resized:
            raise ValueError(f"checkpoint does not match this model.py: missing {sorted(missing)[:4]}, unexpected "
                             f"{sorted(unexpected)[:4]}, other shapes {sorted(resized)[:4]}; it was written by a "
                             "different version of the model")
        nonfinite = sorted(k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all())
        if nonfinite:  # train.py saves none: the file was damaged or made otherwise
            raise ValueError(f"checkpoint holds weights that are not finite: {nonfinite[:4]}; train.py never saves "
                             "such weights: a damaged file")
        model.load_state_dict(state)
        return model

    @torch.no_grad()
    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, cuda_graph=False, prefill_chunk=PREFILL_SEGMENT):
        """Yield max_new_tokens new tokens (B, 1) one at a time. The prompt is read once by the chunkwise
        path, in segments of prefill_chunk tokens for KLA / GDN (the state carried across them, so that
        memory does not grow with the prompt); every later token costs O(1) from the carried state
        (attention: its KV cache). cuda_graph: replay each decoding step, and a long prompt's segments, from
        CUDA graphs (KLA / GDN on CUDA), without per-kernel launch costs. idx may also be a list of N 1-D prompts of different lengths
        (KLA / GDN): they are read in one pass, packed (cu_seqlens), then decoded together as a batch of N."""
        cache = self.new_cache()
        if isinstance(idx, (list, tuple)):
            logits = self.prefill_packed(idx, cache)
        else:
            logits = self.prefill(idx, cache, idx.shape[1] if self.config.mixer == "attn" else prefill_chunk, cuda_graph)
        greedy = temperature == 0
        step = self.decode_step(cache, logits.shape[0], cuda_graph, greedy=greedy) if max_new_tokens > 1 else None
        for i in range(max_new_tokens):
            if not greedy or i == 0:
                logits = logits[:, -1, :].float()
                if temperature == 0:
                    idx_next = logits.argmax(-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                        logits[logits < v[:, [-1]]] = -float("inf")
                    idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            yield idx_next
            if i + 1 < max_new_tokens:
                if greedy:  # the step returns the next token itself
                    idx_next = step(idx_next)
                else:
                    logits = step(idx_next)

    @torch.no_grad()
    def prefill(self, idx, cache, segment, cuda_graph=False):
        """Read idx (B, T) into cache in segments of `segment` tokens, the state carried across them;
        the logits of the last position. cuda_graph (KLA / GDN, at least two full segments): the full segments
        after the first replayed from one CUDA graph (decode_step for `segment` tokens; no launch work on the host),
        made once per batch, segment and weights and kept in segment_graphs for later prompts."""
        B, T = idx.shape
        logits, _ = self(idx[:, :segment], cache=cache)  # from the empty cache, which then holds its buffers
        s, n_full = segment, (T - segment) // segment
        if cuda_graph and self.config.mixer != "attn" and n_full >= 1:
            key = (B, segment, self.wte.weight.dtype, self.wte.weight.data_ptr())
            if key not in self.segment_graphs:
                static = [{k: v.clone() for k, v in c.items()} for c in cache]
                self.segment_graphs[key] = static, self.decode_step(static, B, cuda_graph=True, length=segment)
            static, step = self.segment_graphs[key]
            for buffers, c in zip(static, cache):
                for k, buf in buffers.items():
                    buf.copy_(c[k])
            for s in range(s, s + n_full * segment, segment):
                logits = step(idx[:, s:s + segment])
            s += segment
            for buffers, c in zip(static, cache):  # the cache's own copies: the graph's buffers serve the next prompt
                c.update({k: buf.clone() for k, buf in buffers.items()})
            logits = logits.clone()
        for s in range(s, T, segment):
            logits, _ = self(idx[:, s:s + segment], cache=cache)
        return logits

    @torch.no_grad()
    def prefill_packed(self, prompts, cache):
        """Read N 1-D prompts of any lengths into the empty cache in one pass (packed, each from a fresh state):
        the cache then holds a batch of N. The logits of each prompt's last token (N, 1, vocab)."""
        if self.config.mixer == "attn":
            raise ValueError("prompts of different lengths are read packed by KLA / GDN only; for attention pad "
                             "them to one length (B, T)")
        if not prompts or any(not torch.is_tensor(p) or p.dim() != 1 or len(p) == 0 for p in prompts):
            raise ValueError(f"prompts must be a non-empty list of non-empty 1-D token tensors, got "
                             f"{[tuple(p.shape) if torch.is_tensor(p) else type(p).__name__ for p in prompts]}")
        lens = torch.tensor([0] + [len(p) for p in prompts])
        cu_seqlens = lens.cumsum(0).to(device=prompts[0].device, dtype=torch.int32)
        return self(torch.cat(prompts)[None], cache=cache, cu_seqlens=cu_seqlens)[0]

    def decode_step(self, cache, batch, cuda_graph=False, length=1, greedy=False):
        """A function tokens (B, length) -> logits (B, 1, vocab) that advances cache by length tokens; greedy: ->
        the next token (B, 1), the argmax of those logits. With cuda_graph, the state lives in fixed buffers
        updated in place (the forward's new state is copied back into them), so that the step is captured once
        and replayed (on CUDA; elsewhere the same in-place step runs directly); greedy, the argmax is part of
        the graph, which writes it into its own input, so that passing back the token it returned copies
        nothing."""
        out = (lambda logits: logits[:, -1].argmax(-1, keepdim=True)) if greedy else (lambda logits: logits)
        if not cuda_graph:
            return lambda tok: out(self(tok, cache=cache)[0])
        if self.config.mixer == "attn":
            raise ValueError("cuda_graph decoding needs a fixed-size state: mixer 'kla' or 'gdn', not 'attn'")
        tok = torch.zeros(batch, length, dtype=torch.long, device=self.wte.weight.device)

        def step():
            new = [dict(c) for c in cache]  # the forward reads the buffers and puts its new state here
            logits, _ = self(tok, cache=new)
            for buffers, fresh in zip(cache, new):
                for key, buf in buffers.items():
                    buf.copy_(fresh[key])
            return logits
        if tok.device.type != "cuda":  # no graphs: the same in-place step, run directly
            return lambda token: (tok.copy_(token), out(step()))[1]
        saved = [{key: buf.clone() for key, buf in c.items()} for c in cache]
        side = torch.cuda.Stream()  # warm up (compiles the kernels) outside the graph, as CUDA graphs need
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        for buffers, old in zip(cache, saved):  # undo the warm-up's token
            for key, buf in buffers.items():
                buf.copy_(old[key])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()
            if greedy:
                tok.copy_(out(logits))
        last = [None]  # the token the greedy graph returned last, which tok still holds

        def replay(token):
            if token is not last[0]:
                tok.copy_(token)
            graph.replay()
            if not greedy:
                return logits
            last[0] = tok.clone()
            return last[0]
        return replay

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """nanoGPT's interface: the prompt (B, T) followed by max_new_tokens sampled tokens."""
        return torch.cat([idx, *self.stream(idx, max_new_tokens, temperature, top_k)], 1)
