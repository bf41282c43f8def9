"""
GPU correctness of kernel.py and kernel_decode.py against the float64 references (model.kla_chunkwise and
model.kla_recurrent, run in float64 on the GPU).
A script, not a pytest module (CI has no GPU):
    python test_gpu.py [--out=DIR] [--cases=0,3] [--varlen] [--kernels] [--model] [--decoding] [--paths=default,alt]
                       [--large] [--smoke]
It needs a CUDA GPU (without one it stops with one line, as it does for a --cases index outside the list); --smoke
runs on the CPU.
--varlen runs only the cases of packed sequences (cu_seqlens; in the default run too): N sequences in a batch
of 1, each from its own initial state, against the float64 reference run on each sequence alone; and the model
on packed documents (per-document losses, compiled, packed prompts decoded as one batch).
--kernels runs the chunk cases alone (not the model's packed documents nor the decoding checks).
--model runs the fused loss's and the decoding checks alone; --decoding the decoding checks alone.
--paths=alt runs the cases with the other forward path forced (kernel.CONFIGS's "fuse_o": the output added inside
the sequential forward, or afterwards by _fwd_o_kernel from the saved states), which the config picks by shape.

For every case: relative error ||x - ref|| / ||ref|| of the output, the final state and every gradient
(q, k, v, g, eta, initial state), all finite. Tolerances: float32 inputs 2e-3, bfloat16 1e-2.
Also the decode step (kernel.kla_step) against the recurrent reference, eager and replayed from a CUDA graph;
the fused decoding kernels (kernel_decode.py) in a one-layer model; the whole model decoding; 256 greedy tokens of
sample.py's path against the model's plain PyTorch path (KLA and GDN, batch 1 and 64, float32).
The fused loss (the model's fused_loss switch) against float64 alone and against the model without it.
--smoke runs two tiny cases on the CPU in Triton's interpreter (float32 only), to check the script itself.
"""

import contextlib
import math
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch

import chunked_loss
import kernel
import model
from engine import Engine

TOL = {torch.float32: 2e-3, torch.bfloat16: 1e-2}


