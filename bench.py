"""
Benchmarks on one GPU: python bench.py [--section=kernel,decode,profile] [--out=DIR] [--smoke]

Sections (comma-separated; default kernel,decode):
  kernel  kernel.kla_chunk against the same KLA layer through fla-core 0.6.0's and FlashQLA 0.1.3's
          chunk_gated_delta_rule (beta = eta / (||k||^2 + eps) computed in PyTorch, use_qk_l2norm_in_kernel=False)
          and FlashQLA's own GDN, bf16, forward and forward + backward, triton.testing.do_bench medians in the
          same run; peak memory of one call. FlashQLA runs where it imports and K = V = 128. --rows=5b,1f picks
          rows (a shape's index, then f: forward, b: forward + backward) and runs them in that order.
  varlen  kla_chunk on 64 packed documents (cu_seqlens) summing to 32768 tokens against the same tokens as one
          sequence, forward and forward + backward, and fla's and FlashQLA's varlen chunk_gated_delta_rule
          (beta in PyTorch) on the same cu_seqlens.
  decode  kernel.kla_step against fla's fused_recurrent_gated_delta_rule, one token, H = 16, D = 128, fp32 state.
  profile time per kernel.py kernel in one forward + backward (torch.profiler).
  train   the whole model (12 x 768, GPT-2 small's size) with mixer kla, gdn and attn, and kla with recompute=True
          (--mixers=attn,kla,gdn,kla:recompute; also kla:recompute_elementwise, kla:fused_loss, the model's
          switches), eager and compiled (--compile=0,1; --lengths=2048 picks lengths): a
          training step at
          T = 2048, 8192, 32768 with the same tokens per step; tokens/s, the ratio to attention, MFU, memory;
          and fla's GatedDeltaNet LM of this width in two head shapes (V 256: fla's kernels; V 128: FlashQLA's),
          eager and compiled (--fla_compile=0,1; by default as --compile), when flash-linear-attention imports
          (--fla_lm=0: not; --fla_v=128: the V 128 model alone).
  train_profile  where one training step's GPU time goes (kernel groups, largest kernels; --mixers=kla,attn).
  prefill  batch-1 forward over 4K to 128K tokens (--lengths), KLA against attention: latency and peak memory;
          KLA also in segments of PREFILL_SEGMENT (engine.py; plain, and from Engine.prefill's CUDA graph of a segment);
          --compile_infer=0,1,graphs: eager, compiled, compiled and replayed from CUDA graphs; --mixers=kla,gdn:
          one pass of these mixers only.
  prefill_profile  where a batch-1 prefill's GPU time goes (--lengths=131072, --mixers=kla,attn).
  decode_profile  where one decoding step's GPU time goes (KLA, --batch=1,64).
  generate decoding tokens/s after prompts of 1K, 8K and 32K at batch 1 and 64, KLA against attention
          (--lengths=1024 and --batch=1 pick prompts and batches)
  headline the README's numbers in one process: kernel's rows against fla and FlashQLA, train's compiled attn / kla
          at 2048 and 8192, prefill's one pass at 4K / 8K / 128K, generate's KLA after 1K tokens at batch 1 and 64
          against the floor; written to results/bench_<gpu>/headline.md with the git commit (outside a git checkout:
          $KLA_COMMIT). FlashQLA's TileLang compiles each new shape first, minutes each on a fresh machine.
--fuse_o=0 / 1 forces the kernel's forward to add the state's share of the output after the sequential pass /
inside it (kernel.CONFIGS's "fuse_o"), for any section. --decode_fused=0 decodes through the layer's PyTorch code.
--pdl=0 launches batch-1 decoding's kernels without programmatic dependent launch (kernel_decode.DECODE_PDL).
An argument other than --smoke and these --KEY=VALUE (FLAGS) is refused in one line before any work, a typo too.
Each section returns (title, header, rows) for one printed table, all also written to DIR/bench.md
(DIR defaults to $OUT). A whole-model section is a function of the same shape added to SECTIONS.
fla raises in its gated backward on Hopper with Triton 3.4 to 3.7.0 (fla #640); for timing only, its guard is
switched off (fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True): its gradients are wrong there, its time is not.
"""

import json
import os
import sys

os.environ.setdefault("FLA_FLASH_QLA", "0")  # time fla's own Triton kernels, not a dispatch to FlashQLA
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import time

import torch
import torch._functorch.config
import triton

import kernel
import kernel_decode
from engine import PREFILL_SEGMENT, Engine
from model import GPT, GPTConfig

EPS = 1e-6
MODEL_HEADS = (32, 2048, 6, 96, 192)  # (B, T, H, K, V): GPT-2 small's KLA heads, 32 x 2048 tokens a step


def load_fla():
    """fla's chunk and one-token kernels, or (None, None): without a GPU as when it is not installed (its autotuner
    needs CUDA, so on the CPU its columns stay empty either way)."""
    if not torch.cuda.is_available():
        print("fla not used without a CUDA GPU: its columns are left empty")
        return None, None
    try:
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError as err:
        print(f"fla not importable ({err}): its columns are left empty")
        return None, None
    if hasattr(chunk_o, "TRITON_ABOVE_3_7_1"):
        chunk_o.TRITON_ABOVE_3_7_1 = True  # timing only (see the docstring)
    else:
        print("fla.ops.common.chunk_o has no TRITON_ABOVE_3_7_1: its backward guard is left as it is")
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def load_flash_qla():
    """FlashQLA's chunk_gated_delta_rule (Qwen's TileLang kernels; Hopper, K = V = 128), or None (also without a GPU)."""
    if not torch.cuda.is_available():
        print("flash_qla not used without a CUDA GPU: its columns are left empty")
        return None
    try:
        from flash_qla import chunk_gated_delta_rule
    except Exception as err:  # ImportError, or its TileLang / CUDA setup failing
        print(f"flash_qla not importable ({type(err).__name__}: {err}): its columns are left empty")
        return None
    return chunk_gated_delta_rule


