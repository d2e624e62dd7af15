"""apply_expert_parallel on transformers models: outputs, losses and gradients equal the unsharded model's.

The multi-rank cases run batched: every 2-rank case in one spawned run, the 4-rank case in another
(see ``ep_workers.run_cases``); each test asserts on its own cases' results."""

import functools

import pytest
from ep_workers import disagreeing_config, model_parity, module_list_parity, one_rank_fails_validation, run_cases
from ranks import start_ranks

TOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 3e-2}

TWO_RANK_FAMILIES = ["qwen3_moe", "qwen3_5_moe"]
OTHER_FAMILIES = ["qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss", "olmoe"]
SILENT_RANK_FAMILIES = ["deepseek_v3", "gpt_oss"]
FUSED_CASES = [
    ("qwen3_5_moe", "float64"),
    ("qwen3_5_moe", "float32"),
    ("deepseek_v3", "float64"),
    ("qwen3_moe", "float64"),
]
MODULE_LIST_CASES = [("mlp", 2), ("biased", 2), ("mlp", 4)]
EXPERTS_IMPLEMENTATION_FAMILIES = ["qwen3_moe", "gpt_oss"]  # models on experts_implementation="epmoe" first


def cases_of(world):
    """``{label: (fn, args)}``: every case that runs on ``world`` ranks."""
    cases = {}
    if world == 2:
        for dtype in ("float64", "float32"):
            for family in TWO_RANK_FAMILIES:
                cases[f"plain/{family}/{dtype}"] = (model_parity, (family, dtype, [7, 12], "plain"))
        cases["plain/qwen3_moe/bfloat16"] = (model_parity, ("qwen3_moe", "bfloat16", [7, 12], "plain"))
        for family in OTHER_FAMILIES:
            cases[f"other/{family}/float64"] = (model_parity, (family, "float64", [9, 5], "plain"))
        for family in SILENT_RANK_FAMILIES:
            cases[f"silent_rank/{family}/float64"] = (model_parity, (family, "float64", [8, 10], "silent_rank"))
        for family, dtype in FUSED_CASES:
            cases[f"fused/{family}/{dtype}"] = (model_parity, (family, dtype, [6, 13], "fused"))
        for family in EXPERTS_IMPLEMENTATION_FAMILIES:
            cases[f"experts_implementation/{family}/float64"] = (
                model_parity,
                (family, "float64", [7, 12], "experts_implementation"),
            )
        cases["one_rank_fails_validation"] = (one_rank_fails_validation, ())
        cases["disagreeing_config"] = (disagreeing_config, ())
    for expert_kind, w in MODULE_LIST_CASES:
        if w == world:
            cases[f"module_list/{expert_kind}/world_{world}"] = (module_list_parity, (expert_kind,))
    return cases


@functools.cache
def batch_results(world):
    """The per-rank ``{label: result}`` of one spawned run of every ``world``-rank case."""
    return start_ranks(run_cases, world, cases_of(world), timeout=800)


def results_of(world, label):
    """Each rank's result of the case ``label`` (a case that raised fails here, with its traceback)."""
    out = [by_label[label] for by_label in batch_results(world)]
    for rank, result in enumerate(out):
        assert not (isinstance(result, dict) and "error" in result), f"{label}, rank {rank}:\n{result['error']}"
    return out


def assert_parity(results, dtype, case=""):
    """Every error within the dtype's tolerance, and something was compared: at least one error, and
    each kind of tensor the worker counted (``"compared"``) at least once."""
    for rank, errors in enumerate(results):
        errors = dict(errors)
        compared = errors.pop("compared", {})
        assert errors, f"{case} rank {rank}: nothing compared"
        for kind, count in compared.items():
            assert count > 0, f"{case} rank {rank}: no {kind} compared"
        for key, err in errors.items():
            assert err <= TOL[dtype], f"{case} rank {rank}: {key} relative error {err:.3g} > {TOL[dtype]}"


# the spawned run is shared: the first test to need it pays for it (minutes on 2 busy cores)
batched = pytest.mark.timeout(900)


