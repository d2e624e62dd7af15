"""``torch.compile`` of EP models: compiled gradients equal the eager ones, per parameter, at EP 1
and 2, in fp32 and bf16, without recompiling on new routings (and fp32 logits to 1e-5: torch's grouped
kernel declines fp32 when compiling, epmoe's fallback must still run and match); the graph breaks are
pinned (none where there is nothing to exchange, one site, the exchange, where there is)."""

import pytest
import torch
from compile_workers import break_sites, compile_checks, ep_model
from ranks import start_ranks

from epmoe.models import FAMILIES, build_model

# largest gradient difference over the eager gradient's largest magnitude; loss difference
GRAD_TOL = {"float32": 1e-4, "bfloat16": 3e-2}
LOSS_TOL = {"float32": 1e-5, "bfloat16": 2e-2}
EXCHANGE_BREAK = ("Skip calling `torch.compiler.disable()`d function", "routed_experts")


def check_matches_eager(result, dtype):
    assert result["same_loads"], "the compiled and eager models routed differently (expert_load)"
    compiled_names, eager_names = result["names"]
    assert compiled_names == eager_names and len(eager_names) > 10
    name, worst = max(result["grad_diff"].items(), key=lambda item: item[1])
    assert worst <= GRAD_TOL[dtype], f"{name}: compiled gradient differs by {worst:.2e} of its scale"
    assert result["loss_diff"] <= LOSS_TOL[dtype]
    if dtype == "float32":
        assert result["logits_close"], "compiled fp32 logits differ from eager beyond rtol = atol = 1e-5"


@pytest.mark.multirank
@pytest.mark.timeout(900)  # compiling from a cold inductor cache takes minutes on 2 cores
@pytest.mark.parametrize("ep_size", [1, 2])
def test_compiled_gives_the_eager_gradients(ep_size):
    """EP=1 (qwen3_moe fp32 and bf16; gpt_oss, whose experts have biases, fp32): no graph break.
    EP=2 (qwen3_moe fp32 and bf16, and fp32 under DDP): one graph-break site, the exchange (its
    splits are host ints), whatever the number of layers."""
    results = start_ranks(compile_checks, 2, ep_size, timeout=800)
    expected = {"ep1"} if ep_size == 1 else {"ep2", "ep2 ddp"}
    assert {case[0] for case in results[0]} == expected
    for rank_results in results:
        for (ep, family, dtype), result in rank_results.items():
            check_matches_eager(result, dtype)
            assert result["sites"] == ([] if ep == "ep1" else [EXCHANGE_BREAK]), (ep, family, dtype)


# (family, transformers major.minor): what its own modeling code hits under dynamo, without epmoe.
# transformers 5.6's DeepSeek-V3 attention hands SDPA keys of every head (MLA), and its SDPA path,
# given a materialised mask (traced), repeats them num_attention_heads // num_key_value_heads times
# more (eager passes no mask and lets SDPA group them): a config with fewer key-value heads than
# heads, as epmoe.models' tiny one, does not trace
TRANSFORMERS_FAILS = {("deepseek_v3", "5.6"): "Attempting to broadcast a dimension of length"}


@pytest.mark.parametrize("family", FAMILIES)
def test_ep1_traces_without_graph_breaks(family):
    """Nothing to exchange: the router, the sort, the grouped matmuls (a custom op) and the combine
    trace into one graph, as transformers' own grouped_mm experts do. Where the release's own model
    does not trace (:data:`TRANSFORMERS_FAILS`), the model without epmoe fails as the EP model does."""
    from epmoe.integrations.releases import installed_transformers

    ids = torch.randint(0, 256, (2, 8))
    model = ep_model(family, torch.float32)
    known = TRANSFORMERS_FAILS.get((family, ".".join(installed_transformers().split(".")[:2])))
    if known is None:
        assert break_sites(model, ids) == []
        return
    for traced in (build_model(family, num_experts=8, top_k=2, dtype=torch.float32), model):
        with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match=known):
            break_sites(traced, ids)
