"""The expert-parallel engine at the experts-module level, and the ``apply_expert_parallel`` contract.

A transformers experts module (Qwen3-MoE: ``nn.Linear`` layout, SiLU gate; GPT-OSS: transposed,
biased, interleaved clamped gate) is sharded and called directly with crafted routing; the oracle is
a copy taken before sharding, running transformers' eager forward on every rank's inputs
concatenated. Several scenarios share one spawned run (see ``ep_layer_workers``).
"""

import copy
import time

import pytest
import torch
from ep_layer_workers import (
    CASES_2,
    bad_index_shape_run,
    base_model,
    experts_of,
    four_rank_run,
    make_inputs,
    max_rel,
    run_module,
    two_rank_run,
)
from ranks import start_ranks
from torch import nn

import epmoe
from epmoe.ep.layer import expert_parallel_forward
from epmoe.launch import RankError

TOL = {"float64": 1e-12, "bfloat16": 3e-2}


def spawned(fn, world):
    """One spawned run per function, shared by its tests."""
    return start_ranks(fn, world, timeout=180, once=True)


@pytest.fixture
def two_ranks():
    return spawned(two_rank_run, 2)


@pytest.fixture
def four_ranks():
    return spawned(four_rank_run, 4)


def assert_case(results, label):
    tol = TOL["bfloat16" if "bf16" in label else "float64"]
    for rank, result in enumerate(results):
        case = result["cases"][label]
        assert case["errors"], f"rank {rank}: nothing compared"
        for key, err in case["errors"].items():
            assert err <= tol, f"rank {rank} {label}: {key} relative error {err:.3g} > {tol}"
        for key, nonzero in case["exact_zero"].items():
            assert nonzero == 0, f"rank {rank} {label}: expert without tokens has {nonzero} nonzero grads in {key}"


TWO_RANK_LABELS = (
    [f"qwen3_moe/default/{name}" for name in CASES_2]
    + [f"gpt_oss/default/{name}" for name in CASES_2]
    + [
        f"{variant}/{name}"
        for variant in (
            "qwen3_moe/new_group",
            "qwen3_moe/mesh_1d",
            "qwen3_moe/fused_chunks2",
            "gpt_oss/fused",
            "qwen3_moe/own_group_of_one",
        )
        for name in ("random_k2", "rank_with_zero_tokens", "rank_receives_nothing")
    ]
    + [
        f"{variant}/{name}"
        for variant in ("qwen3_moe/bf16", "gpt_oss/bf16")
        for name in ("random_k2", "all_on_one_expert_k2", "top_k_4")
    ]
)


@pytest.mark.multirank
@pytest.mark.parametrize("label", TWO_RANK_LABELS)
def test_two_ranks_match_eager(two_ranks, label):
    assert_case(two_ranks, label)


@pytest.mark.multirank
def test_two_ranks_exact_zero_grads_were_checked(two_ranks):
    """The scenarios meant to leave experts without tokens did (so the exact-zero checks ran)."""
    r0, r1 = (r["cases"] for r in two_ranks)
    assert "gate_up_proj[6]" in r1["qwen3_moe/default/expert_without_tokens"]["exact_zero"]
    assert set(r1["gpt_oss/default/rank_receives_nothing"]["exact_zero"]) >= {
        f"{p}[{e}]" for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias") for e in range(4, 8)
    }
    assert "down_proj[0]" in r0["qwen3_moe/default/all_on_one_expert_k1"]["exact_zero"]


@pytest.mark.multirank
@pytest.mark.parametrize(
    "check",
    [
        "mesh_2d_without_ep_raises",
        "shards_and_parameters",
        "second_call_is_noop",
        "indivisible_is_atomic",
        "one_host_read_and_each_token_once_per_rank",
    ],
)
def test_two_ranks_contract(two_ranks, check):
    for rank, result in enumerate(two_ranks):
        assert result["checks"][check] is None, f"rank {rank}: {result['checks'][check]}"


@pytest.mark.multirank
@pytest.mark.parametrize(
    "label",
    [
        "qwen3_moe/world_4/uneven_4",
        "qwen3_moe/world_4/uneven_4_k4",
        "qwen3_moe/mesh_dp_ep/random_k2",
        "qwen3_moe/mesh_dp_ep/rank_with_zero_tokens",
        "qwen3_moe/mesh_dp4_ep1/random_k2",
    ],
)
def test_four_ranks_match_eager(four_ranks, label):
    assert_case(four_ranks, label)


@pytest.mark.multirank
def test_four_ranks_capacity_drops_the_same_slots(four_ranks):
    """capacity_factor at EP 4: outputs and every gradient equal the masked oracle's, the dropped
    counts the policy's, the model's logits EP 1's on the concatenated batch."""
    for result in four_ranks:
        seen = result["capacity"]
        assert max(seen["errors"]) < 1e-10, seen["errors"]
        assert seen["dropped"] == seen["want_dropped"] and sum(seen["dropped"]) > 0, seen
        assert seen["model_logits"] < 1e-10 and seen["model_dropped"] == seen["full_dropped"], seen


