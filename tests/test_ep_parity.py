"""apply_expert_parallel on transformers models: outputs, losses and gradients equal the unsharded model's."""

import pytest

from ep_workers import model_parity, module_list_parity
from epmoe.launch import run_ranks

TOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 3e-2}


def assert_parity(results, dtype):
    for rank, errors in enumerate(results):
        for key, err in errors.items():
            assert err <= TOL[dtype], f"rank {rank}: {key} relative error {err:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_parity_two_ranks(family, dtype):
    assert_parity(run_ranks(model_parity, 2, family, dtype, [7, 12], "plain", timeout=240), dtype)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss", "olmoe"])
def test_parity_other_families(family):
    assert_parity(run_ranks(model_parity, 2, family, "float64", [9, 5], "plain", timeout=240), "float64")


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_parity_rank_whose_experts_get_no_tokens(family):
    assert_parity(run_ranks(model_parity, 2, family, "float64", [8, 10], "silent_rank", timeout=240), "float64")


@pytest.mark.parametrize("expert_kind,world", [("mlp", 2), ("biased", 2), ("mlp", 4)])
def test_parity_module_list_experts(expert_kind, world):
    """Custom blocks with nn.ModuleList experts: stacked grouped compute, or each expert on its rows."""
    assert_parity(run_ranks(module_list_parity, world, expert_kind, timeout=240), "float64")
