"""The usual clipping idioms on an EP model: exact through epmoe, or stopped at the next forward.

One spawn of 2 gloo ranks runs every case (tests/training/accelerate_workers.py). Exactness is claimed in
float64 against the same recipe without EP: relative 1e-10, per parameter.
"""

import functools

import pytest
from accelerate_workers import two_rank_checks
from rank_checks import of
from ranks import start_ranks

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

TOL = 1e-10


@functools.lru_cache(maxsize=1)
def results(tmp_dir):
    return start_ranks(two_rank_checks, 2, tmp_dir, timeout=500)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return results(str(tmp_path_factory.mktemp("acc")))


def test_prepared_accelerator_equals_non_ep_accelerate(out):
    """epmoe.prepare_accelerator + accelerator.prepare (DDP) + accelerator.clip_grad_norm_ (it clips at
    every step), AdamW x 4: norms and every parameter equal the unsharded model's accelerate loop."""
    results = of(out, "accelerate")
    assert results[0]["norms"] == results[1]["norms"]
    for rank, result in enumerate(results):
        assert result["distributed"].endswith("MULTI_CPU"), result["distributed"]
        errors = result["errors"]
        assert sum(k.startswith("param/") for k in errors) >= 10 and any(".experts." in k for k in errors)
        assert len([k for k in errors if k.startswith("norm/")]) == 4
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"
        assert min(result["norms"]) > 0.05  # the clip factor mattered at every step
        assert result["replicas_equal"]


@pytest.mark.parametrize("idiom", ["torch_clip", "torch_clip_no_op", "accelerate_unprepared"])
def test_clip_without_epmoe_stops_at_the_next_forward(out, idiom):
    """torch's own clip (also where it clips nothing: it still multiplies by 1.0, and the unsharded
    model might have clipped) and an unprepared accelerator's clip raise on every rank at the forward
    right after the first such step, naming the fix."""
    for result in of(out, idiom):
        assert result["step"] == 1, result
        assert "changed in place by something other than epmoe" in result["error"]
        assert "epmoe.clip_grad_norm_" in result["error"] and "prepare_accelerator" in result["error"]


def test_a_clip_that_saw_one_rank_says_so(out):
    """torch's clip gives each rank its own factor; the message says so, and names the way out."""
    (result, _) = of(out, "torch_clip")
    assert "by a different factor on each rank (rank 0: " in result["error"], result["error"]
    (result, _) = of(out, "torch_clip_no_op")
    assert "by a multiply by 1.0 on every rank" in result["error"], result["error"]
    assert "check_steps=False" in result["error"] and "same factor on every rank" in result["error"]


def test_the_same_factor_on_every_rank_runs_on(out):
    """Every gradient divided by the global token count (twinkle's normalisation), then epmoe's clip or
    none: one factor on every rank, the step is the unsharded model's scaled the same way."""
    for idiom in ("token_count_then_epmoe", "token_count_only"):
        for result in of(out, idiom):
            assert result["step"] is None and result["error"] is None and result["replicas_equal"], (idiom, result)


def test_a_scale_by_a_factor_per_rank_stops(out):
    for result in of(out, "per_rank_scale"):
        assert result["step"] == 1, result
        assert "by a different factor on each rank (rank 0: 0.5, rank 1: 0.75)" in result["error"], result["error"]


def test_check_steps_off_turns_the_gradient_check_off_not_the_fingerprint(out):
    """check_steps=False: torch's clip is not stopped at the forward after it, but the replicas it made
    drift apart (each rank scaled the all-reduced gradients by its own factor) are, by the fingerprint."""
    for result in of(out, "torch_clip_unchecked"):
        assert result["step"] == 1, result
        assert "replicated (non-expert) parameters differ" in result["error"], result["error"]


def test_drifted_replicas_stop_at_the_next_forward(out):
    """One rank's replicated weight nudged by one ulp after step 1: both ranks raise at step 2."""
    for result in of(out, "drift"):
        assert result["step"] == 2, result
        assert "replicated (non-expert) parameters differ" in result["error"], result["error"]


def test_epmoe_clip_and_in_place_zeroing_run_on(out):
    for result in of(out, "epmoe_then_zero_in_place"):
        assert result["step"] is None and result["error"] is None and result["replicas_equal"], result


def test_unprepared_trainer_stops_after_its_first_step(out):
    for result in of(out, "trainer_unprepared"):
        assert result["step"] == 1, result
        assert "prepare_trainer" in result["error"], result["error"]


def test_prepare_accelerator_validates():
    import epmoe

    with pytest.raises(TypeError, match="accelerate.Accelerator"):
        epmoe.prepare_accelerator(object())