def inputs(B, T, H, K, device, requires_grad=False, V=None):
    """bf16 q (unit), raw k (SiLU of a normal, as after KLA's short convolution), v; fp32 g <= 0 and eta."""
    V = V or K
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device), dim=-1).bfloat16()
    k = torch.nn.functional.silu(torch.randn(B, T, H, K, device=device)).bfloat16()
    v = torch.randn(B, T, H, V, device=device).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=device) + 3)
    eta = torch.sigmoid(torch.randn(B, T, H, device=device))
    xs = [q, k, v, g, eta]
    return [x.requires_grad_(requires_grad) for x in xs]


def ours_chunk(q, k, v, g, eta):
    return kernel.kla_chunk(q, k, v, g, eta, eps=EPS)[0]


def kla_through(chunk, **kw):
    """KLA through a GDN kernel with fla's signature: beta = eta / (||k||^2 + eps) computed in PyTorch."""
    def run(q, k, v, g, eta):
        beta = eta / (k.float().pow(2).sum(-1) + EPS)
        return chunk(q, k, v, g, beta, use_qk_l2norm_in_kernel=False, **kw)[0]
    return run


def gdn_through(chunk):
    """The kernel's own GDN: q and k L2-normalised inside it, beta = eta."""
    def run(q, k, v, g, eta):
        return chunk(q, k, v, g, eta, use_qk_l2norm_in_kernel=True)[0]
    return run


def timed(fn, xs, backward, device):
    """(median ms, peak MiB above what was allocated before the call)."""
    if backward:
        do = torch.randn_like(fn(*xs))

        def step():
            fn(*xs).backward(do)
    else:
        def step():
            with torch.no_grad():
                fn(*xs)
    step()
    if device != "cuda":
        return float("nan"), float("nan")
    for x in xs:
        x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = triton.testing.do_bench(step, warmup=50, rep=200, grad_to_none=xs if backward else None,
                                 return_mode="median")
    return ms, peak


def section_kernel(device, smoke):
    """kla_chunk against the same KLA layer through fla's and FlashQLA's GDN kernels (beta in PyTorch), and
    FlashQLA's own GDN; FlashQLA only where it runs (K = V = 128). The last shape is the model's own heads
    (GPT-2 small: 6 heads, d_k 96, d_v 192, 32 x 2048 tokens a step)."""
    shapes = [(16, 2048, 8, 64, 64, True), (8, 4096, 16, 128, 128, True), (4, 8192, 16, 128, 128, True),
              (1, 32768, 16, 128, 128, True), (1, 131072, 16, 128, 128, False), MODEL_HEADS + (True,)]
    if smoke:
        shapes = [(1, 100, 2, 32, 32, True)]
    nan = (float("nan"), float("nan"))
    rows = []
    runs = [(i, bwd) for i, shape in enumerate(shapes) for bwd in ([False, True] if shape[-1] else [False])]
    if ARGS.get("rows"):  # e.g. --rows=5b,2,0f: shape index, then f (forward only) or b (fwd+bwd only), in that order
        named = {p: [r for r in runs if p in (str(r[0]), f"{r[0]}{'bf'[not r[1]]}")] for p in ARGS["rows"].split(",")}
        for p, picked in named.items():
            if not picked:
                sys.exit(f"error: --rows={ARGS['rows']}: '{p}' names no row; give a shape index 0..{len(shapes) - 1}"
                         f", alone or followed by f (forward) or b (forward + backward)")
        runs = [r for picked in named.values() for r in picked]
    fla_chunk, _ = load_fla()
    qla_chunk = load_flash_qla()
    for i, backward in runs:
        B, T, H, K, V, _ = shapes[i]
        xs = inputs(B, T, H, K, device, requires_grad=backward, V=V)
        ours = timed(ours_chunk, xs, backward, device)
        fla = timed(kla_through(fla_chunk), xs, backward, device) if fla_chunk else nan
        qla_ok = qla_chunk is not None and K == V == 128
        qla = timed(kla_through(qla_chunk), xs, backward, device) if qla_ok else nan
        qla_gdn = timed(gdn_through(qla_chunk), xs, backward, device) if qla_ok else nan
        rows.append([f"({B}, {T}, {H}, {K}, {V})", "fwd+bwd" if backward else "fwd", ours[0], fla[0], qla[0],
                     qla_gdn[0], ours[0] / fla[0], ours[0] / qla[0], ours[0] / qla_gdn[0], ours[1], fla[1],
                     qla[1]])
        print(rows[-1], flush=True)
        del xs
        if device == "cuda":
            torch.cuda.empty_cache()
    head = ["shape (B, T, H, K, V)", "pass", "ours ms", "fla KLA ms", "FlashQLA KLA ms", "FlashQLA GDN ms",
            "ours / fla", "ours / FlashQLA KLA", "ours / FlashQLA GDN", "ours peak MiB", "fla peak MiB",
            "FlashQLA peak MiB"]
    return ("chunk kernel, bf16, do_bench medians (fla / FlashQLA KLA: their chunk_gated_delta_rule with beta in "
            "PyTorch; FlashQLA GDN: q, k L2-normalised in its kernel; nan: not run)"), head, rows


