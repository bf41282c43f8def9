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
beta = eta) and 'attn' (causal softmax attention with RoPE, the Transformer++ baseline), or a pattern of them per
layer ('kla,kla,kla,attn': a hybrid with every fourth layer attention). Everything
else in the model is shared, so comparisons between them are fair. For the ablation of the step size
alone, GPTConfig.step_rule picks beta's rule in the KLA / GDN layer (STEP_RULES) and decay=False sets g = 0.

Beside it: checks.py (the input checks), chunked_loss.py (the loss a chunk of rows at a time), engine.py (fast
inference: prefill, CUDA graphs, fused decoding; GPT.generate here is the simple reference path).
"""

import math
import warnings
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from checks import check_config, check_cu_seqlens, check_inputs, check_sampling, check_weights, mixer_layers
from chunked_loss import FusedCrossEntropy, chunked_cross_entropy

# -----------------------------------------------------------------------------
# The reference functions. Layout: q, k (B, T, H, K); v (B, T, H, V); g, eta (B, T, H);
# states (B, H, K, V) in float32 (float64 for float64 inputs). Both return (o, final_state or None).
# Their inputs are checked first (checks.py).


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
    import kernel_decode  # noqa: F401 (engine.py's fused decoding)


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
    """The KLA layer (mixer 'kla'), or Gated DeltaNet's (mixer 'gdn') with q, k normalised and beta = eta; with
    config.step_rule any rule of STEP_RULES, and with config.decay False no decay."""

    def __init__(self, config, mixer="kla"):
        super().__init__()
        H, d = config.n_head, config.n_embd
        self.n_head, self.eps, self.decay = H, config.kla_eps, config.decay
        self.rule = config.step_rule or ("kaczmarz" if mixer == "kla" else "unit")
        self.chunk_size, self.backend = config.chunk_size, "auto"  # backend: set by GPT.set_switches
        self.dk, self.dv = int(config.expand_k * d) // H, int(config.expand_v * d) // H
        # one input projection for q, k, v, the output gate, eta and the decay (one matmul; one GEMV when
        # decoding), then a short convolution each for q, k, v (each output its own contiguous tensor, as the
        # kernel wants them: no copies, nothing saved twice for the backward); no eta for the 'scalar' rule, no
        # decay without it
        self.split = [H * self.dk, H * self.dk, H * self.dv, H * self.dv, H * (self.rule != "scalar"),
                      H * self.decay]  # q k v gate eta decay
        # padded with unused outputs to a multiple of 8 (rows of 16-byte multiples in bf16, as Hopper's TMA
        # GEMMs need; unpadded, cuBLAS ran a slower sm80 kernel: docs/kernel.md)
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
        self.recompute = False  # GPT's switch recompute_elementwise

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
    """A pre-norm residual block: the mixer named by mixer ('kla', 'gdn' or 'attn'), then the MLP."""

    def __init__(self, config, mixer):
        super().__init__()
        self.norm1 = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mixer = Attention(config) if mixer == "attn" else DeltaMixer(config, mixer)
        self.norm2 = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)
        self.recompute = False  # GPT's switch recompute

    def mix(self, x, cache=None, cu_seqlens=None):
        return self.drop(self.mixer(self.norm1(x), cache, cu_seqlens))

    def forward(self, x, cache=None, cu_seqlens=None):
        if self.recompute and cache is None and torch.is_grad_enabled():  # the same dropout mask when recomputed
            x = x + torch.utils.checkpoint.checkpoint(self.mix, x, None, cu_seqlens, use_reentrant=False)
        else:
            x = x + self.mix(x, cache, cu_seqlens)
        return x + self.drop(self.mlp(self.norm2(x)))


@dataclass
class GPTConfig:
    block_size: int = 1024     # training context; the recurrent mixers have no limit at inference
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 6
    n_embd: int = 768
    mixer: str = "kla"         # 'kla' | 'gdn' | 'attn', or a pattern per layer repeated to n_layer: 'kla,kla,kla,attn'
    step_rule: str = ""        # the KLA / GDN layers' step size, one of STEP_RULES; '': the mixer's own ('kaczmarz' for kla, 'unit' for gdn)
    decay: bool = True         # the KLA / GDN layers' learned decay; False: g = 0 (with step_rule 'unit': DeltaNet)
    expand_k: float = 0.75     # key width of all heads / n_embd (the authors' KLA setting)
    expand_v: float = 1.5      # value width of all heads / n_embd
    conv_size: int = 4         # short causal convolution on q, k, v
    mlp_hidden: int = 0        # SwiGLU width; 0 means 8/3 * n_embd rounded up to a multiple of 64
    kla_eps: float = 1e-6      # the eps of beta = eta / (||k||^2 + eps)
    chunk_size: int = 64       # the chunkwise reference's; the Triton kernel's chunks are 64 tokens
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dropout: float = 0.0       # on the embeddings and on each residual branch's output (nanoGPT's), training only

    def __post_init__(self):
        check_config(self, STEP_RULES)

    @property
    def mixers(self):
        """Each layer's mixer, n_layer names: mixer's pattern repeated (one name: that mixer at every layer)."""
        return mixer_layers(self.mixer, self.n_layer)


def sample_next(logits, temperature, top_k):
    """The next token (B, 1) from the logits (B, vocab): their argmax at temperature 0, else drawn from the softmax
    of logits / temperature over the top_k most likely tokens (None: all)."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("inf")
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


