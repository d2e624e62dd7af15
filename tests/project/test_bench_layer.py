"""``epmoe bench layer``: the EP=1 smoke run through the CLI, the EP=2 smoke run on 2 gloo ranks, part
lean's EP 1 half in one process and the whole part through the CLI."""

import argparse

import pytest
import torch

pytest.importorskip("transformers")

from epmoe.bench import common, layer, lean  # noqa: E402
from epmoe.cli import main  # noqa: E402


@pytest.fixture
def one_thread():
    """The smoke runs use one thread (no OpenMP barriers to stall on a busy machine), then restore."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _table(printed: str, headers: tuple) -> list[list[str]]:
    """The rows of the printed markdown table whose header is ``headers``."""
    lines = printed.splitlines()
    header = next(
        i
        for i, line in enumerate(lines)
        if line.startswith("|") and [c.strip() for c in line.strip("|").split("|")] == list(headers)
    )
    rows = []
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_bench_layer_quick_ep1(tmp_path, capsys, one_thread):
    out = tmp_path / "layer.md"
    assert main(["bench", "layer", "--quick", "--threads", "1", "--part", "ep1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = _table(printed, layer.EP1_HEADERS)
    assert [r[1] for r in rows] == [layer.EAGER, layer.GROUPED, layer.EPMOE, layer.DENSE]
    assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in rows)
    assert next(r for r in rows if r[1] == layer.EPMOE)[4] == "1.00"
    split = _table(printed, layer.SPLIT_HEADERS)
    assert [r[1] for r in split[:2]] == [
        "grouped matmuls (gate_up + down, fwd + bwd), in the step",
        "outside the grouped matmuls, in the step",
    ] and len(split) == 5
    in_step = [float(r[3].rstrip("%")) for r in split[:2]]
    assert all(0 <= share <= 100 for share in in_step) and 99 <= sum(in_step) <= 101  # shares of one step
    assert in_step[0] > 0  # the profile sees the grouped matmuls wherever they run (inside routed_mlp too)
    assert all(r[3].endswith("x") and "timed alone" in r[1] for r in split[2:])  # isolated: a ratio, not a share
    assert "(goal <= 0.85)" in printed and "share of the epmoe step outside its grouped matmuls" in printed

    document = out.read_text()
    assert "epmoe bench layer --quick --device cpu --threads 1" in document and "--part ep1" in document
    assert f"torch {torch.__version__}" in document and "transformers 5." in document


def test_ep1_variants_agree_with_eager(one_thread):
    torch.set_num_threads(1)
    settings = common.Settings(device=torch.device("cpu"), threads=1, warmup=0, repeats=1, seed=0, quick=True, out=None)
    result = layer.run_ep1(layer.QUICK_SHAPES[0], settings)
    assert set(result.max_rel_diff) == {layer.GROUPED, layer.EPMOE}
    assert all(diff < 1e-5 for diff in result.max_rel_diff.values())
    assert sum(result.counts) == layer.QUICK_SHAPES[0].rows


@pytest.mark.multirank
def test_ep2_quick_losses_match_the_unsharded_model(one_thread):
    settings = common.Settings(device=torch.device("cpu"), threads=2, warmup=0, repeats=1, seed=0, quick=True, out=None)
    report = layer.run_ep2(layer.QUICK_SHAPES[0], settings)
    for label in (layer.EPMOE_DDP, layer.REPLICATED_DDP, layer.EPMOE_TRAINER, layer.REPLICATED_TRAINER):
        assert report.steps_ms[label] > 0, label
        assert report.loss_diffs[label] < 1e-5, label
    # transformers' own EP either ran (and then matches too) or its failure is reported, not hidden
    assert "transformers EP" in report.steps_ms or "transformers EP" in report.errors
    if "transformers EP" in report.steps_ms:
        assert report.loss_diffs["transformers EP"] < 1e-5
    text = report.markdown()
    assert "### EP size 2" in text and "epmoe Trainer step / replicated Trainer step" in text


def test_shape_flops():
    shape = layer.Shape("s", num_experts=4, top_k=2, hidden=8, intermediate=4, tokens=16)
    assert shape.rows == 32
    assert shape.flops == 3 * 2 * 32 * (8 * 8 + 4 * 8)


def test_unknown_part_is_rejected(capsys):
    parser = argparse.ArgumentParser()
    layer.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--part", "ep3"])
    assert "--part" in capsys.readouterr().err


@pytest.mark.multirank
@pytest.mark.timeout(900)  # compiling from a cold inductor cache takes minutes on 2 cores
def test_compile_quick_rows(one_thread):
    """Part compile: every row compiled and checked against eager; EP=1 traces whole, EP=2 breaks at
    the exchange only."""
    from epmoe.bench.compiled import run_compile

    settings = common.Settings(device=torch.device("cpu"), threads=2, warmup=1, repeats=1, seed=0, quick=True, out=None)
    report = run_compile(layer.QUICK_SHAPES, settings)
    assert [row.label for _, row in report.blocks] == [layer.EPMOE, layer.GROUPED]
    assert [row.label for row in report.steps] == ["epmoe, EP=1, one process", "epmoe, EP=2, 2 gloo ranks"]
    for row in [row for _, row in report.blocks] + report.steps:
        assert row.eager_ms > 0 and row.compiled_ms > 0 and row.grad_diff < 1e-5, row
    ep1, ep2 = report.steps
    assert ep1.sites == [] and ep1.graphs == 1
    assert ep2.sites == ["Skip calling `torch.compiler.disable()`d function (routed_experts)"]
    assert "compiled / eager" in report.markdown()


def test_lean_ep1_keeps_the_bound_and_times_both_blocks(one_thread):
    """Part lean at EP 1: epmoe keeps H + 2KI + E plus a few elements per routing choice (its indices
    and weights), transformers' grouped_mm block at least K(2H + 4I); both steps timed."""
    torch.set_num_threads(1)
    settings = common.Settings(device=torch.device("cpu"), threads=1, warmup=0, repeats=2, seed=0, quick=True, out=None)
    shape = lean.QUICK_PLAN.shapes[0]
    H, I, K, E = shape.hidden, shape.intermediate, shape.top_k, shape.num_experts
    assert [value for _, value in lean.kept_formulas(shape)] == [
        K * (2 * H + 4 * I),
        K * (H + 3 * I),
        K * (H + 2 * I),
        H + 2 * K * I,
        H + 2 * K * I + E,
    ]
    result = lean.run_ep1(shape, settings)
    assert H + 2 * K * I + E <= result.saved[layer.EPMOE] <= H + 2 * K * I + E + 10 * K
    assert result.saved[layer.GROUPED] >= K * (2 * H + 4 * I)
    assert result.peak_bytes == {layer.GROUPED: None, layer.EPMOE: None}  # no device memory on the CPU
    assert all(len(t.samples_s) == 2 and t.median_s > 0 for t in result.timings.values())
    assert len(result.round_ratios()) == 2 and "goal: no slower beyond noise" in result.step_verdict()