def rel(a, b):
    """||a - b|| / ||b||, the norm of b taken as at least 1e-10: the float64 reference is rounded too, and where the
    exact value is 0 it need not be (dg at T = 1 without an initial state, where the gate scales a zero state, came
    out up to 1e-14 for 24 of 300 random inputs on the CPU), against which an exact 0 would count as error 1."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-10)).item()


DECAY = {"mixed": (-6, 0), "strong": (1.5, 2.5), "weak": (-12, -9)}  # log(-g): g from -e^lo to -e^hi


def make_inputs(B, T, H, K, V, knorm, h0, device, gen, decay="mixed", edge=False):
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1)
    lo, hi = math.log(knorm[0]), math.log(knorm[1])
    k = k * torch.exp(lo + (hi - lo) * torch.rand(B, T, H, 1, device=device, generator=gen))
    v = torch.randn(B, T, H, V, device=device, generator=gen)
    # Mamba2-like decays: some heads slow, some fast (mixed); strong: g ~ -5 (state forgotten within a few
    # tokens); weak: g ~ -1e-4; none: g = 0; cut: mixed with some g = -inf; alternating: -1e4 and -0.01
    g = torch.zeros(B, T, H, device=device)
    if decay != "none":
        g = -torch.exp(g.uniform_(*DECAY.get(decay, DECAY["mixed"]), generator=gen))
    if decay == "cut":  # full forgetting (document boundaries): every 7th token, and the last of a chunk with
        g[:, ::7], g[:, 63:66] = float("-inf"), float("-inf")  # the first two of the next
    if decay == "alternating":  # strongly negative gates beside weak ones
        g[:, ::2], g[:, 1::2] = -1e4, -0.01
    eta = torch.rand(B, T, H, device=device, generator=gen)
    if edge:  # zero keys (every 7th token), eta exactly 0 and 1, g = 0 on a stretch
        k[:, ::7] = 0.
        eta[:, 1::7], eta[:, 2::7] = 0., 1.
        g[:, T // 3: T // 2] = 0.
    s0 = torch.randn(B, H, K, V, device=device, generator=gen) if h0 else None
    return q, k, v, g, eta, s0


def random_cu_seqlens(T, N, device, gen):
    """cu_seqlens of N packed sequences of random lengths summing to T, the first of length 1."""
    cuts = torch.randperm(T - 2, device=device, generator=gen)[:N - 2].sort().values + 2  # in 2 .. T - 1
    return torch.cat([cuts.new_tensor([0, 1]), cuts, cuts.new_tensor([T])]).int()


def check_chunk(B, T, H, K, V, dtype, h0, kaczmarz, knorm, device, gen, decay="mixed", grad=True, eps=1e-6,
                edge=False, seqs=None):
    """seqs: packed sequences (B = 1): their number (random lengths, random_cu_seqlens) or their lengths."""
    q, k, v, g, eta, s0 = make_inputs(B, T, H, K, V, knorm, h0, device, gen, decay, edge)
    cu = None
    if seqs is not None:
        cu = random_cu_seqlens(T, seqs, device, gen) if isinstance(seqs, int) else \
            torch.tensor([0, *seqs], device=device).cumsum(0).int()
        s0 = torch.randn(len(cu) - 1, H, K, V, device=device, generator=gen) if h0 else None
    ours = [x.to(dtype) for x in (q, k, v)] + [g, eta] + ([s0] if h0 else [])
    ours = [x.clone().requires_grad_() for x in ours]
    ref = [x.detach().double().requires_grad_() for x in ours]
    with torch.set_grad_enabled(grad):
        o, ht = kernel.kla_chunk(*ours[:5], initial_state=ours[5] if h0 else None, output_final_state=True,
                                 kaczmarz=kaczmarz, eps=eps, cu_seqlens=cu)
        o_ref, ht_ref = model.kla_chunkwise(*ref[:5], initial_state=ref[5] if h0 else None,
                                            output_final_state=True, kaczmarz=kaczmarz, eps=eps, cu_seqlens=cu)
    errs = {"o": rel(o, o_ref), "ht": rel(ht, ht_ref)}
    finite = bool(torch.isfinite(o).all() and torch.isfinite(ht).all())
    if not grad:
        return errs, finite
    # the reference gets the same dO the kernel gets (rounded to o's dtype), as it gets the same rounded q, k, v:
    # rounding dO to bf16 alone moves dq by up to 2e-2 at T = 1 (one token a head, dq a multiple of k)
    do = torch.randn(o_ref.shape, device=device, generator=gen).to(o.dtype)
    dht = torch.randn(ht_ref.shape, device=device, generator=gen)
    torch.autograd.backward([o, ht], [do, dht])
    torch.autograd.backward([o_ref, ht_ref], [do.double(), dht.double()])
    for name, a, b in zip(["dq", "dk", "dv", "dg", "deta", "dh0"], ours, ref):
        errs[name] = rel(a.grad, b.grad)
        finite &= bool(torch.isfinite(a.grad).all())
    return errs, finite


def check_step(B, H, K, V, kaczmarz, knorm, device, gen):
    q, k, v, g, eta, s0 = make_inputs(B, 1, H, K, V, knorm, True, device, gen)
    o_ref, s_ref = model.kla_recurrent(*(x.double() for x in (q, k, v, g, eta)), initial_state=s0.double(),
                                       output_final_state=True, kaczmarz=kaczmarz)
    o, s1 = kernel.kla_step(q, k, v, g, eta, s0, kaczmarz=kaczmarz)
    errs = {"o": rel(o, o_ref), "ht": rel(s1, s_ref)}
    if device == "cuda":  # the same step captured in a CUDA graph and replayed on fresh inputs
        ins = [x.clone() for x in (q, k, v, g, eta, s0)]
        kernel.kla_step(*ins[:5], ins[5], kaczmarz=kaczmarz)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_g, s_g = kernel.kla_step(*ins[:5], ins[5], kaczmarz=kaczmarz)
        q2, k2, v2, g2, eta2, s2 = make_inputs(B, 1, H, K, V, knorm, True, device, gen)
        for dst, src in zip(ins, (q2, k2, v2, g2, eta2, s2)):
            dst.copy_(src)
        graph.replay()
        o_ref2, s_ref2 = model.kla_recurrent(*(x.double() for x in (q2, k2, v2, g2, eta2)),
                                             initial_state=s2.double(), output_final_state=True, kaczmarz=kaczmarz)
        errs["o_graph"], errs["ht_graph"] = rel(o_g, o_ref2), rel(s_g, s_ref2)
    s_in = s0.clone()  # in place, as the model decodes: the new state over the old
    o_i, _ = kernel.kla_step(q, k, v, g, eta, s_in, kaczmarz=kaczmarz, out_state=s_in)
    errs["o_inplace"], errs["ht_inplace"] = rel(o_i, o_ref), rel(s_in, s_ref)
    return errs, bool(torch.isfinite(o).all() and torch.isfinite(s1).all())


def check_large(device, gen):
    """Tensors past 2**31 elements (int64 offsets): v and o of (1, 2**21, 8, 128). The last head of the big
    call (the largest offsets) against the same head computed alone, output and gradients."""
    B, T, H, K = 1, 2 ** 21, 8, 128
    q, k, v, g, eta, _ = make_inputs(B, T, H, K, K, (0.3, 3.0), False, device, gen)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    big = [x.requires_grad_() for x in (q, k, v, g, eta)]
    alone = [x[:, :, -1:].detach().clone().requires_grad_() for x in big]
    o_big, _ = kernel.kla_chunk(*big)
    o_one, _ = kernel.kla_chunk(*alone)
    do = torch.randn_like(o_one)
    o_big[:, :, -1:].backward(do)
    o_one.backward(do)
    errs = {"o": rel(o_big[:, :, -1:], o_one)}
    for name, a, b in zip(["dq", "dk", "dv", "dg", "deta"], big, alone):
        errs[name] = rel(a.grad[:, :, -1:], b.grad)
    finite = bool(torch.isfinite(o_big).all()) and all(bool(torch.isfinite(x.grad).all()) for x in big)
    return errs, finite


def check_decode(device, B, dtype, mixer="kla", width=768, heads=6, prompt=300, autocast=False):
    """One token through Engine._decode_fused (kernel_decode.py) in a one-layer model of GPT-2-small's width (6 heads,
    d_k 96, d_v 192) after a 300-token prefill, against the same model in float64 on the recurrent reference
    path, both starting from the reference's prefill state: the logits, the new state and the three
    convolution buffers (relative errors). At batch 1 the block runs as three kernels and the head as one
    (kla_decode_block, decode_linear); at batch > 1, or under autocast (float32 weights), the mixer runs
    between the layer's projections as one kernel (kla_decode_mixer)."""
    torch.manual_seed(0)
    cfg = model.GPTConfig(n_layer=1, vocab_size=512, n_embd=width, n_head=heads, mixer=mixer)
    fused = model.GPT(cfg, backend="triton").to(device).to(torch.float32 if autocast else dtype).eval()
    for name, p in fused.named_parameters():  # norms' weights away from their initial ones: a lost one shows
        if "norm" in name:
            p.data.uniform_(0.5, 1.5)
        elif p.dim() == 2 and "conv" not in name:  # embeddings of unit size, projections at unit gain: what
            p.data.normal_(0, 1.0 if name == "wte.weight" else p.shape[1] ** -0.5)  # the block adds to its input
            # is then about as large as the input, so that an error there shows in the logits
    ref = model.GPT(cfg, backend="recurrent", decode_fused=False)
    ref = ref.to(device).double().eval()
    ref.load_state_dict(fused.state_dict())
    idx = torch.randint(512, (B, prompt + 1), device=device)
    ctx = torch.autocast(device, dtype=dtype) if autocast else contextlib.nullcontext()
    with torch.no_grad():
        c_f, c_r = fused.new_cache(), ref.new_cache()
        with ctx:
            fused(idx[:, :prompt], cache=c_f)
        ref(idx[:, :prompt], cache=c_r)
        for key in c_f[0]:
            c_f[0][key].copy_(c_r[0][key])
        with ctx:
            y_f = Engine(fused).forward(idx[:, prompt:], c_f)
        y_r = ref(idx[:, prompt:], cache=c_r)[0]
    errs = {"logits": rel(y_f, y_r)}
    errs.update({key: rel(c_f[0][key], c_r[0][key]) for key in ("state", "q_conv", "k_conv", "v_conv")})
    return errs


