"""
bench.py, test_gpu.py run as a script on a CPU, and the tools/ scripts: smoke runs and their argument checks.
"""

import json
import os
import re
import sys

import pytest
import torch

import kernel
import kernel_decode

from helpers import ROOT, TINY, assert_clean_error, assert_each_is_one_line, run, run_each, train_log


@pytest.mark.slow
def test_gpu_script_smoke():
    """test_gpu.py --smoke: the GPU correctness script itself (chunk kernel, decoding step, fused decoding
    kernel, whole-model decoding against float64) on tiny cases in Triton's interpreter."""
    p = run("test_gpu.py", "--smoke", timeout=600)
    assert p.returncode == 0 and "all passed" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.slow
def test_bench_smoke(tmp_path):
    """bench.py --smoke: every section a GPU run uses, at toy sizes on the CPU (the kernel in Triton's
    interpreter), writes its table; --fuse_o=0 forces the kernel's other forward path."""
    sections = "kernel,varlen,decode,train,prefill,generate,train_profile,prefill_profile,decode_profile"
    p = run("bench.py", "--smoke", f"--section={sections}", "--compile=0", "--fuse_o=0", f"--out={tmp_path}",
            timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "bench.json").read_text())
    assert list(res["sections"]) == sections.split(",")
    for name, sec in res["sections"].items():
        assert sec["rows"] and all(len(r) == len(sec["head"]) for r in sec["rows"]), name
        assert not any(isinstance(x, str) and x.endswith("Error") for r in sec["rows"] for x in r), name
    assert (tmp_path / "bench.md").read_text().count("### ") == len(sections.split(","))


