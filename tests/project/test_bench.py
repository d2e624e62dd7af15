"""``epmoe bench``: the gmm smoke run through the CLI, its table, the timing helpers, gpu_check's CPU exit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epmoe.bench import common, gmm
from epmoe.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def one_thread():
    """The smoke run uses one thread (no OpenMP barriers to stall on a busy machine), then restores."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_bench_gmm_quick(tmp_path, capsys, one_thread):
    out = tmp_path / "gmm.md"
    assert main(["bench", "gmm", "--quick", "--threads", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == list(gmm.HEADERS)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    # 3 projections (tiny gate_up + down, tiny-decode gate_up) x 2 dtypes x 2 passes x
    # (batched, torch, loop, auto, dense); auto passes over batched for so few groups
    assert len(rows) == 3 * 2 * 2 * 5
    assert {r[3] for r in rows} == {"batched", "torch", "loop", "auto (torch)", "dense mm"}
    assert {r[2] for r in rows} == {"fwd", "fwd+bwd"} and {r[1] for r in rows} == {"fp32", "bf16"}
    for r in rows:  # numbers, not performance: a slow backend's ratio may print as 0.00 on a loaded machine
        assert float(r[4]) > 0 and float(r[5]) >= 0 and float(r[6]) >= 0
    assert all(r[6] == "1.00" for r in rows if r[3] == "dense mm")
    assert "`auto` picked: torch" in printed

    document = out.read_text()
    assert "epmoe bench gmm --quick --device cpu --threads 1" in document
    assert f"torch {torch.__version__}" in document
    assert lines[0] in document and "## Summary" in document


def test_bench_gmm_rejects_an_unknown_backend(capsys, one_thread):
    assert main(["bench", "gmm", "--quick", "--threads", "1", "--case", "tiny", "--backend", "nope"]) == 2
    assert "--backend" in capsys.readouterr().err


def test_renamed_options_keep_their_old_spelling_with_a_warning(capsys):
    """--gmm-backend (demo, bench gmm) and --dist-backend (bench fused) were --backend: the old spelling
    still parses, to the same value, and warns on stderr; the new one does not warn."""
    from epmoe.cli import build_parser

    for argv, dest, value in (
        (["demo", "--gmm-backend", "loop"], "gmm_backend", "loop"),
        (["bench", "gmm", "--gmm-backend", "loop", "--gmm-backend", "torch"], "gmm_backend", ["loop", "torch"]),
        (["bench", "fused", "--dist-backend", "gloo"], "dist_backend", "gloo"),
    ):
        new = build_parser().parse_args(argv)
        assert getattr(new, dest) == value and "renamed" not in capsys.readouterr().err, argv
        old = build_parser().parse_args([a.replace(f"--{dest.replace('_', '-')}", "--backend") for a in argv])
        assert getattr(old, dest) == value, argv
        assert f"--backend is renamed --{dest.replace('_', '-')}" in capsys.readouterr().err, argv


def test_counts_are_seeded_and_sum_to_rows():
    case = gmm.CASES[0]
    counts = case.counts(0)
    assert counts == case.counts(0) and sum(counts) == case.rows and len(counts) == case.num_experts
    assert sum(counts) / len(counts) >= gmm.LARGE_ROWS


def test_ceiling_times_each_rows_per_call_against_one_mm(one_thread):
    case = gmm.Case(
        "small", "4 groups of 128 rows on average", num_experts=4, hidden=32, intermediate=16, tokens=512, top_k=1, ep=1
    )
    settings = common.Settings(torch.device("cpu"), 1, 0, 1, 0, True, None)
    ceiling = gmm.run_ceiling([case, gmm.QUICK_CASES[0]], settings)  # tiny: 32 rows per group, left out
    assert set(ceiling) == {(32, 32, 512), (16, 32, 512)}
    for ratios in ceiling.values():
        assert sorted(ratios) == [64, 128, 256] and all(q > 0 for q in ratios.values())
    table = gmm._ceiling_table(ceiling).splitlines()
    assert table[0].split("|")[3].strip() == "M = 64" and len(table) == 4
    assert table[2].split("|")[6].strip() == ""  # M = 512 > T / 2

    fast, slow = {(8, 8, 512): {256: 0.95}}, {(8, 8, 512): {256: 0.95}, (4, 16, 512): {256: 0.5}}
    assert "at least 0.9x for every shape" in gmm.summarize_ceiling(fast)[0]
    assert "below 0.9x for 4x16 (0.50)" in gmm.summarize_ceiling(slow)[0]
    assert gmm.summarize_ceiling({}) == [] and "no case" in gmm._ceiling_table({})


def _row(case, label, backend, seconds, spread, auto=False):
    return gmm.Result(case, "gate_up", "fp32", "fwd", label, backend, auto, seconds, 1e9, 1.0, 8.0, spread)


def test_summary_counts_a_difference_only_beyond_the_row_noise():
    quiet = [
        _row("quiet", "torch", "torch", 1.3, 0.02),
        _row("quiet", "loop", "loop", 1.0, 0.02),
        _row("quiet", "auto (torch)", "torch", 1.3, 0.02, auto=True),
        _row("quiet", "dense mm", None, 1.0, 0.0),
    ]
    noisy = [
        _row("noisy", "torch", "torch", 1.3, 0.8),
        _row("noisy", "loop", "loop", 1.0, 0.05),
        _row("noisy", "auto (torch)", "torch", 1.3, 0.05, auto=True),
        _row("noisy", "dense mm", None, 1.0, 0.0),
    ]
    lines = gmm.summarize(quiet + noisy)
    torch_line = next(line for line in lines if line.startswith("- `torch` time"))
    assert "slower beyond noise in: quiet gate_up fp32 fwd (1.30)." in torch_line
    picked_line = next(line for line in lines if line.startswith("- The backend `auto` picked"))
    assert "slower beyond noise in: quiet gate_up fp32 fwd (1.30)." in picked_line
    assert "never slower" in next(line for line in gmm.summarize(noisy) if line.startswith("- `torch` time"))


def test_measure_interleaves_and_takes_the_median():
    order = []
    timings = common.measure({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, warmup=1, repeats=3)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert set(timings) == {"a", "b"} and all(len(t.samples_s) == 3 for t in timings.values())


def test_markdown_table_and_flops():
    table = common.markdown_table(("name", "ms"), [("x", 1.5), ("longer", 10)])
    assert table.splitlines() == ["| name   |  ms |", "| ------ | --: |", "| x      | 1.5 |", "| longer |  10 |"]
    with pytest.raises(ValueError, match="rows"):
        common.markdown_table(("a", "b"), [("x",)])
    assert common.format_flops(154.2e9) == "154 GFLOP/s"
    assert common.format_flops(1.234e12) == "1.23 TFLOP/s"


@pytest.mark.multirank
def test_gpu_check_exits_clearly_without_cuda():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "no CUDA device" in done.stderr


@pytest.mark.multirank
def test_gpu_check_runs_every_section_as_a_cpu_smoke_test(tmp_path):
    """``--device cpu --quick``: the script's every section runs (tiny shapes); no GPU figure."""
    pytest.importorskip("transformers")
    out = tmp_path / "gpu.md"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = out.read_text()
    for section in (
        "## Correctness: batched, torch, loop",
        "## Grouped matmul",
        "## The MoE block",
        "## torch.compile of the MoE block vs eager",
        "## Peak device memory",
        '## dispatch="static": a decode step in a CUDA graph, a compiled training step',
    ):
        assert section in report, section
    assert "torch.compile failed" not in report and "failed:" not in report
    assert "|   2 | train  |" in report and "one graph (fullgraph=True)" in report
    assert report.count("- ok: counts") == 4 and "epmoe <= 0.8x" in report
    cuda_only = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cuda_only.returncode == 1 and "only with --quick" in cuda_only.stderr


@pytest.mark.multirank
def test_bench_checkpoint_quick(capsys):
    """``epmoe bench checkpoint --quick``: every variant measured on 2 ranks, a table printed."""
    pytest.importorskip("transformers")
    assert main(["bench", "checkpoint", "--quick"]) == 0
    out = capsys.readouterr().out
    for variant in ("build then EP", "from_pretrained + EP", "epmoe.from_pretrained", "save_pretrained"):
        assert f"| 2       | {variant}" in out, variant


@pytest.mark.multirank
def test_bench_versus_quick(tmp_path, capsys):
    """``epmoe bench versus --quick``: both systems run on 2 ranks, each one's exactness against the
    unsharded model computed (numbers or the error it raised), every figure's row and the features
    table printed and written. The ratios are the benchmark's, not the test's."""
    pytest.importorskip("transformers.distributed")
    pytest.importorskip("peft")
    out = tmp_path / "versus.md"
    assert main(["bench", "versus", "--quick", "--warmup", "0", "--repeats", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = {
        r[0]: r[1:]
        for r in (
            [c.strip() for c in line.strip("|").split("|")] for line in printed.splitlines() if line.startswith("|")
        )
    }
    for precision in ("fp64, <= 1e-10", "fp32, <= 1e-03"):
        for verdict in rows[f"exact vs the unsharded model (5 AdamW steps, {precision})"][:3]:  # the 3 systems
            assert verdict.startswith(("exact (loss ", "NOT exact (loss ", "error: ")), verdict
    assert all(float(ratio) > 0 for ratio in rows["step time ms (fwd + bwd + AdamW)"][3:5])
    for figure in (
        "peak memory per rank MiB (step)",
        "saved activations per MoE layer KiB",
        "bytes to peers per MoE layer KiB (fwd + bwd)",
        "host reads per MoE layer (fwd + bwd)",
        "collectives per MoE layer (fwd + bwd)",
    ):
        assert all(float(v) >= 0 for v in rows[figure][:2]) and float(rows[figure][2]) > 0, (figure, rows[figure])
    assert any(key.startswith("decode batch 8 ms/token") for key in rows)
    forward_reads = rows["host reads per inference forward (2 MoE layers, 8 tokens)"]
    assert all(int(reads) >= 0 for reads in forward_reads[:3]), forward_reads
    for figure in ("step time ms (fwd + bwd + AdamW)", "decode batch 1 ms/token", "decode batch 8 ms/token"):
        cells = rows[f"shared batch (ep_size = tp_size = 2): {figure}"]
        assert cells[0] == "" and float(cells[1]) > 0 and float(cells[2]) > 0 and float(cells[4]) > 0, cells
    for feature in ("families", "routing replay (RL), load telemetry", "TP mesh (`tp_size > 1`)"):
        assert feature in rows
    assert "epmoe bench versus --quick" in out.read_text()


@pytest.mark.multirank
def test_bench_balance_quick(tmp_path, capsys):
    """``epmoe bench balance --quick``: every workload and arm measured on 2 ranks (rows per rank,
    dropped share, bytes, exactness, the step), the breakdown and the link, written with the command."""
    out = tmp_path / "balance.md"
    assert main(["bench", "balance", "--quick", "--warmup", "0", "--repeats", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in printed.splitlines() if line.startswith("| ")]
    arms = {(r[0], r[1]): r for r in rows if len(r) == 11}
    for workload in ("uniform", "zipf", "hot expert", "hot rank", "recorded"):
        for arm in ("without", "replicas", "LoadBalancer", "capacity 1.0"):
            row = arms[(workload, arm)]
            assert float(row[2]) >= 1.0 and float(row[7]) > 0, row
        assert float(arms[(workload, "replicas")][6]) < 1e-4  # exact to float32 rounding
        assert arms[(workload, "without")][3] == "0.0%"
    assert "flops per link byte" in printed and "epmoe bench balance --quick" in out.read_text()


@pytest.mark.multirank
def test_bench_nodes_quick(tmp_path, capsys):
    """``epmoe bench nodes --quick``: both arms at 2 x 2 and 2 x 4, the bytes between nodes at the
    routing's floor (counts of this routing, true by construction)."""
    out = tmp_path / "nodes.md"
    assert main(["bench", "nodes", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in printed.splitlines() if line.startswith("| 2")]
    assert [(r[0], r[1]) for r in rows] == [
        ("2 x 2", "per-rank"),
        ("2 x 2", "two-level"),
        ("2 x 4", "per-rank"),
        ("2 x 4", "two-level"),
    ]
    for row in rows:
        if row[1] == "two-level":
            assert abs(float(row[5]) - float(row[6])) <= 0.08 and float(row[5]) < 1.0, row
            assert float(row[4]) > 0
    assert "epmoe bench nodes --quick" in out.read_text()