def check_model_decode(device, compiled, fused=True, batch=2):
    """The whole model (KLA, float32, 2 layers) decoding greedily on the Triton path (the fused decoding
    kernel, or with fused=False the layer's PyTorch code around the step kernel), replayed from a CUDA
    graph (and torch.compile'd): its logits at every new token against one full forward over prompt +
    new tokens on the float64 chunkwise reference path; the tokens against plain step-by-step decoding."""
    torch.manual_seed(0)
    cfg = model.GPTConfig(block_size=512, vocab_size=512, n_layer=2, n_head=4, n_embd=256, mixer="kla")
    m = model.GPT(cfg, decode_fused=fused).to(device).eval()
    m.set_backend(device)
    ref = model.GPT(cfg, backend="chunkwise").to(device).double().eval()
    ref.load_state_dict(m.state_dict())
    engine = Engine(m)
    if compiled:
        engine.compile(dynamic=True)
    prompt = torch.randint(512, (batch, 160), device=device)  # segments of 64: the first, one from the graph, 32 more
    graph = device == "cuda"
    toks = torch.cat(list(engine.stream(prompt, 24, temperature=0, cuda_graph=graph, prefill_chunk=64)), 1)
    plain = torch.cat(list(engine.stream(prompt, 24, temperature=0, cuda_graph=False, prefill_chunk=64)), 1)
    full = torch.cat([prompt, toks], 1)
    with torch.no_grad():  # the reference's logits at the positions that predicted each new token
        want = ref(full, full)[0][:, prompt.shape[1] - 1:-1]
        cache = m.new_cache()  # the model's own: prefill, then its decode step (graph or not), token by token
        got = [engine.prefill(prompt, cache, 64)]
        step = engine.decode_step(cache, batch, cuda_graph=graph)
        for i in range(toks.shape[1] - 1):
            got.append(step(toks[:, i:i + 1]).clone())
    return {"logits": rel(torch.cat(got, 1), want), "tokens_vs_plain": float((toks != plain).float().mean())}