@pytest.mark.slow
def test_tune_tool_times_variants_from_overridden_table_rows(tmp_path):
    """tools/tune.py --smoke: decode_linear's variants and the backward's, in Triton's interpreter, each variant
    launched from the table rows it overrides (kernel.CONFIGS, kernel_decode.DECODE_CONFIGS), restored after it."""
    p = run(os.path.join("tools", "tune.py"), "--smoke", "--section=tune_decode,tune", "--variants=wy warps=8",
            f"--out={tmp_path}", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = (tmp_path / "tune.md").read_text()
    assert text.count("### ") == 2 and "| decode_linear BN=16 warps=4 |" in text and "| wy warps=8 |" in text, text
    assert "Error" not in text and "| dq/dk BKB=32" not in text, text
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import tune
    finally:
        sys.path.pop(0)
    tables = [dict(kernel.CONFIGS), dict(kernel_decode.DECODE_CONFIGS)]
    restore = tune.overridden({**tune.rows("bwd_wy", num_warps=2, num_stages=1),
                               **tune.rows("linear", kernel_decode.DECODE_CONFIGS, BN=32, num_warps=2)})
    try:
        for BK, fp32 in ((16, False), (128, False), (32, True)):
            assert kernel._config("bwd_wy", BK, 64, fp32) == dict(num_warps=2, num_stages=1)
        assert kernel._config("bwd_cc", 128, 64) == tables[0]["bwd_cc", "K >= 96"]
        assert kernel_decode._decode_config("linear", N=50304, K=768) == dict(BN=32, num_warps=2, BK=1024)
    finally:
        restore()
    assert [kernel.CONFIGS, kernel_decode.DECODE_CONFIGS] == tables
    assert_each_is_one_line(os.path.join("tools", "tune.py"), [
        ("--secton=tune", "error: unknown argument '--secton=tune'; tools/tune.py takes --smoke and"),
        ("--section=kernel", "error: --section=kernel: choose from tune, tune_seq, tune_decode")])


def test_train_memory_tool_on_the_cpu(tmp_path):
    """tools/train_memory.py on a tiny model on the CPU: the saved activations by module and one summary row a mixer,
    written to --out."""
    p = run(os.path.join("tools", "train_memory.py"), "--device=cpu", "--dtype=float32", "--batch_size=1",
            "--block_size=16", "--n_layer=1", "--n_head=2", "--n_embd=32", "--vocab_size=64", "--backend=chunkwise",
            "--mixers=kla,attn", f"--out={tmp_path / 'memory.md'}", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = (tmp_path / "memory.md").read_text()
    for mixer in ("kla", "attn"):
        row = re.search(rf"^\| {mixer} \| eager \| ([\d,]+) \|", text, re.M)
        assert row and int(row.group(1).replace(",", "")) > 0, text
    assert "| mlp.down |" in text, text


def test_loss_bench_tool_checks_its_flags_and_compares_the_losses():
    """tools/loss_bench.py: a bad --chunks and a machine without a GPU are one line each, before any work; its two
    losses (logits, then the fused loss at a small chunk) agree in value and gradients on the CPU."""
    tool = os.path.join("tools", "loss_bench.py")
    p = run(tool, "--chunks=5")
    assert_clean_error(p, "--chunks=5: must be exponents N of 2^N logits a chunk")
    if not torch.cuda.is_available():
        assert_clean_error(run(tool), "found none")
    code = ("import sys, torch; sys.argv = ['loss_bench.py']; sys.path.insert(0, 'tools'); import loss_bench as b; "
            "b.chunked_loss.LOSS_CHUNK = 2 ** 10; torch.manual_seed(0); t = torch.randint(0, 300, (64,)); t[::7] = -1; "
            "out = []\n"
            "for fn in (b.plain, b.fused):\n"
            "    x, w = torch.randn(64, 16, requires_grad=True), torch.randn(300, 16, requires_grad=True)\n"
            "    torch.manual_seed(1); x.data.normal_(); w.data.normal_(); loss = fn(x, w, t); loss.backward()\n"
            "    out.append((loss.detach(), x.grad, w.grad))\n"
            "print(max((a - c).abs().max().item() for a, c in zip(*out)))")
    p = run("-c", code)
    assert p.returncode == 0, p.stderr[-3000:]
    assert float(p.stdout.split()[-1]) < 1e-5, p.stdout


@pytest.mark.slow
def test_bench_headline_smoke(tmp_path):
    """bench.py --section=headline --smoke writes headline.md: the device, the commit, the versions, the command
    and one table whose rows are the kernel against fla and FlashQLA ('-' where not installed), training and
    prefill against attention and decoding against the bandwidth floor."""
    p = run("bench.py", "--smoke", "--section=headline", f"--out={tmp_path}", timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = (tmp_path / "headline.md").read_text()
    assert text.startswith("# Headline\n") and "commit " in text and "`python bench.py --section=headline`" in text
    assert re.search(r"torch \S+, triton \S+, fla-core \S+.*, flash-qla ", text), text[:500]
    lines = [l for l in text.splitlines() if l.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["measure", "setting", "KLA", "anchor", "anchor's", "KLA / anchor"] and set(lines[1]) <= set("|-")
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in lines[2:]]
    assert all(len(r) == len(head) for r in rows) and "nan" not in text
    measures = {(r[0], r[3]) for r in rows}
    assert {("kernel fwd ms", "fla"), ("kernel fwd+bwd ms", "FlashQLA"), ("training tokens/s", "attention"),
            ("training peak GiB", "attention"), ("prefill ms, batch 1", "attention"),
            ("decoding tokens/s", "bandwidth floor")} <= measures, measures
    assert [r[1].split(",")[0] for r in rows if r[0] == "decoding tokens/s"] == ["batch 1", "batch 64"]


def test_readme_performance_numbers_are_in_their_source():
    """Every ratio in README's Performance table stands in the results file its row names, run on the GPU the row
    names (headline.md's table once a headline run exists; until then one single-process file of the code)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
    lines = [l for l in section.splitlines() if l.startswith("|")]
    assert lines and len(section.strip().splitlines()) <= 12, section
    checked = 0
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        numbers = re.findall(r"\d+\.\d+", cells[2])
        if not numbers:
            continue
        links = re.findall(r"\]\((results/[^)]+)\)", cells[3])
        gpus = re.findall(r"\bH[12]00\b", cells[3])
        assert len(links) == 1 and len(gpus) == 1, line
        source = open(os.path.join(ROOT, links[0])).read()
        assert f"NVIDIA {gpus[0]}" in source[:600], f"{links[0]} does not open naming the {gpus[0]}"
        for n in numbers:
            assert re.search(rf"(?<![\d.]){re.escape(n)}(?!\d)", source), f"{n} is not in {links[0]}"
            checked += 1
    assert checked


@pytest.mark.slow
def test_bench_kernel_rows_in_the_order_given(tmp_path):
    """bench.py --rows picks the kernel section's rows and runs them in the order given; a name that matches no
    row is refused in one line before anything is timed."""
    p = run("bench.py", "--smoke", "--section=kernel", "--rows=0,7f", f"--out={tmp_path}")
    assert p.returncode != 0 and "'7f' names no row" in p.stderr and "0..0" in p.stderr, p.stderr
    assert not (tmp_path / "bench.json").exists()
    p = run("bench.py", "--smoke", "--section=kernel", "--rows=0b,0f", f"--out={tmp_path}", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / "bench.json").read_text())["sections"]["kernel"]["rows"]
    assert [r[1] for r in rows] == ["fwd+bwd", "fwd"], rows


@pytest.mark.slow
def test_ddp_compare_tool(tiny_data, tmp_path):
    """tools/ddp_compare.py: the same job on 1 and 2 processes, its table, and equal loss curves."""
    p = run(os.path.join(ROOT, "tools", "ddp_compare.py"), "--nproc=2", "--skip=1", f"--root={tmp_path}",
            f"--out={tmp_path / 'ddp.md'}", "--", *TINY, f"--data_dir={tiny_data}", "--device=cpu",
            "--max_iters=3", "--eval_interval=100", "--eval_iters=1", "--gradient_accumulation_steps=2", timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    table = (tmp_path / "ddp.md").read_text()
    assert "| 1 GPU |" in table and "| 2 GPUs |" in table
    assert "loss difference over 3 iterations: mean 0.0000, max 0.0000" in table, table
    one, two = (train_log(str(tmp_path / d)) for d in ("gpu1", "gpu2"))
    assert len([r for r in one if "loss" in r]) == len([r for r in two if "loss" in r]) == 3


@pytest.mark.slow
def test_ddp_compare_checks_its_flags_first(tiny_data, tmp_path):
    """tools/ddp_compare.py: --nproc < 1, and gradient_accumulation_steps not a multiple of --nproc, are one line
    before any run; a run that fails gives its error line, not torchrun's traceback."""
    tool, out = os.path.join(ROOT, "tools", "ddp_compare.py"), tmp_path / "ddp"
    p = run(tool, "--nproc=0", f"--root={out}")
    assert_clean_error(p, "error: --nproc=0: must be >= 1")
    p = run(tool, "--nproc=2", f"--root={out}", "--", *TINY, "--max_iters=3")
    assert_clean_error(p, "error: gradient_accumulation_steps = 1 (train.py's default): must be a multiple of --nproc=2")
    assert len(p.stderr.splitlines()) == 1 and not out.exists()
    p = run(tool, "--nproc=1", f"--root={out}", "--", *TINY, f"--data_dir={tiny_data}", "--max_iters=0")
    assert_clean_error(p, "error: the 1-process run failed (exit 1): config error: max_iters = 0: must be >= 1",
                       f"(its output: {out / 'gpu1' / 'stdout.txt'})")
    assert len(p.stderr.splitlines()) == 1


@pytest.mark.slow
def test_gpu_script_needs_a_gpu_and_checks_its_cases():
    """test_gpu.py without a GPU (unless --smoke), and a --cases index outside the list: one line each, before any
    work."""
    cases = [([], "error: test_gpu.py needs a CUDA GPU (--smoke runs it in Triton's interpreter)"),
             (["--cases=a"], "error: --cases=a: must be case indices 0.."),
             (["--smoke", "--cases=99"], "error: --cases=99: must be case indices 0..5 separated by commas")]
    for (args, phrase), (code, err) in zip(cases, run_each("test_gpu.py", [args for args, _ in cases]), strict=True):
        assert code != 0 and "Traceback" not in err and phrase in err and len(err.splitlines()) == 1, (args, err)


def test_bench_and_tools_refuse_bad_arguments_in_one_line():
    """bench.py's unknown arguments (a typo too) and a --plot file it cannot read; tools/ptxas_report.py's unknown
    flags and kernel names; tools/ab_kernel.py's shapes, rounds and dtype: one line each, before any work."""
    assert_each_is_one_line("bench.py", [
        ("--secton=decode", "error: unknown argument '--secton=decode'; bench.py takes --smoke and --KEY=VALUE with KEY one of section,"),
        ("--plot=nofile.json", "error: --plot=nofile.json: cannot read it as an earlier run's bench.json (No such file")])
    assert_each_is_one_line(os.path.join("tools", "ptxas_report.py"), [
        ("nosuchkernel", "error: 'nosuchkernel' is in no kernel's label"),
        ("--fp32=1", "error: unknown flag '--fp32=1'; the flags are --fp32, --wgmma, --loops, --trans")])
    assert_each_is_one_line(os.path.join("tools", "ab_kernel.py"), [
        ("--shapes=9", "error: --shapes=9: must be indices 0..4, comma-separated"),
        ("--rounds=0", "error: --rounds=0: must be an integer >= 1"),
        ("--dtype=float16", "error: --dtype=float16: must be bfloat16 or float32")], "--old=kernel.py")
