"""Expert-load telemetry, auxiliary-loss-free balancing and the models' own auxiliary losses under EP,
on 2 gloo ranks (one spawned run, see ``balance_workers``), and their validation."""

import pytest
import torch
from balance_workers import all_checks
from ranks import start_ranks

import epmoe
from epmoe.models import build_model


def results():
    return start_ranks(all_checks, 2, timeout=400, once=True)


@pytest.mark.multirank
def test_expert_load_is_the_unsharded_histogram_on_every_rank():
    for by_check in results():
        seen = by_check["telemetry"]
        assert seen["load"] == seen["want"] and seen["same_on_every_rank"], seen
        assert all(sum(v) == 0 for v in seen["after_reset"].values()) and all(
            sum(v) == 0 for v in seen["dropped"].values()
        )
        for name, summary in seen["summary"].items():
            counts = seen["load"][name]
            assert summary["max_over_mean"] == pytest.approx(max(counts) / (sum(counts) / len(counts)))
            assert summary["idle_share"] == sum(c == 0 for c in counts) / len(counts)


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_load_balancer_gives_the_same_biases_and_training_at_ep_1_and_2(family):
    for by_check in results():
        seen = by_check[f"parity/{family}"]
        assert seen["bias_equal"] and seen["moved"] and seen["param_error"] < 1e-10, seen


@pytest.mark.multirank
def test_load_balancer_balances_a_skewed_router():
    for by_check in results():
        seen = by_check["balancing"]
        assert seen["first"] > 2.5 and seen["best_late"] < 0.6 * seen["first"], seen


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_models_own_auxiliary_loss_is_exact_under_ep(family):
    for by_check in results():
        seen = by_check[f"aux/{family}"]
        assert seen["router_coef"] > 0 and seen["aux"] < 1e-12 and seen["loss"] < 1e-12, seen
        assert seen["non_expert_grads"] < 1e-10, seen


@pytest.mark.multirank
def test_capacity_factor_drops_the_same_slots_at_every_ep_size():
    for by_check in results():
        seen = by_check["capacity"]
        assert max(seen["errors"]) < 1e-10, seen["errors"]  # outputs and every gradient vs the masked oracle
        assert seen["dropped"] == seen["want_dropped"] and sum(seen["dropped"]) > 0, seen
        assert seen["model_logits"] < 1e-10 and seen["model_dropped"] == seen["full_dropped"], seen
        assert sum(sum(v) for v in seen["model_dropped"].values()) > 0, seen


@pytest.mark.multirank
def test_load_balancer_biases_agree_over_dp_replicas():
    from balance_workers import mesh_balancer_run

    biases = start_ranks(mesh_balancer_run, 4, timeout=300)
    assert all(b == biases[0] for b in biases), biases
    assert all(any(v != 0 for v in values) for values in biases[0].values())


def test_validation():
    model = build_model("qwen3_moe")
    with pytest.raises(ValueError, match="not expert-parallel"):
        epmoe.expert_load(model)
    epmoe.apply_expert_parallel(model)
    with pytest.raises(TypeError, match="dropped"):
        epmoe.expert_load(model, dropped=1)
    for bad in (0, -1.0, True):
        with pytest.raises(ValueError, match="update_rate"):
            epmoe.LoadBalancer(model, update_rate=bad)
    with pytest.raises(TypeError, match="optimizer"):
        epmoe.LoadBalancer(model, optimizer="adam")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    wrapped = torch.nn.ModuleDict({"inner": model})  # a wrapper (DDP, PeftModel...) around the EP model
    balancer = epmoe.LoadBalancer(wrapped, update_rate=0.1, optimizer=optimizer)
    with pytest.raises(ValueError, match="already has a LoadBalancer"):
        epmoe.LoadBalancer(model)
    ids = torch.randint(0, 256, (2, 8))
    model(ids, labels=ids).loss.backward()
    optimizer.step()  # hooked: the biases moved without a call to balancer.step()
    assert all(b.abs().sum() > 0 for b in balancer.bias.values())
    with pytest.raises(ValueError, match="pass the unsharded model itself"):
        balancer.mirror(torch.nn.ModuleDict({"inner": build_model("qwen3_moe")}))
    for bad in (0, -0.5, float("inf"), True):
        with pytest.raises(ValueError, match="capacity_factor"):
            epmoe.ExpertParallelConfig(capacity_factor=bad)
    with pytest.raises(ValueError, match="dispatch='alltoallv' or 'auto'"):
        epmoe.ExpertParallelConfig(capacity_factor=1.0, dispatch="fused")
    gpt = build_model("gpt_oss")
    epmoe.apply_expert_parallel(gpt)
    with pytest.raises(ValueError, match="not a top-k-of-softmax router"):
        epmoe.LoadBalancer(gpt)
