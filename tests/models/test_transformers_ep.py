"""epmoe inside transformers' own expert parallelism: ``DistributedConfig(ep_size=N, fsdp_size=M,
ep_implementation="epmoe")`` trains and generates exactly as the same load with ``"all_to_all"``.

Every family whose EP plan transformers ships and epmoe runs is compared at EP 2 on 2 gloo ranks (loss
and every parameter's whole gradient over a few AdamW steps, ranks' batches of different lengths:
float64 to 1e-10 where transformers' path runs it, float32 to its rounding), with gradient
checkpointing, with every token on one rank's experts (the other rank receives nothing, most experts
none), and greedy ``generate``; then ``ep_size=2, fsdp_size=4`` on 4 ranks (each expert on two ranks).
What epmoe cannot serve raises at load naming it."""

import pytest
import torch
from ranks import start_ranks
from torch import nn

pytest.importorskip("transformers.distributed")

from transformers.distributed.expert_parallel import EPImplementationInterface  # noqa: E402

from epmoe import ExpertParallelConfig  # noqa: E402
from epmoe.integrations.transformers_ep import EP_IMPLEMENTATION, EpmoeEP, why_not_served  # noqa: E402
from epmoe.models import build_model  # noqa: E402

EXACT, FP32 = 1e-10, 1e-3
FAMILIES = ("qwen3_moe", "qwen3_5_moe", "mixtral", "deepseek_v3", "gpt_oss", "olmoe")
# DeepSeek-V3 does not load in float64 through transformers' own EP (FSDP2 wants one dtype per unit;
# its router is kept in float32): compared in float32 only
FLOAT64 = tuple(f for f in FAMILIES if f != "deepseek_v3")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("transformers-ep")
    paths = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        build_model(family).save_pretrained(root / family)
        paths[family] = str(root / family)
    return paths


def two_rank_runs(saved) -> dict:
    runs = {f"{f}/float64": ("compared", (saved[f], torch.float64, 2, 2, "plain")) for f in FLOAT64}
    runs.update(
        {f"{f}/float32": ("compared", (saved[f], torch.float32, 2, 2, "plain")) for f in ("qwen3_moe", "deepseek_v3")}
    )
    runs["qwen3_moe/checkpointing"] = ("compared", (saved["qwen3_moe"], torch.float64, 2, 2, "checkpointing"))
    runs["qwen3_moe/skewed"] = ("compared", (saved["qwen3_moe"], torch.float64, 2, 2, "skewed"))
    runs["qwen3_moe/generate"] = ("generated", (saved["qwen3_moe"], 2, 2))
    # registered with ExpertParallelConfig(dispatch="static", static_tokens=64): sync-free, training included
    runs["qwen3_moe/static"] = ("compared", (saved["qwen3_moe"], torch.float64, 2, 2, "plain", "epmoe-static"))
    runs["qwen3_moe/static generate"] = ("generated", (saved["qwen3_moe"], 2, 2, "epmoe-static"))
    runs["qwen3_moe/static inference"] = ("inference_reads", (saved["qwen3_moe"], "epmoe-static"))
    runs["qwen3_moe/inference"] = ("inference_reads", (saved["qwen3_moe"], "epmoe"))
    runs["qwen3_moe/forward reads"] = ("forward_reads", (saved["qwen3_moe"], "epmoe-unchecked"))
    # ep_size == tp_size: the EP group shares one batch (nothing moves; the partial outputs are summed)
    shared = (saved["qwen3_moe"], torch.float64, 2, 2)
    runs["qwen3_moe/shared batch"] = ("compared", (*shared, "plain", "epmoe", 2))
    runs["qwen3_moe/shared batch skewed"] = ("compared", (*shared, "skewed", "epmoe", 2))
    runs["qwen3_moe/shared batch generate"] = ("generated", (saved["qwen3_moe"], 2, 2, "epmoe", 2))
    runs["qwen3_moe/shared batch inference"] = ("inference_reads", (saved["qwen3_moe"], "epmoe", 2))
    runs["qwen3_moe/shared batch unchecked"] = ("inference_reads", (saved["qwen3_moe"], "epmoe-unchecked", 2))
    return runs