def check_greedy(device, mixer, batch, new_tokens=256):
    """sample.py's path on CUDA (the Triton kernels, the fused decoding kernels, each step replayed from a CUDA
    graph; a hybrid's: its KLA / GDN layers fused, no graph) against the model's plain PyTorch path (the chunkwise reference, then the recurrent step), float32,
    the same weights (2 layers): the share of greedy tokens that differ, and the relative error between the two
    models' logits at the last position of prompt + tokens (one forward each)."""
    torch.manual_seed(0)
    cfg = model.GPTConfig(block_size=512, vocab_size=512, n_layer=2, n_head=4, n_embd=256, mixer=mixer)
    fast = model.GPT(cfg).to(device).eval()
    fast.set_backend(device)
    plain = model.GPT(cfg, backend="chunkwise").to(device).eval()
    plain.load_state_dict(fast.state_dict())
    plain.set_backend(device)
    prompt = torch.randint(512, (batch, 100), device=device)
    with torch.no_grad():
        graph = device == "cuda" and "attn" not in cfg.mixers
        got = torch.cat(list(Engine(fast).stream(prompt, new_tokens, temperature=0, cuda_graph=graph)), 1)
        want = torch.cat(list(Engine(plain).stream(prompt, new_tokens, temperature=0)), 1)
        full = torch.cat([prompt, want[:, :-1]], 1)
        last = [m(full)[0][:, -1] for m in (fast, plain)]
    return float((got != want).float().mean()), rel(*last)


def check_documents(lines, device, smoke):
    """The model on packed documents (cu_seqlens) on this device: each document's loss as the document alone
    (float32, 1e-5; attention through FlexAttention's document mask on CUDA), the same torch.compile'd in bf16
    (loss within 1e-2 of eager, finite gradients), and prompts of different lengths read packed then decoded
    as one batch, each with the greedy tokens it gets alone. Rows appended to lines; returns the failures."""
    import torch.nn.functional as F
    lens = [1, 3, 17, 8, 33] if smoke else [1, 3, 17, 100, 64, 300, 65, 1000]
    cu = torch.tensor([0, *lens], device=device).cumsum(0)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    failures = 0
    lines += ["", f"packed documents in the model ({len(lens)} documents of {min(lens)} to {max(lens)} tokens):", ""]
    for mixer in ("kla", "gdn", "attn", "kla,attn"):
        torch.manual_seed(0)
        cfg = dict(n_layer=2, n_head=2, n_embd=32 if smoke else 128, vocab_size=61, block_size=int(cu[-1]),
                   mixer=mixer, chunk_size=16)
        m = model.GPT(model.GPTConfig(**cfg)).to(device)
        m.set_backend(device.type if hasattr(device, "type") else str(device))
        idx, targets = torch.randint(0, 61, (2, 1, int(cu[-1])), device=device)
        logits, _ = m(idx, targets, cu_seqlens=cu)
        token_losses = F.cross_entropy(logits[0].float(), targets[0], reduction="none")
        packed = torch.stack([token_losses[a:b].mean() for a, b in bounds])
        with torch.no_grad():
            alone = torch.stack([m(idx[:, a:b], targets[:, a:b])[1] for a, b in bounds])
        err = rel(packed, alone)
        ok = err < 1e-5
        row = f"{mixer}: per-document losses, float32, packed vs alone {err:.1e}"
        if not smoke:  # compiled, bf16 autocast, as train.py --documents=True --compile=True runs
            mc = model.GPT(model.GPTConfig(**cfg)).to(device)
            mc.load_state_dict(m.state_dict())
            mc.set_backend("cuda")
            mc.compile()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss_c = mc(idx, targets, cu_seqlens=cu)
                _, loss_e = m(idx, targets, cu_seqlens=cu)
            loss_c.backward()
            finite = all(p.grad is None or torch.isfinite(p.grad).all() for p in mc.parameters())
            err_c = abs(loss_c.item() - loss_e.item()) / abs(loss_e.item())
            ok = ok and finite and err_c < 1e-2
            row += f"; compiled bf16 loss vs eager {err_c:.1e}, gradients {'finite' if finite else 'NOT finite'}"
        if "attn" not in mixer:  # packed prompts: KLA / GDN models only
            m.eval()
            prompts = [idx[0, a:b] for a, b in bounds]
            with torch.no_grad():
                together = torch.cat(list(Engine(m).stream(prompts, 16, temperature=0, cuda_graph=not smoke)), 1)
                each = torch.cat([torch.cat(list(Engine(m).stream(p[None], 16, temperature=0)), 1) for p in prompts])
            same = torch.equal(together, each)
            ok = ok and same
            row += f"; packed prompts decoded as one batch: {'the same' if same else 'DIFFERENT'} greedy tokens as each alone"
        failures += not ok
        lines.append(row + f" {'ok' if ok else 'FAIL'}")
        print(lines[-1], flush=True)
    return failures