def section_varlen(device, smoke):
    """Packed documents: kla_chunk on 64 documents of random lengths (fixed seed) summing to 32768 tokens
    (cu_seqlens) against the same tokens as one sequence, and fla's and FlashQLA's chunk_gated_delta_rule on the
    same cu_seqlens (beta in PyTorch); bf16, H = 16, K = V = 128."""
    fla_chunk, _ = load_fla()
    qla_chunk = load_flash_qla()
    T, N, H, D = (130, 4, 1, 16) if smoke else (32768, 64, 16, 128)
    cuts = torch.randperm(T - 1, generator=torch.Generator().manual_seed(0))[:N - 1].sort().values + 1
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([T])]).to(device)  # int64, as fla's signature
    nan = (float("nan"), float("nan"))

    def timed_or_nan(name, fn, xs, backward):
        try:
            return timed(fn, xs, backward, device)
        except Exception as err:  # a library without varlen support in this version: its column left empty
            print(f"{name} raised {type(err).__name__}: {str(err)[:300]}")
            return nan

    rows = []
    for backward in (False, True):
        xs = inputs(1, T, H, D, device, requires_grad=backward)
        dense = timed(ours_chunk, xs, backward, device)
        ours = timed(lambda *x: kernel.kla_chunk(*x, eps=EPS, cu_seqlens=cu)[0], xs, backward, device)
        fla = timed_or_nan("fla", kla_through(fla_chunk, cu_seqlens=cu), xs, backward) if fla_chunk else nan
        qla = timed_or_nan("FlashQLA", kla_through(qla_chunk, cu_seqlens=cu), xs, backward) if qla_chunk else nan
        rows.append(["fwd+bwd" if backward else "fwd", dense[0], ours[0], ours[0] / dense[0], fla[0], qla[0],
                     ours[0] / fla[0], ours[0] / qla[0], dense[1], ours[1]])
        print(rows[-1], flush=True)
        del xs
    head = ["pass", "ours 1 sequence ms", "ours packed ms", "packed / 1 sequence", "fla packed ms",
            "FlashQLA packed ms", "ours / fla", "ours / FlashQLA", "ours 1 sequence peak MiB", "ours packed peak MiB"]
    lens = (cu[1:] - cu[:-1]).tolist()
    return (f"packed documents (cu_seqlens), bf16, {N} documents of {min(lens)} to {max(lens)} tokens, {T} in all, "
            f"H = {H}, K = V = {D}, against the same tokens as one sequence (B = 1); fla / FlashQLA: their "
            "chunk_gated_delta_rule with beta in PyTorch on the same cu_seqlens; do_bench medians, nan: not run"), \
        head, rows


def section_decode(device, smoke):
    _, fla_step = load_fla()
    H, D = (2, 32) if smoke else (16, 128)
    rows = []
    for B in (1, 32):
        q, k, v, g, eta = inputs(B, 1, H, D, device)
        state = torch.randn(B, H, D, D, device=device)
        beta = eta / (k.float().pow(2).sum(-1) + EPS)

        def ours():
            return kernel.kla_step(q, k, v, g, eta, state, eps=EPS)

        def fla():
            return fla_step(q, k, v, g, beta, initial_state=state, output_final_state=True)
        ours()
        if device != "cuda":
            rows.append([B] + [float("nan")] * 4)
            continue
        ours_us = triton.testing.do_bench(ours, warmup=50, rep=200, return_mode="median") * 1e3
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ours()
        graph_us = triton.testing.do_bench(graph.replay, warmup=50, rep=200, return_mode="median") * 1e3
        fla_us = float("nan")
        if fla_step:
            fla()
            fla_us = triton.testing.do_bench(fla, warmup=50, rep=200, return_mode="median") * 1e3
        rows.append([B, ours_us, graph_us, fla_us, ours_us / fla_us])
        print(rows[-1], flush=True)
    head = ["batch", "ours us", "ours in a CUDA graph us", "fla fused_recurrent us", "ours / fla"]
    return f"decode step, H = {H}, D = {D}, bf16 q/k/v, fp32 state (fla given beta precomputed)", head, rows


def section_profile(device, smoke):
    """Time per kernel of one forward + backward (torch.profiler, CUDA time summed over 5 calls)."""
    shapes = [(1, 100, 2, 32)] if smoke else [(8, 4096, 16, 128), (1, 32768, 16, 128), (16, 2048, 8, 64), MODEL_HEADS]
    rows = []
    for B, T, H, D, *V in shapes:
        xs = inputs(B, T, H, D, device, True, V=V[0] if V else None)
        do = torch.randn_like(xs[2])
        ours_chunk(*xs).backward(do)
        acts = [torch.profiler.ProfilerActivity.CPU]
        acts += [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else []
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(5):
                for x in xs:  # no gradient accumulation (elementwise adds) in the profile
                    x.grad = None
                ours_chunk(*xs).backward(do)
            if device == "cuda":
                torch.cuda.synchronize()
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
            if us > 0 and "_kernel" in ev.key:
                rows.append([str((B, T, H, D, *V)), ev.key, us / 5 / 1e3])
    return "time per kernel in one fwd+bwd (ms)", ["shape", "kernel", "ms"], rows


# -----------------------------------------------------------------------------
# The whole model: a GPT-2-small-sized LM with each mixer, the same tokens per step


def model_configs(smoke):
    """(GPTConfig kwargs, [(batch, T)] with equal tokens per step; --lengths=2048,8192 picks some)."""
    if smoke:
        cfg, shapes = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=256, chunk_size=16), [(4, 64), (2, 128)]
    else:
        cfg, shapes = dict(n_layer=12, n_head=6, n_embd=768, vocab_size=50304), [(32, 2048), (8, 8192), (2, 32768)]
    pick = ARGS.get("lengths")
    return cfg, [s for s in shapes if not pick or str(s[1]) in pick.split(",")]


def train_model(mixer, block_size, device, compiled=False, smoke=None):
    """mixer: 'kla', 'gdn', 'attn', then ':'-separated GPT switches set True (':recompute',
    ':recompute_elementwise', ':fused_loss') and last ':budget=F' (compiled with
    torch._functorch.config.activation_memory_budget = F: the partitioner recomputes to keep that share of the
    activations; set by section_train before the first step, which compiles)."""
    cfg, _ = model_configs(smoke if smoke is not None else device != "cuda")
    mixer, *how = mixer.split(":")
    switches = {s: True for s in how if not s.startswith("budget=")}
    model = GPT(GPTConfig(block_size=block_size, mixer=mixer, **cfg), **switches).to(device)
    model.set_backend(device)
    opt = model.configure_optimizers(0.1, 3e-4, (0.9, 0.95), device)
    if compiled:  # in place: model stays the GPT, with get_num_params and flops_per_token. Static shapes,
        # compiled again for each length: torch 2.11's dynamic-shape backward asserted a wrong stride on a
        # view saved for the backward
        model.compile(dynamic=False)
    return model, opt


