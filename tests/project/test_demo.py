"""The ``epmoe demo`` / ``epmoe info`` commands: the demo runs, trains, prints its table, writes its plots
and reloads its checkpoint. EP-vs-non-EP training parity itself is proven per parameter at 1e-10 in
tests/training/test_training.py (DDP, clipping, Trainer) and tests/ep/test_ep_parity.py (every family)."""

import time

import pytest

from epmoe.cli import main


def _table_rows(out):
    """The demo's per-step table: ``[step, loss EP, loss no EP, |diff|, time EP, time no EP, loads...]``."""
    return [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "ms" in line]


def _reload_error(out):
    """The printed max relative logits difference of the trained EP model's checkpoint reloaded without EP."""
    return float(out.split("max relative logits difference ")[1].split()[0])


@pytest.mark.multirank
def test_demo_command_prints_table_and_writes_plot(tmp_path, capsys):
    """24 steps with --balance: it trains (the loss drops); the EP model's LoadBalancer mirrored on the
    reference keeps the losses equal, and the reload (biases mirrored too) gives the same logits."""
    assert main(["demo", "--steps", "24", "--balance", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "loss (EP)" in out and "loss (no EP)" in out and "|diff|" in out and "max/mean expert load" in out
    assert "grouped-matmul backend: torch" in out and "DistributedDataParallel + gradient clipping" in out
    assert "expert load max/mean of 5-step windows (mean over layers): steps 0-4 " in out and "(LoadBalancer on)" in out
    assert "steps 20-23 " in out
    rows = _table_rows(out)
    assert [int(row[0]) for row in rows] == list(range(24)), rows
    assert all(float(row[3]) < 1e-5 for row in rows), rows  # |diff| with balancing
    # the most loaded rank's rows over the mean, then 2 layers' expert imbalance
    assert all(len(row) == 9 and all(float(x) >= 1.0 for x in row[6:]) for row in rows), rows
    assert "rows computed per rank, max/mean (the most skewed layer, mean over steps): " in out
    assert float(rows[-1][1]) < float(rows[0][1]) - 0.1, rows  # it trains
    reload = _reload_error(out)
    assert reload < 1e-5, reload
    for name in ("loss", "load"):
        png = tmp_path / f"demo-qwen3_moe-{name}.png"
        assert png.stat().st_size > 1000 and str(png) in out


@pytest.mark.multirank
def test_demo_trainer_command(tmp_path, capsys):
    """``--trainer`` (with ``--replicas 2``): both models through transformers.Trainer; the table, the reload
    check and the plot."""
    assert main(["demo", "--trainer", "--replicas", "2", "--steps", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "loss (EP)" in out and "transformers.Trainer (epmoe.prepare_trainer on the EP side)" in out
    rows = _table_rows(out)
    assert [int(row[0]) for row in rows] == [0, 1], rows
    assert all(float(row[4].removesuffix("ms")) > 0 and float(row[5].removesuffix("ms")) > 0 for row in rows), rows
    reload = _reload_error(out)
    assert reload <= 1e-5, reload  # the trained EP model's checkpoint, reloaded without EP
    assert (tmp_path / "demo-qwen3_moe-loss.png").exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["demo", "--nproc", "0"], "--nproc"),
        (["demo", "--model", "llama"], "--model"),
        (["demo", "--dtype", "int8"], "--dtype"),
        (["demo", "--gmm-backend", "fastest"], "gmm_backend"),
        (["demo", "--device", "tpu"], "--device"),
        (["demo", "--steps", "0"], "--steps"),
        (["demo", "--nproc", "3"], "--nproc: 3 ranks cannot share the demo model's 32 experts"),
        (["demo", "--timeout", "0"], "--timeout"),
        (["demo", "--trainer", "--balance"], "--balance: not supported with --trainer"),
        (["demo", "--replicas", "-1"], "ExpertParallelConfig(replicas)"),
    ],
)
def test_demo_bad_options_fail_clearly(argv, message, capsys):
    started = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and time.monotonic() - started < 5  # one line, before any rank starts


def test_demo_out_that_is_a_file_fails_before_running(tmp_path, capsys):
    out = tmp_path / "plot.png"
    out.write_text("not a directory")
    started = time.monotonic()
    assert main(["demo", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out: {out} exists and is not a directory" in err and err.count("\n") == 1
    assert time.monotonic() - started < 5


def test_demo_out_that_cannot_be_written_fails_before_running(capsys):
    started = time.monotonic()
    assert main(["demo", "--out", "/proc"]) == 2  # a directory no one can create files in, root included
    err = capsys.readouterr().err
    assert "--out: cannot write in /proc" in err and err.count("\n") == 1
    assert time.monotonic() - started < 5


def test_info_lists_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "communication backend: gloo" in out
    assert "npu      declines: torch_npu is not installed" in out
    assert "loop     eligible" in out
