"""
Decoding's kernel configurations timed inside the whole step: GPT-2 small (bench.py's model), each step
replayed from a CUDA graph (Engine.stream), ms a step as the median of 3 runs of 128 steps. A single call timed
alone (bench.py --section=tune_decode) does not show what a chain of dependent launches waits for.
    python3 tools/decode_config.py                  kernel_decode._linear_config against 2 rows a program and 4
                                                    warps everywhere (8 from K = 2048), alternating, KLA and GDN
    python3 tools/decode_config.py --sweep          each projection's (rows, warps), the state kernel's
                                                    (columns, warps) and the MLP kernel's (hidden units,
                                                    warps), one at a time, the others as they are
                                                    (--from=2rows: the others at 2 rows everywhere), then
                                                    the fastest of each together against that, alternating
    python3 tools/decode_config.py --shared_blocks  every block with block 0's weights (after the first block they
                                                    are in the L2 cache): what weights in L2 would give at most
    python3 tools/decode_config.py --head_share     lm_head cut to its first eighth of rows against the whole: the
                                                    head's share of the token
    python3 tools/decode_config.py --batch=64       the one-kernel mixer's (columns a step, warps) at batch 64,
                                                    the model compiled as one graph (bench.py --compile_infer=1)
--prompt=1024 (the prompt before the timed steps), --rounds=5. Prints markdown tables, ms a decoding step.
"""
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import triton

import bench
import kernel_decode

ARGS = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
PROMPT, ROUNDS, BATCH = int(ARGS.get("prompt", 1024)), int(ARGS.get("rounds", 5)), int(ARGS.get("batch", 1))
LINEAR, STATE, MLP = kernel_decode._linear_config, kernel_decode._state_config, kernel_decode._mlp_config
MIXER = kernel_decode._mixer_config
# the model's projections through _linear_config: the mixer's input projection, the head (the output projection
# and the MLP's are the state and MLP kernels')
SHAPES = {"in_proj": (3472, 768), "lm_head": (50304, 768)}


def two_rows(N, K):
    """2 rows a program and 4 warps (8 from K = 2048) at every shape, the tests' tiny models aside."""
    BK = min(triton.next_power_of_2(K), 4096)
    return (16, BK, 4) if N < 264 else (2, BK, 4 if BK <= 1024 else 8)


def use(linear=LINEAR, state=STATE, mlp=MLP):
    kernel_decode._linear_config, kernel_decode._state_config, kernel_decode._mlp_config = linear, state, mlp


@functools.cache
def engine_of(model):
    return bench.eval_engine(model, BATCH > 1)  # as compiled as the model of main()


def ms_per_step(model, n_new=128, runs=3):
    times = []
    for _ in range(runs):
        stream = engine_of(model).stream(torch.randint(50304, (BATCH, PROMPT), device="cuda"), n_new + 1, temperature=0,
                              cuda_graph=True)
        next(stream)  # the prompt and the first token
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in stream:
            pass
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0) / n_new)
    return statistics.median(times)


def timed_row(model, label, base):
    """One configuration's row of a sweep: its time (None where Triton cannot build it) printed against base."""
    try:
        t = ms_per_step(model)
    except Exception as err:  # a configuration Triton cannot build
        print(f"| {label} | {type(err).__name__} | - |", flush=True)
        return None
    print(f"| {label} | {t:.4f} | {t / base:.3f} |", flush=True)
    return t