def check_fused_loss(lines, device, smoke):
    """The fused_loss switch (chunked_loss.FusedCrossEntropy) on this device, with chunked_loss.LOSS_CHUNK set so that
    the rows fall in several chunks, the last one shorter: the loss alone (loss, dx, dw) against float64, float32 and bf16 autocast
    (on CUDA its float32 weight-gradient sums run through the kla::add_mm operator), beside the logits'
    F.cross_entropy's own error; and a small model's loss and every parameter's gradient against the model without
    fused_loss in float32. Eager and torch.compile'd. Rows appended to lines; returns the failures."""
    import torch.nn.functional as F
    lines += ["", "fused_loss (relative errors; the loss alone against float64, the model against the model without it):", ""]
    failures, chunk, device = 0, chunked_loss.LOSS_CHUNK, torch.device(device)
    gen = torch.Generator(device).manual_seed(1)
    x0 = torch.randn(900, 64, device=device, generator=gen)
    w0 = torch.randn(1000, 64, device=device, generator=gen) * 0.2
    t = torch.randint(0, 1000, (900,), device=device, generator=gen)
    t[::37] = -1
    x, w = x0.double().requires_grad_(), w0.double().requires_grad_()
    loss = F.cross_entropy(x @ w.t(), t, ignore_index=-1)
    loss.backward()
    ref = [loss.detach(), x.grad, w.grad]
    paths = {"fused": lambda x, w: chunked_loss.FusedCrossEntropy.apply(x, w, t),
             "logits": lambda x, w: F.cross_entropy(F.linear(x, w).float(), t, ignore_index=-1)}
    chunked_loss.LOSS_CHUNK = 1000 * 150  # 150 rows a chunk: 900 rows in 6, the model's 2 x 400 in 5 and a shorter one
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for compiled in ((False,) if smoke else (False, True)):
                errs = {}
                for name, fn in paths.items():
                    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                        loss = (torch.compile(fn) if compiled else fn)(x, w)
                    loss.backward()
                    errs[name] = [rel(a, b) for a, b in zip([loss.detach(), x.grad, w.grad], ref)]
                tol = TOL[dtype] if dtype == torch.bfloat16 else 1e-5
                ok = max(errs["fused"]) < tol
                failures += not ok
                lines.append(f"loss alone, {'bf16' if dtype == torch.bfloat16 else 'float32'}, "
                             f"{'compiled' if compiled else 'eager'}: loss / dx / dw "
                             + " / ".join(f"{e:.1e}" for e in errs["fused"])
                             + " (logits' cross-entropy: " + " / ".join(f"{e:.1e}" for e in errs["logits"])
                             + f") {'ok' if ok else 'FAIL'}")
                print(lines[-1], flush=True)
        for compiled in ((False,) if smoke else (False, True)):
            losses, grads = [], []
            for fused in (False, True):
                torch.manual_seed(0)
                m = model.GPT(model.GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=1000, block_size=400,
                                              chunk_size=16), fused_loss=fused).to(device)
                m.set_backend(device.type)
                if compiled:
                    m.compile()
                idx, targets = torch.randint(0, 1000, (2, 2, 400), device=device, generator=gen.manual_seed(2))
                targets[:, ::37] = -1
                _, loss = m(idx, targets)
                loss.backward()
                losses.append(loss.detach())
                grads.append({n: p.grad for n, p in m.named_parameters()})
            err_loss = rel(losses[1], losses[0])
            err_grad = max(rel(grads[1][n], g) for n, g in grads[0].items())
            ok = err_loss < 1e-5 and err_grad < 1e-5
            failures += not ok
            lines.append(f"model, float32, {'compiled' if compiled else 'eager'}: loss {err_loss:.1e}, every "
                         f"parameter's gradient {err_grad:.1e} {'ok' if ok else 'FAIL'}")
            print(lines[-1], flush=True)
    finally:
        chunked_loss.LOSS_CHUNK = chunk
    return failures