def four_rank_runs(saved) -> dict:
    qwen3 = saved["qwen3_moe"]
    return {
        "mesh": ("compared", (qwen3, torch.float64, 2, 4, "plain")),  # ep_size=2, fsdp_size=4
        # ep_size=4, tp_size=2, fsdp_size=2: each TP group's shared batch sliced over its ranks, exchanged over EP 4
        "tp sliced": ("compared", (qwen3, torch.float64, 4, 4, "plain", "epmoe", 2)),
        "tp sliced generate": ("generated", (qwen3, 4, 4, "epmoe", 2)),
        # ep_size=2, tp_size=2, fsdp_size=2: each EP group shares one batch
        "tp shared": ("compared", (qwen3, torch.float64, 2, 4, "plain", "epmoe", 2)),
        # ep_size=4 over 2 nodes of 2 (ranks_per_node, dispatch "auto"): the two-level exchange in training
        "two nodes": ("compared", (qwen3, torch.float64, 4, 4, "plain", "epmoe-two-nodes")),
    }


def results(saved, world: int, runs: dict, label: str):
    from transformers_ep_workers import cases

    out = [by_label[label] for by_label in start_ranks(cases, world, runs, timeout=900, once=True)]
    for rank, result in enumerate(out):
        assert not (isinstance(result, dict) and "error" in result), f"{label}, rank {rank}:\n{result['error']}"
    return out


def test_import_registers_epmoe_in_transformers_ep_implementations():
    assert EPImplementationInterface()[EP_IMPLEMENTATION] is EpmoeEP


@pytest.mark.multirank
@pytest.mark.parametrize(
    "label",
    [f"{f}/float64" for f in FLOAT64]
    + ["qwen3_moe/float32", "deepseek_v3/float32", "qwen3_moe/checkpointing", "qwen3_moe/skewed", "qwen3_moe/static"]
    + ["qwen3_moe/shared batch", "qwen3_moe/shared batch skewed"],
)
def test_exact_against_all_to_all_at_ep2(saved, label):
    tol = FP32 if label.endswith("float32") else EXACT
    for result in results(saved, 2, two_rank_runs(saved), label):
        assert result["loss"] <= tol and result["grads"] <= tol, result
        assert result["compared"] > 10


@pytest.mark.multirank
@pytest.mark.parametrize(
    "label", ["qwen3_moe/generate", "qwen3_moe/static generate", "qwen3_moe/shared batch generate"]
)
def test_generate_gives_the_same_tokens(saved, label):
    assert results(saved, 2, two_rank_runs(saved), label) == [True, True]


@pytest.mark.multirank
def test_inference_runs_the_static_exchange_sync_free_with_static_tokens(saved):
    """An inference call (no gradient) runs the static exchange: reading its route headers (one host
    read: the buffer fitted to each forward's batch), or none with ``static_tokens``; where the EP group
    shares one batch (``ep_size == tp_size``) nothing moves, and nothing is read but the step check's
    batch sizes (none without step checks, the accelerators' default); exact every way."""
    cases = {
        "qwen3_moe/inference": 1,
        "qwen3_moe/static inference": 0,
        "qwen3_moe/shared batch inference": 1,
        "qwen3_moe/shared batch unchecked": 0,
    }
    for label, reads in cases.items():
        for result in results(saved, 2, two_rank_runs(saved), label):
            assert result == {"reads": reads, "equal": True}, (label, result)


@pytest.mark.multirank
@pytest.mark.parametrize("label", ["mesh", "tp sliced", "tp shared", "two nodes"])
def test_exact_on_four_rank_meshes(saved, label):
    """``ep_size=2, fsdp_size=4`` (each expert on two ranks); ``ep_size=4, tp_size=2`` (each TP group's
    batch sliced over its ranks before the exchange, gathered after); ``ep_size=2, tp_size=2,
    fsdp_size=2`` (each EP group shares one batch); ``ep_size=4`` over two nodes of two (the two-level
    exchange, ``"auto"`` told the node size)."""
    for result in results(saved, 4, four_rank_runs(saved), label):
        assert result["loss"] <= EXACT and result["grads"] <= EXACT, result
        if label == "two nodes":
            assert result["transports"] == ["nodes"], result


@pytest.mark.multirank
def test_generate_on_a_tp_mesh(saved):
    assert results(saved, 4, four_rank_runs(saved), "tp sliced generate") == [True] * 4


@pytest.mark.multirank
def test_what_it_cannot_serve_is_refused_on_every_rank(saved):
    from transformers_ep_workers import refused

    for errors in start_ranks(refused, 2, saved["qwen3_moe"], timeout=300):
        assert errors["capacity_factor"].startswith("ValueError: ep_implementation='epmoe-capacity'")
        assert "capacity_factor=1.0" in errors["capacity_factor"]
        assert errors["fused"].startswith("ValueError: ep_implementation='epmoe-fused'")
        assert "dispatch='fused'" in errors["fused"]
        assert errors["replicas"].startswith("ValueError: ep_implementation='epmoe-replicas'")
        assert "replicas=2" in errors["replicas"]
        uneven = errors["batches of two sizes"]
        assert uneven.startswith("ValueError") and "[3, 4] tokens" in uneven and "same batch" in uneven, uneven


