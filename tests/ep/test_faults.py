"""Fault injection on real gloo ranks: every fault ends in a clear error on every rank, within a bound.

The fault table of docs/failures.md is this file's list: ranks that disagree, ranks out of step, a rank
that raises and stays alive, a rank that dies (SIGKILL, ``os._exit``) in forward, backward or inside the
fused pipeline, random routings; and the single-process refusals (double backward, meta tensors,
oversized messages). ``torch.compile`` of an fp32 model running and matching eager is proven in
tests/training/test_compile.py (EP 1 and 2, logits, loss and every gradient).
"""

import json

import pytest
import torch
from fault_workers import agreement_run, dying_run, out_of_step_run, random_routings_run
from ranks import start_ranks

import epmoe
from epmoe.launch import RankError
from epmoe.models import build_model


def spawned(fn, world, *args, timeout=240):
    """One run per function, world and arguments, shared by the tests that read it."""
    return start_ranks(fn, world, *args, timeout=timeout, once=True)


AGREEMENT = {
    "recv_counts_permuted/pipelined": "split differently over its experts",
    "recv_counts_permuted/reference": "split differently over its experts",
    "recv_counts_moved/pipelined": "rank 1 expects 6 rows from rank 0, which sends 5",
    "recv_counts_moved/reference": "rank 1 expects 6 rows from rank 0, which sends 5",
    "num_chunks": "number of rounds",
    "dtype": "disagree on the dtype: ['torch.float64', 'torch.float32']",
    "width": "disagree on the exchanged row width: [8, 12]",
    "recv_counts_too_long": "recv_counts",
    "recv_counts_too_short": "recv_counts",
    "gmm_alltoallv_send_counts_permuted": "gmm_alltoallv(recv_counts)",
    "exchange_counts_lengths": "differ in length: [4, 6]",
    "exchange_counts_negative": "negative counts on rank(s) [1]",
    "exchange_counts_invalid_on_one_rank": "rank(s) [1] passed an invalid histogram",
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(AGREEMENT))
def test_disagreeing_arguments_raise_value_error_on_every_rank(case):
    results = spawned(agreement_run, 2)
    for rank, outcome in enumerate(results):
        seen = outcome[case]
        assert seen["type"] == "ValueError", (rank, seen)
        assert seen["seconds"] < 10, (rank, seen)
        if case == "exchange_counts_invalid_on_one_rank" and rank == 1:
            assert "is not a positive multiple of the group size" in seen["message"], seen  # its own error
        elif case.startswith("recv_counts_too") and rank == 1:
            assert "expected W*e" in seen["message"], seen  # its own error, in full
        elif case.startswith("recv_counts_too"):
            assert "rank(s) [1] rejected their input" in seen["message"], seen
        else:
            assert AGREEMENT[case] in seen["message"], (rank, seen)
    assert all(len(outcome["exchange_counts_negative"]["message"]) < 400 for outcome in results)
    assert all(outcome["healthy_after"]["type"] is None for outcome in results), results


OUT_OF_STEP = {
    "skip_backward": [
        "backward of blocks.1.experts (experts module 1), forward call #1",
        "forward of blocks.0.experts (experts module 0), forward call #2",
    ],
    "skip_layer": [
        "forward of blocks.0.experts (experts module 0), forward call #1",
        "forward of blocks.1.experts (experts module 1), forward call #1",
    ],
    "skip_step": ["forward of blocks.0.experts (experts module 0), forward call #2", "clip_grad_norm_ #2"],
}
RAISE_TIMEOUT = 4.0


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(OUT_OF_STEP))
def test_ranks_out_of_step_raise_on_every_rank_naming_both_positions(case):
    results = spawned(out_of_step_run, 2, RAISE_TIMEOUT)
    for rank, outcome in enumerate(results):
        seen = outcome[case]
        assert seen["type"] == "OutOfStepError", (rank, seen)
        assert all(position in seen["message"] for position in OUT_OF_STEP[case]), (rank, seen)
        assert seen["seconds"] < 10
        assert outcome["in_step"]["type"] is None, outcome["in_step"]