@pytest.mark.multirank
def test_bad_routing_shape_raises_on_its_rank_without_hanging():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 failed(.|\n)*ValueError(.|\n)*top_k_index"):
        start_ranks(bad_index_shape_run, 2, timeout=60)
    assert time.monotonic() - start < 45


# --------------------------------------------------------------------------------------------
# in this process: EP size 1 (no process group) and argument validation


@pytest.fixture(scope="module")
def qwen():
    return base_model("qwen3_moe")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_ep_size_one_runs_epmoe_forward_and_equals_eager(family, qwen):
    model = copy.deepcopy(qwen) if family == "qwen3_moe" else base_model(family)
    ref = copy.deepcopy(experts_of(model))
    shapes = {n: p.shape for n, p in model.named_parameters()}
    shards = epmoe.apply_expert_parallel(model)
    assert [(s.num_experts, s.num_local_experts, s.local_start, s.local_end, s.ep_rank, s.ep_size) for s in shards] == [
        (8, 8, 0, 8, 0, 1)
    ] * 2
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    experts = experts_of(model)
    assert hasattr(experts, "_epmoe") and "forward" in vars(experts)
    assert experts.forward.__func__ is expert_parallel_forward
    for name, (K, T, kind, arg) in {
        "random": (2, 9, "random", None),
        "zero_tokens": (2, 0, "random", None),
        "one_expert": (1, 6, "one_expert", 3),
        "k4": (4, 5, "random", None),
    }.items():
        inputs = make_inputs(3, 0, T, K, kind, arg, 1)
        ref_params = dict(ref.named_parameters())
        ref.zero_grad(set_to_none=True)
        experts.zero_grad(set_to_none=True)
        want = run_module(ref, *inputs, dtype=torch.float64)
        got = run_module(experts, *inputs, dtype=torch.float64)
        for what, a, b in zip(("out", "grad_hidden", "grad_weights"), got, want):
            assert max_rel(a, b) <= 1e-12, f"{name}: {what}"
        for pname, param in experts.named_parameters():
            want_grad = ref_params[pname].grad
            if want_grad is None:
                want_grad = torch.zeros_like(param)
            assert max_rel(param.grad, want_grad) <= 1e-12, f"{name}: grad of {pname}"


def test_config_validation(qwen):
    model = copy.deepcopy(qwen)
    with pytest.raises(ValueError, match="bogus"):
        epmoe.apply_expert_parallel(model, config={"dispatch": "alltoallv", "bogus": 1})
    for bad in (
        {"dispatch": "nccl"},
        {"gmm_backend": "no_such_backend"},
        {"num_chunks": 0},
        {"num_chunks": "many"},
        {"num_chunks": True},
        {"num_chunks": 1.5},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            epmoe.apply_expert_parallel(model, config=bad)
    with pytest.raises(ValueError, match="dispatch"):
        epmoe.ExpertParallelConfig(dispatch="ring")
    for bad in ("alltoallv", ["dispatch"], 3):
        with pytest.raises(TypeError, match="config"):
            epmoe.apply_expert_parallel(model, config=bad)
    # nothing was converted by the failed calls; good configs are accepted
    assert not any(hasattr(m, "_epmoe") for m in model.modules())
    for good in ({"dispatch": "alltoallv", "num_chunks": 4, "gmm_backend": "loop"}, {}):
        epmoe.apply_expert_parallel(copy.deepcopy(qwen), config=good)
    epmoe.apply_expert_parallel(copy.deepcopy(qwen), config=epmoe.ExpertParallelConfig(dispatch="fused"))


def test_bad_model_and_group_arguments(qwen):
    with pytest.raises(TypeError, match="nn.Module|Module"):
        epmoe.apply_expert_parallel(dict(qwen.named_parameters()))
    with pytest.raises(ValueError, match="no experts"):
        epmoe.apply_expert_parallel(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with pytest.raises(TypeError, match="ep_group"):
        epmoe.apply_expert_parallel(copy.deepcopy(qwen), ep_group="ep")


def test_bad_routing_shape_raises_value_error_in_process(qwen):
    model = copy.deepcopy(qwen)
    epmoe.apply_expert_parallel(model)
    hidden, index, weights, _ = make_inputs(1, 0, 6, 2, "random", None, 1)
    experts = experts_of(model)
    with pytest.raises(ValueError, match="top_k_index"):
        experts(hidden, index.reshape(-1), weights)
    with pytest.raises(ValueError, match="top_k_index"):
        experts(hidden, index, weights[:, :1])
    with pytest.raises(ValueError, match="top_k_index"):
        experts(hidden[:5], index, weights)