@pytest.mark.multirank
@batched
@pytest.mark.parametrize("family", TWO_RANK_FAMILIES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_parity_two_ranks(family, dtype):
    label = f"plain/{family}/{dtype}"
    assert_parity(results_of(2, label), dtype, label)


@pytest.mark.multirank
@batched
@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_parity_other_families(family):
    label = f"other/{family}/float64"
    assert_parity(results_of(2, label), "float64", label)


@pytest.mark.multirank
@batched
@pytest.mark.parametrize("family", SILENT_RANK_FAMILIES)
def test_parity_rank_whose_experts_get_no_tokens(family):
    label = f"silent_rank/{family}/float64"
    assert_parity(results_of(2, label), "float64", label)


@pytest.mark.multirank
@batched
@pytest.mark.parametrize("family,dtype", FUSED_CASES)
def test_parity_fused_dispatch(family, dtype):
    """dispatch="fused": alltoallv_gmm / gmm_alltoallv in 2 rounds, the shared expert riding along."""
    label = f"fused/{family}/{dtype}"
    assert_parity(results_of(2, label), dtype, label)


@pytest.mark.multirank
@batched
@pytest.mark.parametrize("family", EXPERTS_IMPLEMENTATION_FAMILIES)
def test_parity_model_on_the_epmoe_experts_implementation(family):
    """A model set to experts_implementation="epmoe" (and run so) takes apply_expert_parallel as any other."""
    label = f"experts_implementation/{family}/float64"
    assert_parity(results_of(2, label), "float64", label)


@pytest.mark.multirank
@batched
@pytest.mark.parametrize("expert_kind,world", MODULE_LIST_CASES)
def test_parity_module_list_experts(expert_kind, world):
    """Custom blocks with nn.ModuleList experts: stacked grouped compute, or each expert on its rows."""
    label = f"module_list/{expert_kind}/world_{world}"
    assert_parity(results_of(world, label), "float64", label)


def test_fused_dispatch_choice_and_fallback(caplog):
    """GPT-OSS's biased experts decline the fused path once per model, with the reason; "auto" is
    resolved to all-to-all-v when EP is applied and leaves every block's forward its own; known
    shared-expert blocks get the overlapped block forward only where the transport is fused."""
    import copy
    import logging

    import torch

    import epmoe
    from epmoe.models import build_model

    with caplog.at_level(logging.WARNING, logger="epmoe.compose.apply"):
        gpt = build_model("gpt_oss")
        epmoe.apply_expert_parallel(gpt, config={"dispatch": "fused"})
    warnings = [r.getMessage() for r in caplog.records if r.name == "epmoe.compose.apply"]
    assert len(warnings) == 1 and "2 experts modules" in warnings[0] and "bias" in warnings[0]
    assert all(m._epmoe.transport.name == "alltoallv" for m in gpt.modules() if hasattr(m, "_epmoe"))

    reference = build_model("qwen3_5_moe")
    auto = copy.deepcopy(reference)
    epmoe.apply_expert_parallel(auto)  # "auto": all-to-all-v (each token once per rank) on every device
    states = [m._epmoe for m in auto.modules() if hasattr(m, "_epmoe")]
    assert states and all(s.transport.name == "alltoallv" for s in states)
    auto_blocks = [m for m in auto.modules() if type(m).__name__ == "Qwen3_5MoeSparseMoeBlock"]
    assert auto_blocks and all("forward" not in vars(m) for m in auto_blocks)  # their own forward, not replaced
    ids = torch.randint(0, 64, (2, 9))
    torch.testing.assert_close(auto(ids).logits, reference(ids).logits)

    fused = build_model("qwen3_5_moe")
    epmoe.apply_expert_parallel(fused, config={"dispatch": "fused"})
    blocks = [m for m in fused.modules() if type(m).__name__ == "Qwen3_5MoeSparseMoeBlock"]
    assert blocks and all(m.forward.__func__.__name__ == "shared_block_forward" for m in blocks)
    assert all(m.experts._epmoe.transport.name == "fused" for m in blocks)


def test_fused_keeps_a_block_forward_set_on_the_instance():
    """A block whose forward was set on the instance (a hook library's wrapper) keeps it under
    dispatch="fused": the overlapped block forward would drop the wrapper (the experts still take
    the fused transport through their own forward); outputs equal the unsharded model's."""
    import copy
    import types

    import torch

    import epmoe
    from epmoe.models import build_model

    reference = build_model("qwen3_5_moe")
    model = copy.deepcopy(reference)
    blocks = [m for m in model.modules() if type(m).__name__ == "Qwen3_5MoeSparseMoeBlock"]
    calls = []

    def wrapped(block, hidden_states):
        calls.append(block)
        return type(block).forward(block, hidden_states)

    blocks[0].forward = types.MethodType(wrapped, blocks[0])
    epmoe.apply_expert_parallel(model, config={"dispatch": "fused"})
    assert blocks[0].forward.__func__ is wrapped
    assert all(m.forward.__func__.__name__ == "shared_block_forward" for m in blocks[1:])
    assert all(m.experts._epmoe.transport.name == "fused" for m in blocks)
    ids = torch.randint(0, 64, (2, 9))
    torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    assert calls


def test_named_backend_that_declines_leaves_model_untouched():
    import torch

    import epmoe
    from epmoe.models import build_model

    model = build_model("qwen3_moe", dtype=torch.float64)
    with pytest.raises(ValueError, match="backend='torch'.*float64"):
        epmoe.apply_expert_parallel(model, config={"gmm_backend": "torch"})
    assert not any(hasattr(m, "_epmoe") for m in model.modules())


def test_block_that_fails_its_probe_leaves_model_untouched():
    """A ModuleList block whose router cannot be probed: ValueError naming the module, nothing changed,
    and a second call fails the same way (not with 'partly expert-parallel')."""
    from custom_moe import TinyMoELM
    from torch import nn

    import epmoe

    model = TinyMoELM()
    model.blocks[1].gate = nn.Sequential(nn.Linear(16, 4, bias=False))
    for _ in range(2):
        with pytest.raises(ValueError, match=r"blocks\.1\.experts: the router Sequential needs a 2-D `weight`"):
            epmoe.apply_expert_parallel(model)
        assert not any(hasattr(m, "_epmoe") for m in model.modules())
    del model.blocks[1].top_k
    with pytest.raises(ValueError, match="top_k"):
        epmoe.apply_expert_parallel(model)
    assert not any(hasattr(m, "_epmoe") for m in model.modules())


@pytest.mark.multirank
@batched
def test_a_rank_that_fails_validation_fails_them_all():
    messages = results_of(2, "one_rank_fails_validation")
    assert "EP rank(s) [1] rejected their input" in messages[0]
    assert messages[1].startswith("apply_expert_parallel: blocks.1.experts")


def test_module_list_routing_follows_transformers_4x_conventions():
    """A block without `norm_topk_prob` (4.x Mixtral) renormalises; router jitter in training is refused."""
    import copy

    import torch
    from custom_moe import TinyMoELM

    import epmoe

    ref = TinyMoELM().double()
    for block in ref.blocks:
        del block.norm_topk_prob  # the block's own forward always renormalises, like Mixtral's
    model = copy.deepcopy(ref)
    epmoe.apply_expert_parallel(model)
    ids = torch.randint(0, 64, (2, 9))
    torch.testing.assert_close(model(ids), ref(ids))
    model.blocks[0].jitter_noise = 0.01
    model.train()
    with pytest.raises(ValueError, match="jitter"):
        model(ids)


@pytest.mark.multirank
@batched
def test_parity_bf16():
    """bf16 model: EP against the unsharded bf16 model, within bf16 tolerance."""
    assert_parity(results_of(2, "plain/qwen3_moe/bfloat16"), "bfloat16", "plain/qwen3_moe/bfloat16")


@pytest.mark.multirank
@batched
def test_ranks_that_disagree_on_the_config_all_raise():
    for messages in results_of(2, "disagreeing_config"):
        assert set(messages) == {"config", "dtype", "hidden_size", "moe_intermediate_size"}
        for case, message in messages.items():  # the field that differs, not both ranks' descriptions
            assert message is not None and "disagree" in message and len(message) < 300, (case, message)
        assert "config.dispatch" in messages["config"]
        assert "bfloat16" in messages["dtype"] and "float32" in messages["dtype"]
