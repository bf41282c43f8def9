"""Batch-1 prefill of KLA (GPT-2 small, bf16 weights, eager) in one pass, in segments of 8192, and in segments replayed
from model.prefill's CUDA graph of a segment: median ms of 3, the first graphed call (which captures), peak memory of
the graphed calls, the graphed logits against the plain segments'. Run from the repository root:
    python3 tools/prefill_segments.py
"""
import sys, os, time, json
sys.path.insert(0, os.getcwd())
import torch, bench
bench.ARGS = {}
model, vocab = bench.eval_model("kla", "cuda", False, False)
rows = []
for T in (16384, 65536, 131072):
    idx = torch.randint(vocab, (1, T), device="cuda")
    with torch.no_grad():
        one = bench.median_ms(lambda: model(idx), "cuda", warmup=1, reps=3)
        plain_logits = model.prefill(idx, model.new_cache(), 8192)
        plain = bench.median_ms(lambda: model.prefill(idx, model.new_cache(), 8192), "cuda", warmup=1, reps=3)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        g_logits = model.prefill(idx, model.new_cache(), 8192, True)  # the first time: captures (if not yet)
        torch.cuda.synchronize(); first = 1e3 * (time.perf_counter() - t0)
        torch.cuda.reset_peak_memory_stats()
        graph = bench.median_ms(lambda: model.prefill(idx, model.new_cache(), 8192, True), "cuda", warmup=1, reps=3)
        peak = torch.cuda.max_memory_allocated() / 2**30
    err = ((g_logits.float() - plain_logits.float()).abs().max() / plain_logits.float().abs().max()).item()
    rows.append(dict(T=T, one_pass_ms=one, segments_ms=plain, segments_graph_ms=graph, graph_first_call_ms=first,
                     graph_over_one_pass=graph / one, segments_over_one_pass=plain / one, peak_gib=peak, logits_rel_err=err))
    print(rows[-1], flush=True)
print(json.dumps(rows))