def sweep(model):
    start = two_rows if ARGS.get("from") == "2rows" else LINEAR
    label = "2 rows everywhere" if start is two_rows else "current"
    use(linear=start)
    print("| kernel | configuration | ms / token | vs the row \"all\" above |\n|---|---|---|---|")
    base = ms_per_step(model)
    print(f"| all | {label} | {base:.4f} | 1.000 |", flush=True)
    best = {}  # the fastest configuration of each kernel, where it beats the row "all" by 1 % or more
    for name, shape in SHAPES.items():
        for rows in (1, 2, 4, 8, 16):
            for warps in (1, 2, 4, 8):
                BK = start(*shape)[1]
                use(linear=lambda N, K, c=(rows, BK, warps), s=shape: c if (N, K) == s else start(N, K))
                t = timed_row(model, f"{name} | rows {rows} warps {warps}", base)
                if t is not None and t < 0.99 * base and t < best.get(shape, (base, None))[0]:
                    best[shape] = (t, (rows, BK, warps))
        use(linear=start)
        base = ms_per_step(model)  # again after each kernel: the GPU's state drifts
        print(f"| all | {label} | {base:.4f} | 1.000 |", flush=True)
    for cols in (16, 32, 64):
        for warps in (1, 2, 4, 8):
            use(linear=start, state=lambda V, c=(cols, warps): c)
            t = timed_row(model, f"state | columns {cols} warps {warps}", base)
            if t is not None and t < 0.99 * base and t < best.get("state", (base, None))[0]:
                best["state"] = (t, (cols, warps))
    for units in (4, 8, 16, 32, 64):
        for warps in (4, 8, 16):
            use(linear=start, mlp=lambda F, c=(units, warps): c)
            t = timed_row(model, f"mlp | units {units} warps {warps}", base)
            if t is not None and t < 0.99 * base and t < best.get("mlp", (base, None))[0]:
                best["mlp"] = (t, (units, warps))
    state, mlp = best.pop("state", (None, STATE))[1], best.pop("mlp", (None, MLP))[1]
    state = state if callable(state) else (lambda V, c=state: c)
    mlp = mlp if callable(mlp) else (lambda F, c=mlp: c)
    chosen = {shape: c for shape, (t, c) in best.items()}
    print(f"\nthe best of each together: {chosen}, state {state(192)}, mlp {mlp(2048)}\n\n"
          f"| round | {label} ms | best of each ms | ratio |\n|---|---|---|---|")
    for r in range(ROUNDS):
        use(linear=start)
        a = ms_per_step(model)
        use(linear=lambda N, K: chosen.get((N, K), start(N, K)), state=state, mlp=mlp)
        b = ms_per_step(model)
        print(f"| {r} | {a:.4f} | {b:.4f} | {b / a:.3f} |", flush=True)
    use()


def sweep_mixer(model):
    """The one-kernel mixer (batch > 1): its (columns a step, warps), the rest of the step as it is."""
    print("| configuration | ms / step | vs the current one |\n|---|---|---|")
    base = ms_per_step(model)
    print(f"| current {MIXER(192)} | {base:.4f} | 1.000 |", flush=True)
    for cols in (16, 32, 64, 128, 256):
        for warps in (1, 2, 4, 8, 16):
            kernel_decode._mixer_config = lambda V, c=(cols, warps): c
            timed_row(model, f"columns {cols} warps {warps}", base)
    kernel_decode._mixer_config = MIXER
    print(f"| current {MIXER(192)} | {ms_per_step(model):.4f} | - |", flush=True)


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"prompt {PROMPT}, batch {BATCH}\n")
    if BATCH > 1:
        return sweep_mixer(bench.eval_model("kla", "cuda", False, True)[0])
    one = any(f in sys.argv for f in ("--sweep", "--shared_blocks", "--head_share"))
    for mixer in ("kla",) if one else ("kla", "gdn"):
        model = bench.eval_model(mixer, "cuda", False)[0]
        if "--sweep" in sys.argv:
            sweep(model)
            continue
        if "--head_share" in sys.argv:
            full = model.lm_head.weight
            cut = torch.nn.Parameter(full.data[:full.shape[0] // 8].clone())
            print(f"| round | lm_head of {full.shape[0]} rows ms | of {cut.shape[0]} rows ms | difference / (7 / 8) |\n"
                  "|---|---|---|---|")
            for r in range(ROUNDS):
                model.lm_head.weight = full
                a = ms_per_step(model)
                model.lm_head.weight = cut
                b = ms_per_step(model)
                print(f"| {r} | {a:.4f} | {b:.4f} | {(a - b) * 8 / 7:.4f} |", flush=True)
            model.lm_head.weight = full
            continue
        if "--shared_blocks" in sys.argv:
            blocks = model.blocks
            print("| round | own weights ms | block 0's weights ms | ratio |\n|---|---|---|---|")
            for r in range(ROUNDS):
                a = ms_per_step(model)
                model.blocks = torch.nn.ModuleList([blocks[0]] * len(blocks))
                b = ms_per_step(model)
                model.blocks = blocks
                print(f"| {r} | {a:.4f} | {b:.4f} | {b / a:.3f} |", flush=True)
            continue
        print(f"{mixer}\n\n| round | 2 rows ms | _linear_config ms | ratio |\n|---|---|---|---|")
        for r in range(ROUNDS):
            use(linear=two_rows)
            a = ms_per_step(model)
            use()
            b = ms_per_step(model)
            print(f"| {r} | {a:.4f} | {b:.4f} | {b / a:.3f} |", flush=True)
        print()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("error: tools/decode_config.py times CUDA graphs and found no GPU")
    bench.ARGS.clear()
    main()
