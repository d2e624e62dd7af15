"""Training parity (the seed's own validation) and the ``epmoe demo`` / ``epmoe info`` commands."""

import time

import pytest

from epmoe.cli import main
from epmoe.demo import TrainOptions, train_parity
from epmoe.launch import run_ranks


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_training_loss_curves_match_with_and_without_ep(family):
    """24 AdamW steps on 2 ranks: the EP loss curve equals the non-EP one to fp32 tolerance."""
    result = run_ranks(train_parity, 2, TrainOptions(family=family, steps=24, seq_len=16), timeout=300)[0]
    losses_ep = [r.loss_ep for r in result.records]
    losses_ref = [r.loss_ref for r in result.records]
    assert len(losses_ep) == 24
    assert losses_ep[-1] < losses_ep[0] - 0.1  # it trains
    assert result.reload_error <= 1e-5  # the trained EP model's checkpoint, reloaded without EP
    for step, (a, b) in enumerate(zip(losses_ep, losses_ref)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: {a} vs {b}"


@pytest.mark.multirank
def test_training_through_trainer_matches_without_ep():
    """``trainer=True``: both models through transformers.Trainer (EP via prepare_trainer): equal loss curves."""
    result = run_ranks(train_parity, 2, TrainOptions(steps=4, seq_len=16, trainer=True), timeout=300)[0]
    assert [r.step for r in result.records] == [0, 1, 2, 3]
    assert result.reload_error <= 1e-5  # the trained EP model's checkpoint, reloaded without EP
    for r in result.records:
        assert abs(r.loss_ep - r.loss_ref) <= 1e-5 * abs(r.loss_ref), r
        assert r.time_ep > 0 and r.time_ref > 0


@pytest.mark.multirank
def test_demo_command_prints_table_and_writes_plot(tmp_path, capsys):
    """With --balance: the EP model's LoadBalancer mirrored on the reference keeps the losses equal, and
    the reload (biases mirrored too) gives the same logits."""
    assert main(["demo", "--steps", "4", "--balance", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "loss (EP)" in out and "loss (no EP)" in out and "|diff|" in out and "max/mean expert load" in out
    assert "grouped-matmul backend: torch" in out and "DistributedDataParallel + gradient clipping" in out
    assert "expert load max/mean of 5-step windows (mean over layers): steps 0-3 " in out and "(LoadBalancer on)" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "ms" in line]
    assert len(rows) == 4 and all(float(row[3]) < 1e-5 for row in rows), rows  # |diff| with balancing
    assert all(len(row) == 8 and all(float(x) >= 1.0 for x in row[6:]) for row in rows), rows  # 2 layers' imbalance
    reload = float(out.split("max relative logits difference ")[1].split()[0])
    assert reload < 1e-5, reload
    for name in ("loss", "load"):
        png = tmp_path / f"demo-qwen3_moe-{name}.png"
        assert png.stat().st_size > 1000 and str(png) in out


@pytest.mark.multirank
def test_demo_trainer_command(tmp_path, capsys):
    assert main(["demo", "--trainer", "--steps", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "loss (EP)" in out and "transformers.Trainer (epmoe.prepare_trainer on the EP side)" in out
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


def test_info_lists_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "communication backend: gloo" in out
    assert "npu      declines: torch_npu is not installed" in out
    assert "loop     eligible" in out
