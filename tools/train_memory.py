"""
Where one training step's memory goes, for each mixer: the bytes the forward keeps for the backward, by module
(bytes per token and layer), the dtypes and shapes behind the large ones, and on CUDA the memory the forward
leaves allocated and the peak of the whole step (forward, backward, AdamW), eager and compiled.

    python3 tools/train_memory.py                    # GPT-2 small (12 x 768), batch 32 x 2048, attn and kla
    python3 tools/train_memory.py --mixers=kla,kla:recompute,kla:fused_loss --compile=0,1
    TRITON_INTERPRET=1 python3 tools/train_memory.py --device=cpu --dtype=bfloat16 --batch_size=1 --block_size=128 \
        --n_layer=2 --backend=triton             # on a CPU: the kernel in Triton's interpreter (or --backend=chunkwise)

A mixer spec is bench.py's train section's: 'kla', 'gdn' or 'attn', then ':'-separated GPT switches set True
('kla:recompute'). Each tensor saved for the backward (torch.autograd.graph.saved_tensors_hooks) is counted once
(by storage: its bytes are the storage's, its shape that of the first view seen), under the module that saved
it first; the weights are left out, and tensors of a weight's shape
(autocast's bf16 copies, fused_loss's weight gradient) are one row, per step rather than per token (a batch_size x
block_size equal to a weight's dimension would confuse the two). Tensors kept by torch.utils.checkpoint for its
recomputation are counted under the module that called it ('... checkpoint inputs'). In compiled code the saved
tensors are not split by module (the kernel's included: the model compiles to one graph): one row.
Bytes per token and layer transfer between sizes; some dtypes do not between devices: CUDA autocast runs
F.normalize (q; k too for GDN) in float32 where CPU autocast keeps bfloat16 (the residual stream and the norms on it
are float32 in both), the CPU's attention (SDPA's math path) keeps the T x T probabilities where CUDA's flash
attention keeps its output and log-sum-exp, and --dtype=float32 is all float32.
"""
import os
import sys
from collections import defaultdict
from contextlib import nullcontext

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, root)
import torch
import torch.utils.checkpoint

import model as kla_model
from model import GPT, GPTConfig

mixers = "attn,kla"
batch_size = 32
block_size = 2048
n_layer = 12
n_head = 6
n_embd = 768
vocab_size = 50304
backend = "auto"
device = "auto"       # 'auto': cuda when there is one
dtype = "auto"        # autocast's: 'bfloat16', 'float16' or 'float32' (no autocast); 'auto': bf16 on CUDA, else float32
compile = "0"         # '0', '1' or '0,1': eager and / or torch.compile'd (CUDA's numbers only)
top = 2               # the largest saved tensors listed per module
out = ""              # also write the table to this file
exec(open(os.path.join(root, "configurator.py")).read())

device = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
dtype = dtype if dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
cuda = device == "cuda"
WEIGHTS = "weight-shaped: autocast's copies, fused_loss's gradient (per step, not per token)"
weight_shapes = set()  # the weights' shapes and their transposes: a saved tensor of one is not an activation
tokens = batch_size * block_size
MiB = 2**20


def build(spec):
    name, *switches = spec.split(":")
    cfg = GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                    mixer=name)
    m = GPT(cfg, backend=backend, **{s: True for s in switches}).to(device)
    m.set_backend(device)
    return m, m.configure_optimizers(0.1, 3e-4, (0.9, 0.95), device)


def step_fn(m, opt):
    idx = torch.randint(vocab_size, (batch_size, block_size + 1), device=device)
    ctx = nullcontext() if dtype == "float32" else torch.autocast(device, dtype=getattr(torch, dtype))

    def forward():
        with ctx:
            return m(idx[:, :-1], idx[:, 1:])[1]  # the logits are dropped at once, as train.py does

    def step():
        forward().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return forward, step


def label_modules(m):
    """Each module's name without its block's index ('blocks.3.mixer.in_proj' -> 'mixer.in_proj'); outside the
    blocks 'model.' and the name ('model.lm_head'), GPT's own operations 'model: loss'."""
    names = {}
    for name, mod in m.named_modules():
        parts = name.split(".")
        names[mod] = ".".join(parts[2:]) if parts[0] == "blocks" else ("model." + name if name else "model: loss")
        if parts[0] == "blocks" and len(parts) == 2:
            names[mod] = "block (residual)"
    return names


stack = ["model: loss"]  # the labels of the modules running now (eager); compiled code is one label
kept = defaultdict(lambda: [0, defaultdict(int)])  # label: [bytes, {(dtype, shape): bytes}] of one forward's saves
seen = set()  # storages counted (and the weights')


def record(t, where=None):
    if torch.is_tensor(t) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in seen:
        seen.add(t.untyped_storage().data_ptr())
        shape, n = tuple(t.shape), t.untyped_storage().nbytes()
        where = WEIGHTS if shape in weight_shapes else where or stack[-1]
        kept[where][0] += n
        kept[where][1][(str(t.dtype).removeprefix("torch."), shape)] += n
    return t