@pytest.mark.multirank
def test_a_rank_that_raises_and_stays_alive_ends_the_others_wait_within_the_timeout():
    survivor, raiser = spawned(out_of_step_run, 2, RAISE_TIMEOUT)
    seen = survivor["raise_and_stay_alive"]
    assert seen["type"] == "RuntimeError", seen
    assert "ExpertParallelConfig.timeout = 4 s" in seen["message"] and "forward of blocks.0.experts" in seen["message"]
    assert RAISE_TIMEOUT - 0.5 < seen["seconds"] < RAISE_TIMEOUT + 10, seen
    assert raiser["raise_and_stay_alive"]["type"] is None


KILLED = "rank 1 died, killed by SIGKILL (exit code -9)"
DYING = {"forward": KILLED, "backward": KILLED, "fused": KILLED, "exit": "rank 1 died with exit code 3"}


@pytest.mark.multirank
@pytest.mark.parametrize("where", sorted(DYING))
def test_a_dying_rank_is_blamed_and_the_survivor_raises_within_10_s(where, tmp_path):
    with pytest.raises(RankError) as info:
        start_ranks(dying_run, 2, where, str(tmp_path), timeout=240)
    message = str(info.value)
    assert message.startswith(DYING[where]), message
    assert "then rank 0 failed" in message, message
    died = json.loads((tmp_path / "died.json").read_text())
    survivor = json.loads((tmp_path / "rank0.json").read_text())
    assert survivor["type"] == "RuntimeError", survivor
    assert survivor["time"] - died["time"] < 10, (survivor, died)


@pytest.mark.multirank
@pytest.mark.parametrize("world,num_experts", [(2, 8), (3, 6)])
def test_random_routings_match_the_unsharded_layer_in_fp64(world, num_experts):
    seen = spawned(random_routings_run, world, num_experts, 12)[0]
    assert seen["examples"] == 12 and seen["worst"] < 1e-10, seen
    assert seen["empty_ranks"] and seen["one_expert"] and seen["duplicates"], seen  # the bad cases were drawn


# --------------------------------------------------------------------------------------------
# single process
# --------------------------------------------------------------------------------------------


def test_double_backward_is_refused_by_name():
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    y = epmoe.grouped_mm(x, w, [2, 4])
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=False)  # a first-order gradient is fine
    assert g.shape == x.shape
    with pytest.raises(RuntimeError, match="epmoe grouped_mm: double backward"):
        torch.autograd.grad(epmoe.grouped_mm(x, w, [2, 4]).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="epmoe alltoallv_gmm: double backward"):
        out, _, _ = epmoe.alltoallv_gmm(x, w, [2, 4], [2, 4])
        torch.autograd.grad(out.square().sum(), x, create_graph=True)


def test_meta_counts_and_meta_models_raise_value_error():
    meta = torch.ones(4, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        epmoe.exchange_counts(meta)
    with pytest.raises(ValueError, match="meta device"):
        epmoe.grouped_mm(torch.randn(4, 3), torch.randn(4, 3, 2), meta)
    with torch.device("meta"):
        model = build_model("qwen3_moe", num_experts=4)
    epmoe.apply_expert_parallel(model)
    with pytest.raises(ValueError, match="meta device: an EP model cannot run before its weights exist"):
        model(torch.zeros(1, 4, dtype=torch.int64, device="meta"))


def test_messages_about_many_counts_stay_short():
    counts = [1] * 20_000
    counts[7] = counts[12_000] = -1
    with pytest.raises(ValueError) as info:
        epmoe.grouped_mm(torch.randn(19_996, 2), torch.randn(20_000, 2, 2), counts)
    assert len(str(info.value)) < 300 and "index 7 (-1), index 12000 (-1)" in str(info.value)


def test_timeout_and_check_steps_are_validated():
    for bad in (0, -1, float("inf"), True, "300"):
        with pytest.raises(ValueError, match="timeout"):
            epmoe.ExpertParallelConfig(timeout=bad)
    with pytest.raises(ValueError, match="check_steps"):
        epmoe.ExpertParallelConfig(check_steps="always")
    from epmoe.comm.steps import step_timeout_s

    assert step_timeout_s(5, None) == 5.0  # a configured timeout is taken as is