def check_decoding(lines, device, gen, smoke):
    """The decode step, the fused decoding kernels and the whole model decoding: rows appended to lines; returns
    the number of failures."""
    f32, bf16 = torch.float32, torch.bfloat16
    wide, unit = (1e-2, 1e2), (1.0, 1.0)
    failures = 0
    lines += ["", "decode step (kla_step) vs the recurrent reference, float32:", ""]
    for B, kacz, knorm in [(1, True, wide), (32, True, wide), (4, False, unit)]:
        errs, finite = check_step(B, 16 if not smoke else 2, 128 if not smoke else 32, 128 if not smoke else 32,
                                  kacz, knorm, device, gen)
        ok = finite and all(e < 1e-4 for e in errs.values())
        failures += not ok
        lines.append(f"step B={B} kaczmarz={kacz}: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
                     + f" {'ok' if ok else 'FAIL'}")
        print(lines[-1], flush=True)
    lines += ["", "the fused decoding kernels (kernel_decode.py) in a one-layer model (6 heads, d_k 96, d_v 192) vs "
              "float64, one token:", ""]
    for B, dtype, mixer, autocast in ([(1, f32, "kla", False), (2, f32, "kla", False)] if smoke else
                                      [(1, bf16, "kla", False), (1, f32, "kla", False), (1, bf16, "gdn", False),
                                       (64, bf16, "kla", False), (2, f32, "kla", False), (4, bf16, "gdn", False),
                                       (1, bf16, "kla", True)]):
        errs = check_decode(device, B, dtype, mixer, autocast=autocast,
                            **(dict(width=96, heads=2, prompt=70) if smoke else {}))
        ok = all(e < TOL[dtype] for e in errs.values())
        failures += not ok
        path = "kla_decode_mixer" if B > 1 or autocast else "three kernels a block"
        lines.append(f"decode B={B} {str(dtype)[6:]}{' autocast' if autocast else ''} {mixer} ({path}): "
                     + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()) + f" {'ok' if ok else 'FAIL'}")
        print(lines[-1], flush=True)
    lines += ["", "the whole model decoding (KLA, float32, 2 layers, batch 2 and 1, 160-token prompt, 24 greedy tokens)"
              " against the float64 chunkwise path's full forward; and the share of tokens that differ from plain"
              " step-by-step decoding:", ""]
    for fused, compiled, batch in (((True, False, 2), (True, False, 1)) if smoke else
                                   ((True, False, 1), (True, True, 1), (True, False, 2), (False, False, 2),
                                    (True, True, 2))):
        errs = check_model_decode(device, compiled, fused, batch)
        ok = errs["logits"] < TOL[torch.float32] and errs["tokens_vs_plain"] == 0
        failures += not ok
        lines.append(f"{'CUDA graph' if device == 'cuda' else 'in-place step'}{', compiled' if compiled else ''}"
                     f"{', fused decoding kernel' if fused else ', layer code + step kernel'}, batch {batch}: "
                     f"logits {errs['logits']:.1e}, tokens differing {errs['tokens_vs_plain']:.2f} {'ok' if ok else 'FAIL'}")
        print(lines[-1], flush=True)
    new_tokens = 8 if smoke else 256
    lines += ["", f"greedy decoding of {new_tokens} tokens, sample.py's path on this device (fused decoding kernels, CUDA "
              "graph) against the model's plain PyTorch path, float32, the same weights (2 layers, 100-token prompt); "
              "the last token's logits over prompt + tokens:", ""]
    for mixer, batch in (("kla", 1), ("kla", 2), ("attn,kla", 1)) if smoke else (
            ("kla", 1), ("kla", 64), ("gdn", 1), ("gdn", 64), ("attn,kla", 1), ("attn,kla", 64)):
        differ, err = check_greedy(device, mixer, batch, new_tokens)
        ok = differ == 0 and err < TOL[torch.float32]
        failures += not ok
        lines.append(f"{mixer}, batch {batch}: tokens differing {differ:.4f}, logits {err:.1e} {'ok' if ok else 'FAIL'}")
        print(lines[-1], flush=True)
    return failures


