"""
The language model's loss computed a chunk of rows at a time, so that no float32 copy of every row's logits exists at
once: chunked_cross_entropy (evaluation, no gradients) and FusedCrossEntropy (training with model.py's fused_loss
switch: the gradients computed in the forward, no logits kept).
"""

import torch
import torch.nn.functional as F

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
    float32 log-softmax (the model's fused_loss switch; at vocabulary 50304 and bf16 autocast 3 KB a token kept in place of
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