def train_step_fn(model, opt, batch, T, device):
    idx = torch.randint(model.config.vocab_size, (batch, T + 1), device=device)
    ctx = torch.autocast(device, dtype=torch.bfloat16) if device == "cuda" else torch.autocast(device, enabled=False)

    def step():
        with ctx:
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def median_ms(step, device, warmup=2, reps=5):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def section_train(device, smoke):
    """Training throughput (forward, backward, AdamW step; bf16 autocast on CUDA) of each mixer, eager and
    torch.compile'd (--compile=0,1; compiled for each length: 'first step s' is that compilation)."""
    _, shapes = model_configs(smoke)
    peak = 989e12  # H100 / H200 dense bf16
    rows, base, fla = [], {}, []
    compiled_modes = [bool(int(c)) for c in ARGS.get("compile", "0,1").split(",")]
    if device == "cuda" and ARGS.get("fla_lm", "1") == "1":  # the library users would pick
        try:  # first, so that a time limit on the whole section cannot leave it out
            fla_modes = [bool(int(c)) for c in ARGS.get("fla_compile", ARGS.get("compile", "0,1")).split(",")]
            fla = fla_lm_rows(shapes, device, fla_modes)
        except Exception as err:  # fla's model failing must not stop ours
            print(f"fla LM: {type(err).__name__}: {str(err)[:300]}", flush=True)
    for compiled in compiled_modes:
        for mixer in ARGS.get("mixers", "attn,kla,gdn,kla:recompute").split(","):  # attention first: the ratios' base
            model = opt = None
            for batch, T in shapes:
                if device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                if model is None:
                    model, opt = train_model(mixer, max(T for _, T in shapes), device, compiled)
                step = train_step_fn(model, opt, batch, T, device)
                budget = float(mixer.partition(":budget=")[2] or 1.0)
                if budget != torch._functorch.config.activation_memory_budget:
                    torch._dynamo.reset()  # compiled code is not recompiled when only this setting changes
                    torch._functorch.config.activation_memory_budget = budget
                t0 = time.perf_counter()
                try:
                    step()  # compiles
                    first = time.perf_counter() - t0
                    ms = median_ms(step, device)
                except torch.OutOfMemoryError:
                    rows.append([mixer, "compiled" if compiled else "eager", T, batch] + ["OOM"] * 7)
                    print(rows[-1], flush=True)
                    continue
                tok_s = batch * T / ms * 1e3
                if mixer.split(":")[0] == "attn":  # the first attention row of each length and mode
                    base.setdefault((T, compiled), tok_s)
                mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
                mfu = model.flops_per_token(T) * tok_s / peak if device == "cuda" else float("nan")
                rows.append([mixer, "compiled" if compiled else "eager", T, batch, model.get_num_params() / 1e6,
                             ms, tok_s, tok_s / base.get((T, compiled), float("nan")), mfu, mem, first])
                print(rows[-1], flush=True)
            del model, opt, step
    for r in fla:  # its ratio to attention in the same mode
        ref = base.get((r[2], r[1] == "compiled"))
        if isinstance(r[6], float) and ref:
            r[7] = r[6] / ref
    rows += fla
    head = ["mixer", "mode", "T", "batch", "params M", "ms / step", "tokens/s", "vs attn", "MFU", "peak GiB",
            "first step s"]
    return "training step of the whole model, bf16 autocast, median of 5 after 2 warm-up steps", head, rows


def fla_lm_rows(shapes, device, compiled_modes):
    """fla's GatedDeltaNetForCausalLM at this width (hidden 768, 12 layers, 6 heads, vocabulary 50304 tied),
    AdamW, bf16 autocast, timed like ours, with fla's default dispatch: heads of K 128, V 256 (KLA.md's anchor,
    expand_v 2) run fla's own Triton kernels; heads of K = V = 128 (expand_v 1) are sent to FlashQLA when it
    imports. Eager and, for each mode in compiled_modes, torch.compile'd (a row says what failed). Its backward
    guard (fla #640) is switched off by load_fla (timing only). 'vs attn' is filled in by section_train."""
    if load_fla()[0] is None:
        return []
    try:
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    except ImportError as err:
        print(f"fla.models not importable ({err}): no fla LM rows")
        return []
    dispatch = os.environ.get("FLA_FLASH_QLA")
    os.environ.pop("FLA_FLASH_QLA", None)  # fla's default: FlashQLA where it can serve the call
    rows = []
    try:
        heads = ((2, "fla GatedDeltaNet, V 256"), (1, "fla GatedDeltaNet, V 128 (FlashQLA)"))
        picked = ARGS.get("fla_v", "256,128").split(",")  # --fla_v=128: the FlashQLA-served model alone
        for expand_v, label in [h for h in heads if str(128 * h[0]) in picked]:
            for compiled in compiled_modes:
                cfg = GatedDeltaNetConfig(hidden_size=768, num_hidden_layers=12, num_heads=6, head_dim=128,
                                          expand_v=expand_v, vocab_size=50304, tie_word_embeddings=True)
                model = GatedDeltaNetForCausalLM(cfg).to(device)
                n_params = sum(p.numel() for p in model.parameters()) / 1e6
                opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
                fwd = torch.compile(model) if compiled else model
                mode = "compiled" if compiled else "eager"
                for batch, T in shapes:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    idx = torch.randint(50304, (batch, T), device=device)

                    def step():
                        with torch.autocast(device, dtype=torch.bfloat16):
                            loss = fwd(input_ids=idx, labels=idx).loss
                        loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    t0 = time.perf_counter()
                    try:
                        step()
                        first = time.perf_counter() - t0
                        ms = median_ms(step, device)
                    except Exception as err:  # OOM, a compile failure or an fla error: report it and go on
                        print(f"{label} {mode} at T {T}: {type(err).__name__}: {str(err)[:300]}", flush=True)
                        rows.append([label, mode, T, batch, n_params] + [type(err).__name__] * 6)
                        continue
                    tok_s = batch * T / ms * 1e3
                    rows.append([label, mode, T, batch, n_params, ms, tok_s, float("nan"), float("nan"),
                                 torch.cuda.max_memory_allocated() / 2**30, first])
                    print(rows[-1], flush=True)
                del model, opt, fwd
    finally:
        if dispatch is not None:
            os.environ["FLA_FLASH_QLA"] = dispatch
    return rows