def main():
    out = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--out=")), os.environ.get("OUT"))
    smoke = "--smoke" in sys.argv
    device = "cpu" if smoke else "cuda"
    f32, bf16 = torch.float32, torch.bfloat16
    wide, unit = (1e-2, 1e2), (1.0, 1.0)
    if smoke:
        cases = [(1, 1, 1, 32, 32, f32, True, True, wide, {}), (1, 70, 2, 32, 16, f32, False, True, wide, {}),
                 (1, 70, 2, 32, 16, f32, True, True, wide, dict(eps=0.0, edge=True, decay="weak")),
                 (1, 70, 2, 32, 16, f32, True, True, wide, dict(decay="cut")),
                 (1, 70, 2, 32, 16, f32, True, True, wide, dict(seqs=[1, 2, 4, 63])),
                 (1, 150, 2, 32, 16, f32, False, True, wide, dict(seqs=6))]
    else:  # (B, T, H, K, V, dtype, initial state, kaczmarz, key norms)
        cases = [  # most important first: a timeout still leaves the earlier rows in the table
            (2, 1000, 4, 128, 128, bf16, True, True, wide),
            (2, 1, 4, 128, 128, bf16, True, True, wide),
            (1, 65536, 2, 128, 128, bf16, True, True, wide),
            (2, 1000, 4, 128, 128, f32, True, True, wide),
            (2, 1, 4, 128, 128, f32, True, True, wide),
            (2, 2048, 8, 64, 64, bf16, False, True, (0.3, 3.0)),
            (1, 4096, 16, 128, 128, bf16, False, True, (0.3, 3.0)),
            (2, 1000, 4, 128, 128, bf16, False, True, wide),
            (2, 1, 4, 64, 64, bf16, False, True, wide),
            (2, 1000, 4, 64, 64, bf16, True, True, wide),
            (1, 1000, 3, 48, 96, bf16, True, True, wide),
            (1, 1000, 4, 32, 256, bf16, True, True, wide),
            (2, 1000, 4, 128, 128, bf16, True, False, unit),
            (1, 300, 3, 48, 96, f32, True, True, wide),
            (2, 500, 2, 128, 128, f32, True, False, unit),
            # robustness: long sequences with strong / weak / no decay, extreme key norms, eps = 0
            (1, 131072, 2, 128, 128, bf16, True, True, wide, dict(decay="strong", grad=False)),
            (1, 131072, 2, 128, 128, bf16, True, True, wide, dict(decay="weak", grad=False)),
            (1, 65536, 2, 128, 128, bf16, True, True, wide, dict(decay="strong")),
            (1, 65536, 2, 128, 128, bf16, True, True, wide, dict(decay="weak")),
            (1, 65536, 2, 128, 128, bf16, True, True, wide, dict(decay="none")),
            (2, 1000, 4, 128, 128, bf16, True, True, (1e-4, 1e4), {}),
            (2, 1000, 4, 64, 64, bf16, True, True, (1e-4, 1e-2), {}),
            (2, 1000, 4, 64, 64, bf16, True, True, (1e2, 1e4), {}),
            (2, 1000, 4, 128, 128, bf16, True, True, wide, dict(eps=0.0, edge=True)),
            (2, 1000, 4, 128, 128, f32, True, True, wide, dict(eps=0.0, edge=True)),
            # full forgetting (g = -inf) and strongly negative gates beside weak ones
            (2, 1000, 4, 128, 128, bf16, True, True, wide, dict(decay="cut")),
            (2, 1000, 4, 128, 128, f32, True, True, wide, dict(decay="cut")),
            (2, 1000, 4, 128, 128, bf16, True, True, wide, dict(decay="alternating")),
            (2, 1000, 4, 128, 128, f32, True, True, wide, dict(decay="alternating")),
            # packed sequences (cu_seqlens): a sequence of length 1, several in one chunk, 200 in one call
            (1, 1000, 4, 128, 128, bf16, True, True, wide, dict(seqs=[1, 63, 64, 65, 130, 7, 3, 5, 2, 660])),
            (1, 20000, 4, 128, 128, bf16, True, True, wide, dict(seqs=200)),
            (1, 20000, 4, 128, 128, f32, True, True, wide, dict(seqs=200)),
            (1, 20000, 4, 128, 128, bf16, False, True, wide, dict(seqs=200, grad=False)),
            (1, 5000, 4, 64, 64, bf16, True, False, unit, dict(seqs=50)),
            (1, 5000, 4, 128, 128, bf16, True, True, wide, dict(seqs=50, decay="cut")),
            # the model's own heads (GPT-2 small's KLA: d_k 96, d_v 192)
            (4, 2048, 6, 96, 192, bf16, True, True, wide),
            (1, 1000, 6, 96, 192, f32, True, True, wide),
            # enough programs for the forward's many-program configuration (64 value columns) at K = V = 128
            (8, 2000, 16, 128, 128, bf16, True, True, wide),
            # few programs at 32 value columns (12 heads of d_v 192: 144 programs at 16 would take two waves)
            (2, 2000, 6, 96, 192, bf16, True, True, wide),
            # many programs at K = V = 64 (the forward's 64 value columns and 3 stages)
            (16, 1000, 8, 64, 64, bf16, True, True, wide),
            # no gradient (prefill): the output inside the sequential forward, no states saved, with few programs
            # (16 heads at batch 1: 128 programs of 16 value columns) and with many
            (1, 4096, 16, 128, 128, bf16, True, True, wide, dict(grad=False)),
            (8, 2000, 16, 128, 128, bf16, True, True, wide, dict(grad=False)),
        ]
        cases = [c if len(c) == 10 else c + ({},) for c in cases]
    pick = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--cases=")), None)
    if pick is not None and not all(i.isdigit() and int(i) < len(cases) for i in pick.split(",")):
        sys.exit(f"error: --cases={pick}: must be case indices 0..{len(cases) - 1} separated by commas"
                 + (" (--smoke has its own, tiny cases)" if smoke else ""))
    paths = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--paths=")), "default").split(",")
    if not all(p in ("default", "alt") for p in paths):
        sys.exit(f"error: --paths={','.join(paths)}: must be 'default', 'alt' or both, separated by commas")
    if not smoke and not torch.cuda.is_available():
        sys.exit("error: test_gpu.py needs a CUDA GPU (--smoke runs it in Triton's interpreter)")
    gen = torch.Generator(device=device).manual_seed(1234)
    if pick:  # --cases=0,3: a subset, by position in the list above
        cases = [cases[int(i)] for i in pick.split(",")]
    model_only = "--model" in sys.argv  # the fused loss and the decoding checks alone
    decoding_only = "--decoding" in sys.argv  # the decoding checks alone
    if model_only or decoding_only:
        cases = []
    varlen_only = "--varlen" in sys.argv
    if varlen_only:
        cases = [c for c in cases if "seqs" in c[9]]
    cols = ["o", "ht", "dq", "dk", "dv", "dg", "deta", "dh0"]
    lines = ["| B | T | H | K | V | dtype | h0 | kaczmarz | key norms | other | " + " | ".join(cols) + " | ok |",
             "|" + "---|" * (11 + len(cols))] if cases else []
    failures = 0
    config = dict(kernel.CONFIGS)
    for path, (B, T, H, K, V, dtype, h0, kacz, knorm, opts) in [(p, c) for c in cases for p in paths]:
        t = time.time()
        if path == "alt":
            kernel.CONFIGS.update({key: dict(FUSE_O=not row["FUSE_O"]) for key, row in config.items()
                                   if key[0] == "fuse_o"})
        try:
            errs, finite = check_chunk(B, T, H, K, V, dtype, h0, kacz, knorm, device, gen, **opts)
        except Exception as err:  # report and go on with the other cases
            print(f"case {(B, T, H, K, V, dtype, h0, kacz)} raised {type(err).__name__}: {str(err)[:300]}")
            errs, finite = {}, False
        finally:
            kernel.CONFIGS.update(config)
        opts = dict(opts, path=path) if path != "default" else opts
        tol = TOL[dtype]
        ok = finite and all(e < tol for e in errs.values())
        failures += not ok
        cells = [f"{errs[c]:.1e}" if c in errs else "-" for c in cols]
        over = ", ".join(f"{n} {e:.4e}" for n, e in errs.items() if not e < tol)  # to more digits than the cells
        other = ", ".join(f"{n}={x}" for n, x in opts.items()) or "-"
        lines.append(f"| {B} | {T} | {H} | {K} | {V} | {str(dtype)[6:]} | {h0} | {kacz} | {knorm[0]:g}..{knorm[1]:g} | {other} | "
                     + " | ".join(cells) + f" | {'yes' if ok else ('NO ' + over).strip()} |")
        print(lines[-1], f"({time.time() - t:.1f}s)", flush=True)
        write(out, lines)
    if "--large" in sys.argv and not smoke:
        errs, finite = check_large(device, gen)
        ok = finite and all(e < 1e-3 for e in errs.values())
        failures += not ok
        lines += ["", "past 2**31 elements, (1, 2**21, 8, 128) bf16, last head vs the same head alone: "
                  + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()) + f" {'ok' if ok else 'FAIL'}"]
        print(lines[-1], flush=True)
    kernels_only = "--kernels" in sys.argv  # the chunk cases alone
    if not kernels_only and not model_only and not decoding_only:
        failures += check_documents(lines, device, smoke)
    if not kernels_only and not decoding_only:
        failures += check_fused_loss(lines, device, smoke)
    if not varlen_only and not kernels_only:
        failures += check_decoding(lines, device, gen, smoke)
    dev = "CPU (interpreter)" if smoke else torch.cuda.get_device_name()
    import triton
    lines.insert(0, f"test_gpu.py on {dev}, torch {torch.__version__}, triton {triton.__version__}: "
                    f"{'all passed' if not failures else f'{failures} FAILED'}\n")
    text = "\n".join(lines)
    print("\n" + text)
    write(out, [text])
    sys.exit(1 if failures else 0)


def write(out, lines):
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "test_gpu.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