def test_what_epmoe_cannot_serve_is_named():
    model = build_model("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    assert why_not_served(experts) is None
    assert "not transformers' packed experts" in why_not_served(nn.Linear(2, 2))
    override = type(
        "OverriddenExperts", (type(experts),), {"forward": lambda self, *a: type(experts).forward(self, *a)}
    )
    experts.__class__ = override
    assert "OverriddenExperts" in why_not_served(experts) and "overridden" in why_not_served(experts)
    for config, named in (
        (ExpertParallelConfig(capacity_factor=1.0), "capacity_factor=1.0"),
        (ExpertParallelConfig(dispatch="fused"), "dispatch='fused'"),
        (ExpertParallelConfig(dispatch="fused", num_chunks=2), "dispatch='fused'"),
        (ExpertParallelConfig(expert_grad="mean"), "expert_grad='mean'"),
        (ExpertParallelConfig(replicas=2), "replicas=2"),
    ):
        assert named in why_not_served(experts, config)


def test_register_validates_and_binds_a_config():
    from epmoe.integrations.transformers_ep import register

    with pytest.raises(TypeError, match="register\\(name\\)"):
        register("", None)
    with pytest.raises(ValueError, match="capacity_factor"):
        register("epmoe-bad", {"capacity_factor": -1})
    assert register("epmoe-test-static", {"dispatch": "static", "static_tokens": 8})
    cls = EPImplementationInterface()["epmoe-test-static"]
    assert issubclass(cls, EpmoeEP) and cls.config.static_tokens == 8 and cls.registered_as == "epmoe-test-static"
    assert EPImplementationInterface()[EP_IMPLEMENTATION] is EpmoeEP  # the default registration untouched


@pytest.fixture(scope="module")
def lifecycle(saved, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("transformers-ep-lifecycle"))
    runs = {
        "trainer": ("trainer", (saved["qwen3_moe"], out)),
        "saved": ("saved", (saved["qwen3_moe"], out)),
        "telemetry": ("telemetry", (saved["qwen3_moe"],)),
    }
    return lambda label: results(saved, 2, runs, label)


@pytest.mark.multirank
def test_trainer_equals_the_trainer_with_all_to_all(lifecycle):
    """transformers' Trainer (3 steps, AdamW, clipping) on a model loaded with ``"epmoe"``: every
    parameter equals the same Trainer run with ``"all_to_all"`` (float32 rounding), the experts moved."""
    for result in lifecycle("trainer"):
        assert result["params"] <= FP32 and result["compared"] > 10 and result["moved"], result


@pytest.mark.multirank
def test_save_pretrained_reloads_and_dcp_resumes(lifecycle):
    """``save_pretrained`` on every rank, plain transformers reloads it (the EP model's logits); a DCP
    save of model and optimizer, loaded into a fresh load, resumes exactly (float64)."""
    for result in lifecycle("saved"):
        assert result["reloaded"] <= EXACT and result["resumed"] <= EXACT, result


@pytest.mark.multirank
def test_expert_load_and_routing_replay(lifecycle):
    """``epmoe.expert_load`` on a model loaded with ``"epmoe"`` equals the histogram of the routes
    recorded there (gradient checkpointing on: its recomputation counts nothing), named by the experts
    modules; replaying ``"all_to_all"``'s recorded routes through zeroed routers gives the loss and
    every gradient ``"all_to_all"`` gives replaying them (float64), and the load follows the replayed
    routes, not the routers' own choice (one rank's experts); a replay that fails on one rank raises on
    every rank."""
    for result in lifecycle("telemetry"):
        assert result["names"] == [f"model.layers.{i}.mlp.experts" for i in range(len(result["names"]))], result
        assert result["load"] and result["same routes"] and result["replayed"] <= EXACT, result
        assert result["replayed load"] and not result["one rank's experts"], result
        assert result["refused everywhere"], result


@pytest.mark.multirank
def test_an_inference_forward_reads_the_route_headers_once_not_per_layer(saved):
    """Without step checks (the accelerators' default) only the first experts module of a forward
    reads its route headers: the later layers take the buffer it agreed (the same tokens); exact."""
    for result in results(saved, 2, two_rank_runs(saved), "qwen3_moe/forward reads"):
        # the 2-layer model: transformers' all_to_all reads once per layer
        assert result == {"reads": 1, "all_to_all reads": 2, "equal": True}, result