def kernel_group(name):
    """A GPU kernel's name -> what it does, for the training profile."""
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n:  # first: flash_fwd_kernel is not one of ours
        return "attention (SDPA)"
    if name in ("_prep_kernel", "_fwd_pre_kernel", "_fwd_kernel", "_fwd_o_kernel"):
        return "kernel.py forward"
    if name.startswith("_bwd_") and name.endswith("_kernel"):
        return "kernel.py backward"
    if name in ("_step_kernel", "_decode_mixer_kernel", "_decode_linear_kernel", "_decode_in_proj_kernel",
                "_decode_state_kernel", "_decode_mlp_kernel"):
        return "kernel.py / kernel_decode.py decoding"
    if any(k in n for k in ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "cublas", "splitk")):
        return "matmul (cuBLAS)"
    if n.startswith("triton_") or "triton" in n:
        return "fused elementwise / reductions (torch.compile)"
    if "adam" in n or "foreach" in n or "multi_tensor" in n:
        return "optimizer"
    return "other"


def gpu_time_rows(label, fn, device):
    """Rows [label, kernel or group, calls, ms, share] of the GPU time of one call of fn (torch.profiler,
    kernel events only): the total, per group of kernels (kernel_group), and the 12 largest kernels."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    if device == "cuda":
        evs = [ev for ev in prof.key_averages() if ev.device_type == torch.autograd.DeviceType.CUDA]
        key = "device_time_total" if hasattr(evs[0] if evs else None, "device_time_total") else "cuda_time_total"
    else:
        evs, key = list(prof.key_averages()), "cpu_time_total"
    times = [(ev.key, ev.count, (getattr(ev, key, 0) or 0) / 1e3) for ev in evs]
    total = sum(t for _, _, t in times) or float("nan")
    groups = {}
    for name, _, t in times:
        groups[kernel_group(name)] = groups.get(kernel_group(name), 0.0) + t
    rows = [[label, "all GPU kernels", sum(c for _, c, _ in times), total, 1.0]]
    rows += [[label, f"group: {g}", "", t, t / total] for g, t in sorted(groups.items(), key=lambda x: -x[1])]
    rows += [[label, name[:80], count, t, t / total] for name, count, t in sorted(times, key=lambda x: -x[2])[:12]]
    for r in rows:
        print(r, flush=True)
    return rows


def section_train_profile(device, smoke):
    """Where a training step at the first length spends its GPU time, per group of kernels and the largest
    kernels, for each of --mixers (default kla,attn), compiled unless --compile=0."""
    _, shapes = model_configs(smoke)
    batch, T = shapes[0]
    compiled = ARGS.get("compile", "1") == "1" and device == "cuda"
    rows = []
    for mixer in ARGS.get("mixers", "kla,attn").split(","):
        model, opt = train_model(mixer, T, device, compiled, smoke=smoke)
        step = train_step_fn(model, opt, batch, T, device)
        for _ in range(2):
            step()
        rows += gpu_time_rows(mixer, step, device)
        del model, opt, step
        if device == "cuda":
            torch.cuda.empty_cache()
    return (f"one training step at batch {batch}, T {T}, {'compiled' if compiled else 'eager'}: GPU time by kernel",
            ["mixer", "kernels", "calls", "ms", "share"], rows)


def section_prefill_profile(device, smoke):
    """Where a batch-1 prefill (one pass, no gradient) spends its GPU time, per group of kernels and the
    largest kernels, for each of --mixers (default kla,attn) at --lengths (default 131072), compiled unless
    --compile_infer=0."""
    lengths = [int(t) for t in ARGS.get("lengths", "512" if smoke else "131072").split(",")]
    compiled = ARGS.get("compile_infer", "1") == "1" and device == "cuda"
    rows = []
    for mixer in ARGS.get("mixers", "kla,attn").split(","):
        model, vocab = eval_model(mixer, device, smoke, compiled)
        for T in lengths:
            idx = torch.randint(vocab, (1, T), device=device)
            with torch.no_grad():
                for _ in range(2):
                    model(idx)
                rows += gpu_time_rows(f"{mixer} T={T}", lambda: model(idx), device)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return (f"prefill at batch 1, {'compiled' if compiled else 'eager'}: GPU time by kernel",
            ["mixer", "kernels", "calls", "ms", "share"], rows)


def section_decode_profile(device, smoke):
    """Where one decoding step at batch 1 (and --batch=) spends its GPU time, per group of kernels and the
    largest kernels: the model's in-place step after a 1024-token prompt, run plainly so that the profiler
    sees every kernel (the CUDA graph replays the same kernels without the launch gaps); KLA, compiled unless
    --compile_infer=0, fused decoding kernel unless --decode_fused=0."""
    compiled = ARGS.get("compile_infer", "1") == "1" and device == "cuda"
    rows = []
    for batch in [int(b) for b in ARGS.get("batch", "1").split(",")]:
        model, vocab = eval_model("kla", device, smoke, compiled)
        engine = eval_engine(model, compiled)
        with torch.no_grad():
            cache = model.new_cache()
            engine.prefill(torch.randint(vocab, (batch, 64 if smoke else 1024), device=device), cache, PREFILL_SEGMENT)
            step = engine.decode_step(cache, batch)
            tok = torch.randint(vocab, (batch, 1), device=device)
            for _ in range(3):
                step(tok)
            rows += gpu_time_rows(f"kla batch {batch}", lambda: step(tok), device)
        del model
    return (f"one decoding step, {'compiled' if compiled else 'eager'}, no CUDA graph: GPU time by kernel",
            ["mixer", "kernels", "calls", "ms", "share"], rows)


def eval_model(mixer, device, smoke, compiled=False):
    cfg, _ = model_configs(smoke)
    # --decode_fused=0: decode KLA / GDN through the layer's PyTorch code and the step kernel instead
    model = GPT(GPTConfig(mixer=mixer, **cfg), decode_fused=ARGS.get("decode_fused", "1") == "1").to(device).eval()
    model.set_backend(device)
    if device == "cuda":
        model.bfloat16()
    if compiled == "graphs":  # one CUDA graph a shape: the host's launch work replayed by the GPU
        model.compile(mode="reduce-overhead")
    elif compiled:
        model.compile(dynamic=True)
    return model, cfg["vocab_size"]


def eval_engine(model, compiled=False):
    """The Engine of eval_model's model; compiled (True): its forward, the fused decoding step, compiled as well."""
    engine = Engine(model)
    if compiled is True:
        engine.compile(dynamic=True)
    return engine