@pytest.mark.multirank
def test_bench_layer_quick_lean(tmp_path, capsys, one_thread):
    """The whole part on the quick plan: every table's rows present, epmoe below transformers' block
    in saved elements, below the per-slot layout on the wire, first losses equal to the unsharded model's."""
    out = tmp_path / "lean.md"
    assert main(["bench", "layer", "--quick", "--threads", "2", "--part", "lean", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    shapes = {shape.name: shape for shape in lean.QUICK_PLAN.shapes}

    saved = _table(printed, lean.SAVED_HEADERS)
    assert len(saved) == len(shapes) * 7
    for name, _shape in shapes.items():
        rows = {r[1]: float(r[2]) for r in saved if r[0] == name}
        epmoe, grouped = rows[f"{layer.EPMOE} block, measured"], rows[f"{layer.GROUPED} block, measured"]
        assert rows["SonicMoE: H + 2KI"] < epmoe < rows["Megatron-Core, moe_act recompute: K(H + 2I)"] < grouped

    wire = _table(printed, lean.WIRE_HEADERS)
    assert sorted((r[0], int(r[1])) for r in wire) == sorted((n, w) for n in shapes for w in lean.WIRE_RANKS)
    for name, ep_size, _tokens, d, measured, rows_only, per_slot, ratio in wire:
        assert 1 <= float(d) <= min(shapes[name].top_k, int(ep_size))
        assert float(rows_only) < float(measured) < float(per_slot) and float(ratio) < 1, (name, ep_size)

    steps = _table(printed, lean.EP1_STEP_HEADERS)
    assert [(r[0], r[1]) for r in steps] == [(n, v) for n in shapes for v in (layer.GROUPED, layer.EPMOE)]
    assert all(float(r[2]) > 0 for r in steps)

    ep2 = {r[0]: r for r in _table(printed, lean.STEP_HEADERS)}
    assert list(ep2) == [lean.A2A, lean.PER_SLOT, lean.TRANSFORMERS_EP]
    for label in (lean.A2A, lean.PER_SLOT):
        assert float(ep2[label][1]) > 0 and float(ep2[label][3]) < 1e-5, label
    # transformers' own EP either ran (and then matches too) or its failure is reported, not hidden
    assert ep2[lean.TRANSFORMERS_EP][1] == "-" or float(ep2[lean.TRANSFORMERS_EP][3]) < 1e-5
    assert "epmoe all-to-all-v step / per-slot step" in printed and "goal <= 0.85)" in printed
    assert "the floor of the ratio from the bytes alone" in printed  # the exchanges timed alone

    document = out.read_text()
    assert "epmoe bench layer --quick --device cpu --threads 2" in document and "--part lean" in document
    assert "Part lean:" not in document and "Megatron-Core" in document  # lean's own description and shapes only
