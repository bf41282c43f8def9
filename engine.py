"""
Inference for the model of model.py: the fast path (GPT.generate is the simple one, and the reference for this).

    engine = Engine(model)                     # model: a GPT in eval mode, its backend chosen (GPT.set_backend)
    for tok in engine.stream(idx, 100, temperature=0.8, top_k=200, cuda_graph=True):
        ...                                    # tok (B, 1), one at a time

- prefill: a long prompt read in segments of PREFILL_SEGMENT tokens (KLA / GDN: the state carried across them,
  memory flat in the prompt's length), the full segments after the first replayed from one CUDA graph; prompts of
  different lengths read packed in one pass (prefill_packed). A model with attention layers (attention, or a hybrid)
  reads the prompt in one pass: their KV cache grows with it anyway, and a later segment's attention would need a
  (segment x prompt) mask where one pass takes SDPA's causal kernel.
- decoding: every token costs O(1) from the carried state (attention: its KV cache), one step replayed from a CUDA
  graph (KLA / GDN layers only); on the Triton backend (the decode_fused switch) each KLA / GDN mixer runs between
  its projections as one kernel, and at batch 1 each such block as three (kernel_decode.py); a hybrid's attention
  layers run as their layers, from their KV cache.
The cache is model.GPT.new_cache()'s: one dict per layer, read and updated in place.
"""

import torch

from model import DeltaMixer, check_sampling, kernel_decode, sample_next

# The segment of a long prompt that KLA / GDN read at a time (Engine.stream, sample.py): prefill memory stays flat
# in the prompt's length at 1.05-1.08x the one pass's time from 32K to 128K (results/bench_h200/prefill_segments.md).
PREFILL_SEGMENT = 16384

# -----------------------------------------------------------------------------
# The fused decoding step of a KLA / GDN mixer


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

# -----------------------------------------------------------------------------
# The engine