def kernel_call(*args, **kw):  # model.linear_attention: the kernel's own saves, then the mixer's ops after it
    stack.append("mixer: the kernel (" + kw.get("backend", "?") + ")")
    try:
        return plain_linear_attention(*args, **kw)
    finally:
        stack.pop()
        stack[-1] = stack[-1].replace("before", "after")


def checkpoint_call(fn, *args, **kw):  # what torch.utils.checkpoint keeps to recompute from (eager only)
    for a in args:
        record(a, stack[-1] + " (checkpoint inputs)")
    return plain_checkpoint(fn, *args, **kw)


plain_linear_attention, plain_checkpoint = kla_model.linear_attention, torch.utils.checkpoint.checkpoint


def saved_tensors(m, forward, compiled):
    """Run forward with every saved tensor recorded in kept (eager: by module); return its loss."""
    kept.clear()
    seen.clear()
    seen.update(p.untyped_storage().data_ptr() for p in m.parameters())
    stack[:] = ["compiled graphs" if compiled else "model: loss"]
    names, hooks = label_modules(m), []

    def pre(mod, args):
        stack.append(names[mod] + (", before the kernel" if isinstance(mod, kla_model.DeltaMixer) else ""))

    def post(mod, args, output):
        stack.pop()

    if not compiled:
        hooks = [h for mod in names for h in (mod.register_forward_pre_hook(pre), mod.register_forward_hook(post))]
        kla_model.linear_attention, torch.utils.checkpoint.checkpoint = kernel_call, checkpoint_call
    try:
        with torch.autograd.graph.saved_tensors_hooks(torch.compiler.disable(record), lambda t: t):
            return forward()
    finally:
        kla_model.linear_attention, torch.utils.checkpoint.checkpoint = plain_linear_attention, plain_checkpoint
        for h in hooks:
            h.remove()


def measure(spec, compiled):
    """(saved tensors by label, CUDA: MiB the forward leaves allocated, peak MiB of a step)."""
    torch.manual_seed(0)
    m, opt = build(spec)
    forward, step = step_fn(m, opt)
    weight_shapes.clear()
    weight_shapes.update(s for p in m.parameters() for s in (tuple(p.shape), tuple(p.shape)[::-1]))
    if compiled:
        m.compile(dynamic=False)
    for _ in range(2):  # compiles; AdamW's state exists from here on, as in a training run
        step()
    saved_tensors(m, forward, compiled).backward()
    opt.zero_grad(set_to_none=True)
    saved = {k: v for k, v in kept.items()}
    fwd = peak = float("nan")
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = forward()
        fwd = (torch.cuda.memory_allocated() - before) / MiB
        loss.backward()
        opt.zero_grad(set_to_none=True)
        del loss
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = torch.cuda.max_memory_allocated() / MiB
    del m, opt, forward, step
    if cuda:
        torch.cuda.empty_cache()
    return saved, fwd, peak


lines = [f"# saved for the backward: {device}, {dtype}, batch {batch_size} x {block_size}, {n_layer} x {n_embd}, "
         f"{n_head} heads, vocabulary {vocab_size}, backend {backend}", ""]
summary = ["| mixer | mode | activations saved, bytes / token | saved GiB | forward leaves GiB | peak of a step GiB |",
           "|---|---|---|---|---|---|"]
for spec in mixers.split(","):
    for compiled in [bool(int(c)) for c in compile.split(",")]:
        saved, fwd, peak = measure(spec, compiled)
        mode = "compiled" if compiled else "eager"
        total = sum(b for name, (b, _) in saved.items() if name != WEIGHTS)
        summary.append(f"| {spec} | {mode} | {total / tokens:,.0f} | {total / 2**30:.2f} | {fwd / 1024:.2f} | "
                       f"{peak / 1024:.2f} |")
        print(summary[-1], flush=True)
        lines += [f"## {spec}, {mode}: {total / tokens:,.0f} bytes / token of activations saved "
                  f"({total / MiB:,.1f} MiB)", "",
                  "| saved by | bytes / token / layer | bytes / token | largest (dtype, shape: MiB) |",
                  "|---|---|---|---|"]
        for name, (nbytes, shapes) in saved.items():  # in the order the forward saves them
            per_layer = "" if name.startswith("model") or name == WEIGHTS else f"{nbytes / tokens / n_layer:,.0f}"
            per_token = "" if name == WEIGHTS else f"{nbytes / tokens:,.0f}"
            big = sorted(shapes.items(), key=lambda kv: -kv[1])[:top]
            detail = ", ".join(f"{dt} {list(shape)}: {b / MiB:,.1f}" for (dt, shape), b in big)
            lines.append(f"| {name} | {per_layer} | {per_token} | {detail} |")
        lines.append("")
text = "\n".join(lines + summary) + "\n"
print("\n" + text)
if out:
    with open(out, "w") as f:
        f.write(text)
