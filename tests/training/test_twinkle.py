"""twinkle's own steps through epmoe.prepare_twinkle equal the unsharded model's, in twinkle's own pins.

twinkle-kit pins peft <= 0.19, below the test extras' peft, so its cases run in ``.venv-twinkle``
(``scripts/setup.sh test`` builds it from constraints/twinkle.txt): one start of 2 gloo ranks
(tests/training/twinkle_workers.py) trains a float64 Qwen3-MoE through twinkle's ``TransformersModel``
(native FSDP2) unsharded and with epmoe, 3 steps of ``forward_backward`` + ``clip_grad_and_step``,
ranks of different batch sizes, every step clipped. The adapter twinkle saves is reloaded here, with
plain transformers and this environment's peft.
"""

import json
import os
import pathlib
import subprocess

import pytest

pytestmark = pytest.mark.multirank

HERE = pathlib.Path(__file__).resolve().parent
TWINKLE_PYTHON = HERE.parents[1] / ".venv-twinkle" / "bin" / "python"
TOL = 1e-10
MAX_NORM = 0.05  # twinkle_workers.MAX_NORM


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    assert TWINKLE_PYTHON.exists(), "scripts/setup.sh test builds .venv-twinkle (twinkle-kit with its own pins)"
    out = tmp_path_factory.mktemp("twinkle")
    env = {**os.environ, "EPMOE_START_METHOD": "spawn"}
    proc = subprocess.run(
        [str(TWINKLE_PYTHON), str(HERE / "twinkle_workers.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=HERE,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out, json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def ep_dp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("twinkle-ep-dp")
    proc = subprocess.run(
        [str(TWINKLE_PYTHON), str(HERE / "twinkle_workers.py"), str(out), "--ep-dp"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "EPMOE_START_METHOD": "spawn"},
        cwd=HERE,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "results.json").read_text())


def of(run, case):
    found = [by_case[case] for by_case in run[1]]
    for rank, result in enumerate(found):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return found


def test_the_environment_has_twinkles_own_pins(run):
    for versions in of(run, "versions"):
        assert versions["twinkle-kit"] == "0.5.1" and versions["peft"].startswith("0.19"), versions


def test_full_training_equals_the_unsharded_model(run):
    """fp64, 3 steps, every parameter (this rank's experts against the unsharded model's), and twinkle's
    reported norms, which clip every step."""
    for rank, result in enumerate(of(run, "full")):
        errors = result["errors"]
        assert len(errors) == 25 and any(".experts." in name for name in errors), sorted(errors)
        assert max(errors.values()) <= TOL, (rank, {k: v for k, v in errors.items() if v > TOL})
        norms, ref_norms = result["norms"]
        assert norms == pytest.approx(ref_norms, rel=1e-12) and min(norms) > MAX_NORM, result["norms"]


def test_ep_smaller_than_twinkles_mesh(ep_dp_run):
    """4 ranks, DeviceMesh(ep_size=2): EP groups strided as twinkle's own ({0, 2}, {1, 3}), each expert
    on two ranks, ranks of 4 batch sizes; 3 clipped steps equal the unsharded model (FSDP2 over 4)."""
    for rank, result in enumerate(ep_dp_run):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        assert result["ep_groups"] == [[0, 2] if rank in (0, 2) else [1, 3]], result["ep_groups"]
        assert len(result["errors"]) == 25 and max(result["errors"].values()) <= TOL, (rank, result["errors"])
        norms, ref_norms = result["norms"]
        assert norms == pytest.approx(ref_norms, rel=1e-12) and min(norms) > MAX_NORM, result["norms"]


def test_twinkles_full_save_reloads_whole_in_plain_transformers(run):
    for rank, result in enumerate(of(run, "full")):
        assert result["saved_keys_missing"] == [] and len(result["saved_errors"]) == 25, result["saved_keys_missing"]
        assert max(result["saved_errors"].values()) <= TOL, (rank, result["saved_errors"])


def test_twinkles_accelerate_strategy_equals_the_unsharded_model(run):
    """The accelerate strategy (accelerate's DDP) through prepare_twinkle: every parameter, the norms and
    the saved checkpoint equal the unsharded model's (twinkle's native FSDP2 run without EP). twinkle's own
    DDP run is no oracle: its clip counts DDP's replicated gradients once per rank, sqrt(2) x the norm."""
    for rank, result in enumerate(of(run, "accelerate")):
        assert len(result["errors"]) == 25 and max(result["errors"].values()) <= TOL, (rank, result["errors"])
        norms, ref_norms = result["norms"]
        assert norms == pytest.approx(ref_norms, rel=1e-12) and min(norms) > MAX_NORM, result["norms"]
        assert len(result["saved_errors"]) == 25 and max(result["saved_errors"].values()) <= TOL
        assert result["twinkle_ddp_norm_ratio"][0] == pytest.approx(2**0.5, rel=1e-6)


def test_twinkles_gradient_accumulation_equals_the_unsharded_model(run):
    """gradient_accumulation_steps=2 on twinkle's calls, 5 micro-batches: the steps twinkle takes where
    its counter says so (clipped, the expert gradients accumulated over micro-batches) are exact."""
    for rank, result in enumerate(of(run, "accumulation")):
        assert len(result["errors"]) == 25 and max(result["errors"].values()) <= TOL, (rank, result["errors"])
        assert any(".experts." in name for name in result["trained"]) and len(result["trained"]) >= 20, result


def test_trainable_counts_count_every_expert_once(run):
    for case in ("full", "lora"):
        for result in of(run, case):
            counted, unsharded = result["counts"]
            assert counted == unsharded, (case, result["counts"])


def test_lora_starts_from_the_unsharded_models_factors_on_twinkles_peft(run):
    """peft 0.19 reads the shard's shape; added through twinkle's add_adapter_to_model the expert factors
    are still the unsharded model's (this rank's experts of them), and so are the first gradients."""
    for rank, result in enumerate(of(run, "lora")):
        assert len(result["expert_factors"]) == 8, result["expert_factors"]  # 2 layers x 2 tensors x (A, B)
        assert len(result["start"]) == 16 and max(result["start"].values()) == 0.0, (rank, result["start"])
        assert max(result["first_grads"].values()) <= TOL, (rank, result["first_grads"])
        assert any(".experts." in name for name in result["first_grads"])


def test_lora_training_equals_the_unsharded_model(run):
    for rank, result in enumerate(of(run, "lora")):
        assert max(result["errors"].values()) <= TOL, (rank, result["errors"])
        norms, ref_norms = result["norms"]
        assert norms == pytest.approx(ref_norms, rel=1e-12) and min(norms) > MAX_NORM, result["norms"]


def test_twinkles_adapter_save_reloads_whole_with_peft(run):
    """twinkle's model.save of the adapter (written by rank 0 from the strategy's adapter state dict)
    holds every expert's factors: loaded into peft's model on plain transformers, every factor equals
    the unsharded run's trained one."""
    for rank, result in enumerate(of(run, "lora")):
        assert len(result["saved_errors"]) == 16, sorted(result["saved_errors"])
        assert max(result["saved_errors"].values()) <= TOL, (rank, result["saved_errors"])


def test_what_prepare_twinkle_cannot_serve_is_refused_by_name(run):
    for result in of(run, "refusals"):
        assert "expected a twinkle TransformersModel, got Linear" in result["not_twinkle"]
        assert "twinkle's own expert parallelism" in result["own_ep"]
        assert "twinkle-kit 0.5.1 is installed; prepare_twinkle was made for 0.4.0" in result["other_version"]


def test_epmoes_grouped_matmul_as_the_compute_of_twinkles_own_ep(run):
    """register_grouped_mm: twinkle's own EP computes with epmoe's grouped matmul, the loss and every
    gradient its per-expert loop's; its expert gradients stay twinkle's, 2x the unsharded model's
    (summed over the EP group of 2, not averaged), the caveat the docs state, measured here."""
    for result in of(run, "own_ep"):
        gmm, loop, unsharded = result["losses"]
        assert gmm == loop == pytest.approx(unsharded, rel=1e-12)
        assert len(result["gmm_vs_loop"]) == 25 and max(result["gmm_vs_loop"].values()) <= TOL
        assert result["expert_grad_ratio"] == pytest.approx([2.0] * 4, rel=1e-12)
        assert result["dense_vs_unsharded"] <= TOL


def test_older_peft_outside_prepare_twinkle_is_refused_not_trained_from_another_start(run):
    for result in of(run, "plain_peft"):
        message = result["refused"]
        assert message is not None and "from this rank's shard (4 of 8 experts)" in message, message
        assert "peft 0.19" in message and "whole_experts_for_peft" in message, message


def test_prepare_twinkle_without_twinkle_says_how_to_install():
    import epmoe

    with pytest.raises(TypeError, match=r"pip install epmoe\[twinkle\]"):
        epmoe.prepare_twinkle(object())