def infer_modes():
    """--compile_infer=0,1,graphs: the inference sections eager (0, the default), torch.compile'd (1) and / or
    compiled and replayed from CUDA graphs (graphs: mode='reduce-overhead', a graph a shape; prefill only)."""
    return [c if c == "graphs" else bool(int(c)) for c in ARGS.get("compile_infer", "0").split(",")]


def section_prefill(device, smoke):
    """Batch-1 forward over a long prompt (the logits of the last position), KLA against attention; KLA
    also in segments of PREFILL_SEGMENT tokens with the state carried (memory flat in T)."""
    lengths = [int(t) for t in ARGS.get("lengths", "128,512" if smoke else "4096,8192,16384,65536,131072").split(",")]
    seg = 64 if smoke else PREFILL_SEGMENT
    rows = []
    for compiled in infer_modes():
        label = {False: "", True: " (compiled)", "graphs": " (compiled, CUDA graphs)"}[compiled]
        runs = [("attn", "one pass"), ("kla", "one pass"), ("kla", f"segments of {seg}")]
        if compiled != "graphs":  # Engine.prefill's own CUDA graph of a segment
            runs.append(("kla", f"segments of {seg}, CUDA graph"))
        if ARGS.get("mixers"):  # --mixers=kla,gdn: one pass of each of these only
            runs = [(mixer, "one pass") for mixer in ARGS["mixers"].split(",")]
        for mixer, how in runs:
            model, vocab = eval_model(mixer, device, smoke, compiled)
            graph = how.endswith("CUDA graph")
            engine = Engine(model)
            fn = model if how == "one pass" else (lambda x: engine.prefill(x, model.new_cache(), seg, graph))
            for T in lengths:
                idx = torch.randint(vocab, (1, T), device=device)
                if device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                try:
                    with torch.no_grad():  # CUDA graphs: two runs to warm up, the third records
                        ms = median_ms(lambda x=idx: fn(x), device, warmup=3 if compiled == "graphs" else 1, reps=3)
                except RuntimeError as err:  # reported as nan, the error printed
                    print(f"{mixer}{label} {how} T={T}: {type(err).__name__}: {str(err)[:300]}", flush=True)
                    ms = float("nan")
                mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
                rows.append([mixer + label, how, T, ms, mem])
                print(rows[-1], flush=True)
            del model
    return "prefill, batch 1, bf16 weights: median ms of 3", ["mixer", "how", "T", "ms", "peak GiB"], rows


COPY_BW = 4.25e12  # bytes/s, the H200's measured device-to-device copy bandwidth (KLA.md)


def decode_floor_ms(model, batch, context):
    """The memory-bandwidth floor of one decoding step: every weight read once (bf16; the tied embedding is
    read whole by the output layer), plus each layer's state: KLA / GDN's float32 states read and written, or
    attention's bf16 KV cache of `context` tokens read; over COPY_BW."""
    cfg = model.config
    weights = 2 * model.get_num_params()
    dk, dv = int(cfg.expand_k * cfg.n_embd) // cfg.n_head, int(cfg.expand_v * cfg.n_embd) // cfg.n_head
    kv, delta = batch * 2 * context * cfg.n_embd * 2, 2 * batch * cfg.n_head * dk * dv * 4
    state = sum(kv if mixer == "attn" else delta for mixer in cfg.mixers)
    return 1e3 * (weights + state) / COPY_BW


