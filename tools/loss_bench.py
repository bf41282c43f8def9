"""
The training loss's cost alone: the tied lm_head and the cross-entropy, forward and backward, compiled, at the
whole model's training shape (32 x 2048 rows of width 768, vocabulary 50304, bf16 autocast), in one process:

    logits      F.linear, then F.cross_entropy on the float32 logits (the fused_loss switch off)
    fused@2^N   chunked_loss.FusedCrossEntropy (the fused_loss switch) with chunked_loss.LOSS_CHUNK = 2^N logits a chunk

    python3 tools/loss_bench.py                      # on a GPU: ms a call (median), peak GiB, and the gradients'
                                                     # largest difference from the 'logits' row's
    python3 tools/loss_bench.py --rows=4096 --chunks=27,28,29
"""
import os
import sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, root)
import torch
import torch.nn.functional as F
import triton

import chunked_loss

rows = 32 * 2048
width = 768
vocab = 50304
chunks = "27,28,29"
exec(open(os.path.join(root, "configurator.py")).read())


def plain(x, w, t):
    return F.cross_entropy(F.linear(x, w).float(), t, ignore_index=-1)


def fused(x, w, t):
    return chunked_loss.FusedCrossEntropy.apply(x, w, t)


def main():
    if not all(c.strip().isdigit() and 10 <= int(c) <= 40 for c in str(chunks).split(",")):
        sys.exit(f"error: --chunks={chunks}: must be exponents N of 2^N logits a chunk, 10 to 40, comma-separated")
    if not torch.cuda.is_available():
        sys.exit("error: tools/loss_bench.py times the loss on a CUDA GPU and found none")
    torch.manual_seed(0)
    x0 = torch.randn(rows, width, device="cuda")
    w0 = torch.randn(vocab, width, device="cuda") * 0.02
    t = torch.randint(0, vocab, (rows,), device="cuda")
    t[::97] = -1  # some ignored rows, as packed documents' padding would give
    print(f"tools/loss_bench.py on {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"rows {rows}, width {width}, vocabulary {vocab}, bf16 autocast, compiled; forward + backward\n")
    print("| variant | ms | peak GiB | loss | max |dx - dx_logits| | max |dw - dw_logits| |")
    print("|---|---|---|---|---|---|")
    variants = [("logits", plain, None)] + [(f"fused@2^{c}", fused, 2 ** int(c)) for c in str(chunks).split(",")]
    ref = None
    for name, fn, chunk in variants:
        if chunk is not None:
            chunked_loss.LOSS_CHUNK = chunk
        torch._dynamo.reset()
        step = torch.compile(fn)
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()

        def call():
            x.grad = w.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = step(x, w, t)
            loss.backward()
            return loss

        loss = call()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = call()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = triton.testing.do_bench(call, warmup=5, rep=50)
        grads = (x.grad.float(), w.grad.float())
        if ref is None:
            ref = grads
        dx, dw = ((a - b).abs().max().item() for a, b in zip(grads, ref))
        print(f"| {name} | {ms:.3f} | {peak:.2f} | {loss.item():.6f} | {dx:.2e} | {dw:.2e} |", flush=True)


if __name__ == "__main__":
    main()
