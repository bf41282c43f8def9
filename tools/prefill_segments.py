"""Batch-1 prefill of KLA (GPT-2 small, bf16 weights, eager) in one pass, and in segments of each size with the state
carried: plain, and with the full segments replayed from Engine.prefill's CUDA graph of a segment. Median ms of 3, the
first graphed call (which captures), peak memory of each way (the graphed one with its graph's memory pool; no other
size's graph alive), the graphed logits against the plain segments', and the GPU time of the kernels (torch.profiler)
of the one pass and of the plain segments, so that the host's share shows.
Run from the repository root:
    python3 tools/prefill_segments.py --segments=8192,16384,32768 --lengths=16384,32768,65536,131072
"""
import sys, os, time, json
sys.path.insert(0, os.getcwd())
import torch, bench
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
segments = [int(s) for s in args.get("segments", "8192").split(",")]
lengths = [int(t) for t in args.get("lengths", "16384,65536,131072").split(",")]
bench.ARGS = {}
model, vocab = bench.eval_model("kla", "cuda", False, False)
engine = bench.Engine(model)


def gpu_ms(fn):
    return bench.gpu_time_rows("", fn, "cuda")[0][3]  # the sum over all GPU kernels


def peak_gib(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


rows = []
for T in lengths:
    idx = torch.randint(vocab, (1, T), device="cuda")
    with torch.no_grad():
        one_pass = lambda: model(idx)
        one = bench.median_ms(one_pass, "cuda", warmup=1, reps=3)
        row = dict(T=T, one_pass_ms=one, one_pass_gpu_ms=gpu_ms(one_pass), one_pass_peak_gib=peak_gib(one_pass))
        print(row, flush=True)
        for seg in segments:
            if seg >= T:
                continue
            engine.segment_graphs.clear()  # each size's peak without another size's graph
            torch.cuda.empty_cache()
            plain_fn = lambda: engine.prefill(idx, model.new_cache(), seg)
            graph_fn = lambda: engine.prefill(idx, model.new_cache(), seg, True)
            plain_logits = plain_fn()
            plain = bench.median_ms(plain_fn, "cuda", warmup=1, reps=3)
            plain_peak, plain_gpu = peak_gib(plain_fn), gpu_ms(plain_fn)
            torch.cuda.synchronize(); t0 = time.perf_counter()
            g_logits = graph_fn()  # the first time: captures
            torch.cuda.synchronize(); first = 1e3 * (time.perf_counter() - t0)
            graph = bench.median_ms(graph_fn, "cuda", warmup=1, reps=3)
            err = ((g_logits.float() - plain_logits.float()).abs().max() / plain_logits.float().abs().max()).item()
            rows.append(dict(T=T, segment=seg, one_pass_ms=one, segments_ms=plain, segments_graph_ms=graph,
                             graph_first_call_ms=first, segments_over_one_pass=plain / one, graph_over_one_pass=graph / one,
                             one_pass_gpu_ms=row["one_pass_gpu_ms"], segments_gpu_ms=plain_gpu,
                             one_pass_peak_gib=row["one_pass_peak_gib"], segments_peak_gib=plain_peak,
                             graph_peak_gib=peak_gib(graph_fn), logits_rel_err=err))
            print(rows[-1], flush=True)
    engine.segment_graphs.clear()
    torch.cuda.empty_cache()
print(json.dumps(rows))