# How a step is computed, not what: run-time switches of GPT (GPT(config, **switches), set_switches), never saved
# with the weights. Each has no effect where it does not apply.
#   backend                'auto' (Triton on CUDA), 'triton', 'chunkwise' or 'recurrent': the KLA / GDN layer's path
#   recompute              training: each block's mixer branch recomputed in the backward instead of its activations
#                          kept (torch.utils.checkpoint): less memory, one more mixer forward
#   recompute_elementwise  training, KLA / GDN: only the elementwise work around the kernel recomputed in the backward
#                          (DeltaMixer.inputs, .gated), no kernel or matmul run again
#   fused_loss             training (targets and autograd): the loss and its gradient computed in the forward a chunk of
#                          rows at a time (FusedCrossEntropy), no (B, T, vocab) logits kept; the forward returns logits None
#   decode_fused           engine.py's decoding on the Triton backend: the mixer between its projections as one kernel,
#                          and at batch 1 the whole block as three
SWITCHES = dict(backend="auto", recompute=False, recompute_elementwise=False, fused_loss=False, decode_fused=True)
BACKENDS = ("auto", "triton", "chunkwise", "recurrent")


class GPT(nn.Module):

    def __init__(self, config, **switches):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config, mixer) for mixer in config.mixers])
        self.norm_f = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("o_proj.weight") or name.endswith("mlp.down.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        self.switches = dict(SWITCHES)
        self.set_switches(**switches)

    def set_switches(self, **switches):
        """Change run-time switches (SWITCHES) by keyword; a ValueError names an unknown one or a wrong value."""
        for name, value in switches.items():
            if name not in SWITCHES:
                raise ValueError(f"{name!r} is not a switch of the model; the switches are {', '.join(SWITCHES)}")
            if name == "backend" and value not in BACKENDS:
                raise ValueError(f"backend must be 'auto', 'triton', 'chunkwise' or 'recurrent', got {value!r}")
            if name != "backend" and not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        self.switches.update(switches)
        for block in self.blocks:
            block.recompute = self.switches["recompute"]
            if isinstance(block.mixer, DeltaMixer):
                block.mixer.backend = self.switches["backend"]
                block.mixer.recompute = self.switches["recompute_elementwise"]

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters())  # the tied embedding counts once

    def set_backend(self, device_type):
        """Choose the linear-attention path once for this device (see resolve_backend): the backend switch resolved."""
        backend = resolve_backend(self.switches["backend"], device_type)
        mixer = next((b.mixer for b in self.blocks if isinstance(b.mixer, DeltaMixer)), None)
        if backend == "triton" and mixer is not None and (mixer.dk > 128 or mixer.dv > 1024):
            raise ValueError(f"heads of d_k {mixer.dk}, d_v {mixer.dv}: the Triton kernel takes d_k <= 128 and d_v <= 1024; "
                             "use more heads, or backend='chunkwise'")
        self.set_switches(backend=backend)
        return backend

    def forward(self, idx, targets=None, cache=None, cu_seqlens=None):
        """idx (B, T) token ids. With targets: logits at every position and the mean loss (targets of -1
        are ignored). Without: logits at the last position only. cache: a list of one dict per layer,
        read and updated in place, so that a later call continues the sequence (see new_cache).
        cu_seqlens (N + 1,): idx (1, T) holds N documents packed (see doc_seqlens), each read as if alone:
        the states and convolutions of KLA / GDN reset at each, attention stays within each. With an empty cache
        as well (KLA / GDN): N prompts of different lengths read at once (prefill), the cache then holds a batch of
        N (each prompt's state and convolution inputs) and the logits are those of each prompt's last token (N, 1, vocab).
        A hybrid's layers each do as their mixer does."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T) token ids, got shape {tuple(idx.shape)}")
        if cu_seqlens is not None:
            if cache is not None and ("attn" in self.config.mixers or any(cache)):
                raise ValueError("cu_seqlens with a cache reads packed prompts into an empty cache, for KLA / GDN "
                                 f"layers only; got mixer {self.config.mixer!r} and a cache that "
                                 f"{'holds a state' if any(cache) else 'is empty'}")
            check_cu_seqlens(cu_seqlens, idx)
        x = self.drop(self.wte(idx))  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache[i], cu_seqlens)
        x = self.norm_f(x)
        if targets is None:
            last = x[:, -1:, :] if cu_seqlens is None else x[0, cu_seqlens[1:].long() - 1, None]  # (B or N, 1, C)
            return self.lm_head(last), None
        if self.switches["fused_loss"] and torch.is_grad_enabled():  # training: no logits kept, none returned
            return None, FusedCrossEntropy.apply(x.flatten(0, 1), self.lm_head.weight, targets.reshape(-1))
        logits = self.lm_head(x)
        if not torch.is_grad_enabled():  # evaluation: the float32 log-softmax made a chunk of rows at a time
            return logits, chunked_cross_entropy(logits, targets)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def new_cache(self):
        """One dict per layer, filled by its mixer: an attention layer's keys and values, a KLA / GDN layer's state
        and convolution inputs."""
        return [dict() for _ in self.blocks]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        # matrices (linear, embedding, conv weights) decay; vectors (norms, biases, A_log, dt_bias) do not
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")

    def flops_per_token(self, T):
        """Forward + backward FLOPs per token at sequence length T: 6 N for the weights, plus each layer's
        mixer's own matmuls (causal attention, or the chunkwise delta rule of KLA / GDN)."""
        cfg, d = self.config, self.config.n_embd
        dk, dv, C = cfg.expand_k * d / cfg.n_head, cfg.expand_v * d / cfg.n_head, min(cfg.chunk_size, T)
        # attention: QK^T and AV, causal half; KLA / GDN per head: K K^T, Q K^T, T (V, K), intra-chunk attn @ U
        # (4C(dk+dv)), K S, Q S, K^T U (6 dk dv)
        attn, delta = 2 * 2 * d * T / 2, cfg.n_head * (4 * C * (dk + dv) + 6 * dk * dv)
        return 6 * self.get_num_params() + 3 * sum(attn if mixer == "attn" else delta for mixer in cfg.mixers)

    def estimate_mfu(self, tokens_per_iter, dt, peak_flops):
        """Model FLOPs utilisation: achieved FLOP/s over peak_flops (e.g. 989e12 for H100/H200 bf16)."""
        return self.flops_per_token(self.config.block_size) * tokens_per_iter / dt / peak_flops

    @classmethod
    def from_checkpoint(cls, checkpoint, **overrides):
        """The model of a checkpoint dict from run_safety.read_checkpoint; overrides are run-time switches (SWITCHES)
        or change config fields that do not change the weights, such as dropout. Switches saved in model_args by an
        older train.py are ignored. (Weights of a torch.compile'd model, saved by other code, have their keys under
        '_orig_mod.'.)"""
        switches = {k: overrides.pop(k) for k in SWITCHES if k in overrides}
        args = {**{k: v for k, v in checkpoint["model_args"].items() if k not in SWITCHES}, **overrides}
        unknown = sorted(args.keys() - {f.name for f in fields(GPTConfig)})
        if unknown:
            raise ValueError(f"checkpoint's model_args hold {unknown[:4]}, which this model.py does not know; it was "
                             "written by a different version of the model")
        try:
            config = GPTConfig(**args)
        except (TypeError, ValueError) as err:  # a value of another type than the field's, e.g. n_layer '4'
            raise ValueError(f"checkpoint's model_args do not fit this model.py ({err}): a damaged file") from None
        model = cls(config, **switches)
        state = {k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items()}
        check_weights(state, model.state_dict())
        model.load_state_dict(state)
        return model

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """nanoGPT's interface: the prompt (B, T) followed by max_new_tokens tokens (temperature 0: greedy; top_k None:
        all tokens). The simple path: the prompt read in one pass, then one token at a time from the cache
        (engine.py's Engine is the fast one)."""
        check_sampling(temperature, top_k)
        cache = self.new_cache()
        logits, _ = self(idx, cache=cache)
        for i in range(max_new_tokens):
            idx_next = sample_next(logits[:, -1], temperature, top_k)
            idx = torch.cat([idx, idx_next], 1)
            if i + 1 < max_new_tokens:
                logits, _ = self(idx_next, cache=cache)
        return idx