class Engine:
    """Prefill, decoding and streaming of a GPT; the CUDA graphs of prefill's segments are kept here, one per
    batch, segment length and weights (segment_graphs)."""

    def __init__(self, model):
        self.model = model
        self.segment_graphs = {}

    def compile(self, **kwargs):
        """torch.compile the model's forward (in place) and the engine's (the fused decoding step around it)."""
        self.model.compile(**kwargs)
        self.forward = torch.compile(self.forward, **kwargs)

    def forward(self, idx, cache):
        """The model's forward for inference, idx (B, T) read into cache: the logits of the last position
        (B, 1, vocab); one token through the fused decoding kernels where they apply (decodes_fused)."""
        if self.decodes_fused(idx, cache):
            return self._decode_fused(idx, cache)
        return self.model(idx, cache=cache)[0]

    def decodes_fused(self, idx, cache):
        """Whether this call decodes one token through kernel_decode's kernels (the decode_fused switch): KLA or
        GDN layers (a hybrid's attention layers run as their layers) on the Triton backend, a cache that holds a state,
        no autograd. The kernels make eta and the decay from the layer's projections and beta from KLA's or GDN's rule:
        other rules and decay=False decode unfused."""
        m = self.model
        i = next((i for i, b in enumerate(m.blocks) if isinstance(b.mixer, DeltaMixer)), None)
        return (idx.shape[1] == 1 and m.switches["decode_fused"] and i is not None
                and m.blocks[i].mixer.backend == "triton" and "state" in cache[i] and not torch.is_grad_enabled()
                and not (m.training and m.config.dropout)  # the kernels apply no dropout
                and m.blocks[i].mixer.rule in ("kaczmarz", "unit") and m.config.decay)

    def _decode_fused(self, idx, cache):
        """forward for one token (B, 1) through the fused decoding kernels; the logits (B, 1, vocab). At batch 1,
        with the weights and the cache's buffers in one dtype (not under autocast), every block and the head run
        as kernels alone (_decode_fused_batch1); else each mixer runs between its projections as one kernel
        (kernel_decode.kla_decode_mixer) and the rest of the model as its layers. Attention blocks run as they are."""
        model = self.model
        x = model.wte(idx)  # (B, 1, C)
        if x.shape[0] == 1 and x.dtype == next(st for st in cache if "q_conv" in st)["q_conv"].dtype:
            return self._decode_fused_batch1(x, cache)
        B = x.shape[0]
        for block, st in zip(model.blocks, cache):
            m = block.mixer
            if not isinstance(m, DeltaMixer):
                x = block(x, st)
                continue
            o = _decode_mixer(m, m.in_proj(block.norm1(x)).view(B, -1), st)  # (B, H dv)
            x = x + m.o_proj(o.view(B, 1, -1))
            x = x + block.mlp(block.norm2(x))
        return model.lm_head(model.norm_f(x))

    @torch.compiler.disable  # Triton kernels that update the cache's buffers in place
    def _decode_fused_batch1(self, x, cache):
        """Each block as three kernels (kernel_decode.kla_decode_block): RMSNorm + the mixer's input projection + the
        short convolutions; the state step, each head's values over several programs, with their share of the output
        projection; the heads' RMSNorm, the residual, RMSNorm and the MLP with the residual. The residual stream
        between blocks in float32. Then norm_f + lm_head as one more (kernel_decode.decode_linear). A hybrid's attention
        blocks run as their layers on the residual in the weights' dtype."""
        model = self.model
        dtype, x = x.dtype, x.view(1, -1)
        for block, st in zip(model.blocks, cache):
            m = block.mixer
            if not isinstance(m, DeltaMixer):
                x = block(x.to(dtype).view(1, 1, -1), st).view(1, -1)
                continue
            x = kernel_decode.kla_decode_block(
                x, block.norm1.weight, m.in_proj.weight, st["q_conv"], st["k_conv"], st["v_conv"], m.q_conv.weight,
                m.k_conv.weight, m.v_conv.weight, m.A_log, m.dt_bias, m.eta_bias, st["state"], m.o_norm.weight,
                m.o_proj.weight, block.norm2.weight, block.mlp.gate_up.weight, block.mlp.down.weight,
                n_head=m.n_head, eps=m.eps, norm_eps=block.norm1.eps, o_norm_eps=m.o_norm.eps,
                kaczmarz=m.rule == "kaczmarz")
        return kernel_decode.decode_linear(x, model.lm_head.weight, norm_weight=model.norm_f.weight,
                                           norm_eps=model.norm_f.eps).view(1, 1, -1)

    @torch.no_grad()
    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, cuda_graph=False, prefill_chunk=PREFILL_SEGMENT):
        """Yield max_new_tokens new tokens (B, 1) one at a time (temperature 0: greedy; top_k None: all tokens).
        The prompt is read once by the chunkwise path, in segments of prefill_chunk tokens where every layer is KLA /
        GDN (the state carried across them, so that memory does not grow with the prompt); every later token costs
        O(1) from the carried state (attention: its KV cache). cuda_graph: replay each decoding step, and a long
        prompt's segments, from CUDA graphs (KLA / GDN on CUDA), without per-kernel launch costs. idx may also be a
        list of N 1-D prompts of different lengths (KLA / GDN): they are read in one pass, packed (cu_seqlens), then
        decoded together as a batch of N."""
        check_sampling(temperature, top_k)
        cache = self.model.new_cache()
        if isinstance(idx, (list, tuple)):
            logits = self.prefill_packed(idx, cache)
        else:
            segment = idx.shape[1] if "attn" in self.model.config.mixers else prefill_chunk  # see the docstring
            logits = self.prefill(idx, cache, segment, cuda_graph)
        greedy = temperature == 0
        step = self.decode_step(cache, logits.shape[0], cuda_graph, greedy=greedy) if max_new_tokens > 1 else None
        for i in range(max_new_tokens):
            if not greedy or i == 0:
                idx_next = sample_next(logits[:, -1, :], temperature, top_k)
            yield idx_next
            if i + 1 < max_new_tokens:
                if greedy:  # the step returns the next token itself
                    idx_next = step(idx_next)
                else:
                    logits = step(idx_next)

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, cuda_graph=False):
        """nanoGPT's interface (GPT.generate's) on this engine: the prompt (B, T) followed by max_new_tokens tokens."""
        return torch.cat([idx, *self.stream(idx, max_new_tokens, temperature, top_k, cuda_graph)], 1)

    @torch.no_grad()
    def prefill(self, idx, cache, segment, cuda_graph=False):
        """Read idx (B, T) into cache in segments of `segment` tokens, the state carried across them;
        the logits of the last position. cuda_graph (KLA / GDN, at least two full segments): the full segments
        after the first replayed from one CUDA graph (decode_step for `segment` tokens; no launch work on the host),
        made once per batch, segment and weights and kept in segment_graphs for later prompts."""
        B, T = idx.shape
        logits = self.forward(idx[:, :segment], cache)  # from the empty cache, which then holds its buffers
        s, n_full = segment, (T - segment) // segment
        if cuda_graph and "attn" not in self.model.config.mixers and n_full >= 1:
            weight = self.model.wte.weight
            key = (B, segment, weight.dtype, weight.data_ptr())
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
            logits = self.forward(idx[:, s:s + segment], cache)
        return logits

    @torch.no_grad()
    def prefill_packed(self, prompts, cache):
        """Read N 1-D prompts of any lengths into the empty cache in one pass (packed, each from a fresh state):
        the cache then holds a batch of N. The logits of each prompt's last token (N, 1, vocab)."""
        if "attn" in self.model.config.mixers:
            raise ValueError("prompts of different lengths are read packed by KLA / GDN only; for a model with "
                             f"attention layers (mixer {self.model.config.mixer!r}) pad them to one length (B, T)")
        if not prompts or any(not torch.is_tensor(p) or p.dim() != 1 or len(p) == 0 for p in prompts):
            raise ValueError(f"prompts must be a non-empty list of non-empty 1-D token tensors, got "
                             f"{[tuple(p.shape) if torch.is_tensor(p) else type(p).__name__ for p in prompts]}")
        lens = torch.tensor([0] + [len(p) for p in prompts])
        cu_seqlens = lens.cumsum(0).to(device=prompts[0].device, dtype=torch.int32)
        return self.model(torch.cat(prompts)[None], cache=cache, cu_seqlens=cu_seqlens)[0]

    def decode_step(self, cache, batch, cuda_graph=False, length=1, greedy=False):
        """A function tokens (B, length) -> logits (B, 1, vocab) that advances cache by length tokens; greedy: ->
        the next token (B, 1), the argmax of those logits. With cuda_graph, the state lives in fixed buffers
        updated in place (the forward's new state is copied back into them), so that the step is captured once
        and replayed (on CUDA; elsewhere the same in-place step runs directly); greedy, the argmax is part of
        the graph, which writes it into its own input, so that passing back the token it returned copies
        nothing."""
        out = (lambda logits: logits[:, -1].argmax(-1, keepdim=True)) if greedy else (lambda logits: logits)
        if not cuda_graph:
            return lambda tok: out(self.forward(tok, cache))
        if "attn" in self.model.config.mixers:
            raise ValueError("cuda_graph decoding needs a fixed-size state: every layer 'kla' or 'gdn', got mixer "
                             f"{self.model.config.mixer!r}")
        tok = torch.zeros(batch, length, dtype=torch.long, device=self.model.wte.weight.device)

        def step():
            new = [dict(c) for c in cache]  # the forward reads the buffers and puts its new state here
            logits = self.forward(tok, new)
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
