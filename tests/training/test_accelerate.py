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