def section_generate(device, smoke):
    """Decoding tokens/s after a prompt (Engine.stream: chunkwise prefill, then one token at a time from
    the carried state, plain or replayed from a CUDA graph; attention from its KV cache), batch 1 and 64.
    One more attention row lets SDPA choose among all its backends (cuDNN included), the library default."""
    import model as model_module
    prompts = (64, 256) if smoke else (1024, 8192, 32768)
    if ARGS.get("lengths"):  # --lengths=1024: these prompts only
        prompts = tuple(int(n) for n in ARGS["lengths"].split(","))
    batches = tuple(int(b) for b in ARGS.get("batch", "1,64").split(","))
    n_new = 8 if smoke else 64
    rows = []
    runs = [("kla", True, 0, c) for c in infer_modes() if c != "graphs"] + [("kla", False, 0, False), ("attn", False, 0, False),
                                                          ("attn", False, 1, False)]
    if ARGS.get("mixers"):  # --mixers=kla: only these mixers' rows; gdn: as KLA's first rows
        runs += [("gdn",) + r[1:] for r in runs[:len(infer_modes())]]
        runs = [r for r in runs if r[0] in ARGS["mixers"].split(",")]
    for mixer, graph, all_backends, compiled in runs:
        model, vocab = eval_model(mixer, device, smoke, compiled)
        engine = eval_engine(model, compiled)
        saved = model_module.SDPA_BACKENDS
        if all_backends:
            model_module.SDPA_BACKENDS = model_module.SDPA_BACKENDS + [model_module.SDPBackend.CUDNN_ATTENTION]
        label = mixer + (" (compiled)" if compiled else "") + (" (CUDA graph)" if graph else "") \
            + (" (all SDPA backends)" if all_backends else "") \
            + (" (unfused decode)" if mixer != "attn" and not model.switches["decode_fused"] else "") \
            + (" (no PDL)" if mixer != "attn" and not kernel_decode.DECODE_PDL else "")
        for batch in (batches[:1] if all_backends else batches):
            for P in (prompts[:1] if all_backends else prompts):
                if device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                try:
                    idx = torch.randint(vocab, (batch, P), device=device)
                    stream = engine.stream(idx, n_new + 1, temperature=0, cuda_graph=graph)
                    next(stream)  # prefill and the first token
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in stream:
                        pass
                    if device == "cuda":
                        torch.cuda.synchronize()
                except Exception as err:  # OOM at batch 64 for attention's cache; report and go on
                    print(f"{label} batch {batch} prompt {P}: {type(err).__name__}: {str(err)[:300]}", flush=True)
                    rows.append([label, batch, P] + [type(err).__name__] * 5)
                    stream = None
                    continue
                dt = time.perf_counter() - t0
                mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
                floor = decode_floor_ms(model, batch, P + n_new // 2)
                rows.append([label, batch, P, batch * n_new / dt, 1e3 * dt / n_new, floor, floor / (1e3 * dt / n_new),
                             mem])
                print(rows[-1], flush=True)
        model_module.SDPA_BACKENDS = saved
        del model
    return f"decoding {n_new} tokens after the prompt, bf16 weights", \
        ["mixer", "batch", "prompt", "tokens/s", "ms / step", "floor ms", "of floor", "peak GiB"], rows


# -----------------------------------------------------------------------------
# The headline: the README's numbers, each against its anchor, from one process


def with_args(section, device, smoke, **args):
    """section run as if the command line had given these --key=value settings (and only these)."""
    saved = dict(ARGS)
    ARGS.clear()
    ARGS.update(args)
    try:
        return section(device, smoke)[2]
    finally:
        ARGS.clear()
        ARGS.update(saved)


def section_headline(device, smoke):
    """The kernel against fla and FlashQLA (section_kernel's shapes), the compiled model's training step at 2048
    and 8192 tokens and batch-1 prefill at 4K / 8K / 128K against attention, and decoding after 1K tokens at
    batch 1 and 64 (CUDA graph) against the bandwidth floor. One row a number and its anchor; '-' where an anchor
    is not installed or not run."""
    cell = lambda x: "-" if x is None or isinstance(x, float) and x != x else x
    ratio = lambda a, b: a / b if all(isinstance(x, (int, float)) for x in (a, b)) else float("nan")
    rows = []
    for r in with_args(section_kernel, device, smoke):
        for anchor, col in (("fla", 3), ("FlashQLA", 4)):
            rows.append([f"kernel {r[1]} ms", r[0], r[2], anchor, r[col], ratio(r[2], r[col])])
    lengths = {} if smoke else {"lengths": "2048,8192"}  # a smoke run: eager (compiling on a CPU takes minutes)
    # train.py's defaults on a GPU: the fused loss, and for KLA the elementwise work recomputed in the backward
    train = with_args(section_train, device, smoke, mixers="attn:fused_loss,kla:recompute_elementwise:fused_loss",
                      compile="0" if smoke else "1", fla_lm="0", **lengths)
    attn = {r[2]: r for r in train if r[0].startswith("attn")}
    for r in train:
        if r[0].startswith("kla") and r[2] in attn:
            a = attn[r[2]]
            setting = f"T {r[2]}, batch {r[3]}, {r[1]}"
            rows.append(["training tokens/s", setting, r[6], "attention", a[6], ratio(r[6], a[6])])
            rows.append(["training peak GiB", setting, r[9], "attention", a[9], ratio(r[9], a[9])])
    prefill = with_args(section_prefill, device, smoke, mixers="attn,kla",
                        lengths="128,512" if smoke else "4096,8192,131072")
    attn = {r[2]: r for r in prefill if r[0] == "attn"}
    for r in prefill:
        if r[0] == "kla":
            rows.append(["prefill ms, batch 1", f"{r[2]} tokens", r[3], "attention", attn[r[2]][3],
                         ratio(r[3], attn[r[2]][3])])
    decode = with_args(section_generate, device, smoke, mixers="kla", lengths="64" if smoke else "1024",
                       batch="1,64")
    for r in decode:
        if r[0] == "kla (CUDA graph)":  # tokens/s at the floor: batch / floor ms; the ratio is "of floor"
            floor = ratio(1e3 * r[1], r[5])
            rows.append(["decoding tokens/s", f"batch {r[1]}, after {r[2]} tokens, CUDA graph", r[3],
                         "bandwidth floor", floor, ratio(r[3], floor)])
    rows = [[cell(x) for x in r] for r in rows]
    head = ["measure", "setting", "KLA", "anchor", "anchor's", "KLA / anchor"]
    return "headline: each number against its anchor, one process", head, rows


def headline_md(env, title, head, rows):
    """headline.md: the GPU, the commit, the versions, the command and the table."""
    import subprocess
    root = os.path.dirname(os.path.abspath(__file__))
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()
        except OSError:  # no git on this machine
            return ""
    commit = git("rev-parse", "HEAD") or os.environ.get("KLA_COMMIT", "unknown (not a git checkout; set KLA_COMMIT)")
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " with uncommitted changes"
    return (f"# Headline\n\n{env}; commit {commit}.\n\nCommand: `python bench.py --section=headline`. KLA / anchor "
            "below 1 is KLA faster (ms) or smaller (GiB); above 1 is KLA faster (tokens/s). Decoding's ratio is "
            f"the share of the bandwidth floor.\n\n{table(title, head, rows)}\n")


def gpu_slug(name):
    """'NVIDIA H100 80GB HBM3' -> 'h100': the results folder's suffix."""
    import re
    found = re.search(r"\b([A-Z]+\d+)", name)
    return found.group(1).lower() if found else re.sub(r"\W+", "_", name).strip("_").lower()


SECTIONS = {"profile": section_profile, "kernel": section_kernel, "varlen": section_varlen,
            "decode": section_decode,
            "train": section_train, "train_profile": section_train_profile, "prefill": section_prefill,
            "prefill_profile": section_prefill_profile, "decode_profile": section_decode_profile,
            "generate": section_generate, "headline": section_headline}


def table(title, head, rows):
    fmt = lambda x: f"{x:.3f}" if isinstance(x, float) else str(x)
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


ARGS = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
# every --key=value the sections read (beside --smoke): any other argument, a typo too, is refused before any work
FLAGS = ("section", "out", "plot", "rows", "lengths", "mixers", "batch", "compile",
         "compile_infer", "fla_lm", "fla_compile", "fla_v", "fuse_o", "decode_fused", "pdl")


def plot(results, path):
    """bench.png: training tokens/s, prefill latency and decoding tokens/s (batch 1) against the length, one
    line per mixer; panels for the sections present. python bench.py --plot=DIR/bench.json redraws it."""
    secs = results["sections"]
    panels = [(name, secs[name]) for name in ("train", "prefill", "generate") if name in secs]
    if not panels:  # nothing to draw: matplotlib is not even imported
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (name, sec) in zip(axes[0], panels):
        col = {h: i for i, h in enumerate(sec["head"])}
        lines = {}
        for r in sec["rows"]:
            if name == "train":
                key, x, y = f"{r[col['mixer']]} ({r[col['mode']]})", r[col["T"]], r[col["tokens/s"]]
            elif name == "prefill":
                key = r[col["mixer"]] + (f", {r[col['how']]}" if "how" in col and r[col["how"]] != "one pass" else "")
                x, y = r[col["T"]], r[col["ms"]]
            else:
                if r[col["batch"]] != 1:
                    continue
                key, x, y = r[col["mixer"]], r[col["prompt"]], r[col["tokens/s"]]
            if isinstance(y, (int, float)):
                lines.setdefault(key, []).append((x, y))
        for key, pts in lines.items():
            ax.plot(*zip(*pts), marker="o", label=key)
        if name == "train":  # the anchor: KLA.md's measurement on this H200, not timed in this run
            ax.plot([2048, 8192, 32768], [249e3, 244e3, 204e3], ls="--", color="gray",
                    label="fla GatedDeltaNet LM, 152M (KLA.md)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log" if name != "train" else "linear")
        ax.set_xlabel("sequence length" if name != "generate" else "prompt length")
        ax.set_ylabel({"train": "training tokens/s", "prefill": "prefill ms (batch 1)",
                       "generate": "decoding tokens/s (batch 1)"}[name])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(results["env"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def anchor_versions():
    """The anchors' installed versions, for the header of every table."""
    from importlib.metadata import PackageNotFoundError, version
    found = []
    for name in ("fla-core", "flash-qla"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def main():
    arg = lambda name, default: ARGS.get(name, default)
    known = lambda a: a == "--smoke" or a.startswith("--") and "=" in a and a[2:].split("=", 1)[0] in FLAGS
    unknown = [a for a in sys.argv[1:] if not known(a)]
    if unknown:
        sys.exit(f"error: unknown argument {unknown[0]!r}; bench.py takes --smoke and --KEY=VALUE with KEY one of "
                 + ", ".join(FLAGS))
    if "plot" in ARGS:  # redraw the plot of an earlier run, no GPU needed
        try:
            with open(ARGS["plot"]) as f:
                results = json.load(f)
            results["sections"], results["env"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            why = getattr(err, "strerror", None) or type(err).__name__
            sys.exit(f"error: --plot={ARGS['plot']}: cannot read it as an earlier run's bench.json ({why}); "
                     "give DIR/bench.json of a run with --out=DIR")
        return plot(results, os.path.splitext(ARGS["plot"])[0] + ".png")
    names = arg("section", "kernel,decode").split(",")
    out = arg("out", os.environ.get("OUT"))
    smoke = "--smoke" in sys.argv
    if not smoke and not torch.cuda.is_available():
        sys.exit("error: bench.py times CUDA kernels and found no GPU (--smoke runs it in Triton's interpreter)")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        sys.exit(f"error: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if ARGS.get("pdl") == "0":  # batch-1 decoding's kernels launched plainly instead of as dependent launches
        kernel_decode.DECODE_PDL = False
    if "fuse_o" in ARGS:  # --fuse_o=0 / 1: force the forward's output split from / fused into the sequential pass
        fused = ARGS["fuse_o"] == "1"
        kernel.CONFIGS.update({key: dict(FUSE_O=fused) for key in kernel.CONFIGS if key[0] == "fuse_o"})
    device = "cpu" if smoke else "cuda"
    torch.manual_seed(0)
    dev = "CPU (interpreter)" if smoke else torch.cuda.get_device_name()
    text = [f"bench.py on {dev}, torch {torch.__version__}, triton {triton.__version__}, {anchor_versions()}"]
    results = {"env": text[0], "sections": {}}
    for name in names:
        title, head, rows = SECTIONS[name](device, smoke)
        results["sections"][name] = {"title": title, "head": head, "rows": rows}
        text.append(table(title, head, rows))
        print("\n" + text[-1], flush=True)
    text = "\n\n".join(text)
    print("\n" + text)
    if "headline" in results["sections"]:  # results/bench_<gpu>/headline.md (a smoke run: only under --out)
        dirs = ([] if smoke else [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                               f"bench_{gpu_slug(dev)}")]) + ([out] if out else [])
        for d in dirs:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "headline.md"), "w") as f:
                f.write(headline_md(results["env"], **results["sections"]["headline"]))
            print(f"wrote {os.path.join(d, 'headline.md')}")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(out, "bench.json"), "w") as f:
            json.dump(results, f, indent=1)
        plot(results, os.path.join(out, "bench.png"))


if __name__ == "__main__":
    main()
