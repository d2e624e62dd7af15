"""``dispatch="static"``: fixed-size buffers, no counts exchange, no host read, traced whole.

Against the dynamic all-to-all-v transport on the same model and batch: bitwise in float64 (every
family of the parity suite, ranks with different token counts, an expert or a rank with no tokens,
gradient checkpointing), at EP 2 and 4. The multi-rank cases run batched, one spawned run per group
size (see ``static_workers``)."""

import copy
import functools
import tempfile

import pytest
import torch
from custom_moe import TinyMoELM
from ep_workers import run_cases
from ranks import start_ranks
from static_workers import (
    auto_generate,
    compiled_static,
    layer_static_vs_dynamic,
    model_static_vs_dynamic,
    no_host_read,
    out_of_step,
    overflow,
    static_generate,
    trainer_static,
    wrapped_static_vs_dynamic,
)
from torch import nn

import epmoe
from epmoe.ep.dispatch.static import ROUTE_HEAD
from epmoe.models import FAMILIES, build_model

LAYER_CASES = [
    "random_k2",
    "rank_with_zero_tokens",
    "rank_receives_nothing",
    "expert_without_tokens",
    "all_on_one_expert_k1",
    "top_k_4",
]


def cases_of(world, out_dir):
    """``{label: (fn, args)}``: every case that runs on ``world`` ranks (``out_dir``: a directory the
    ranks share, for the Trainer's output)."""
    cases = {
        "layer": (layer_static_vs_dynamic, (LAYER_CASES,)),
        "model/qwen3_moe/float64": (model_static_vs_dynamic, ("qwen3_moe", "float64", [7, 12, 3, 9][:world])),
        "reagree": (overflow, (True, None)),
        "ddp": (wrapped_static_vs_dynamic, ("ddp",)),
    }
    if world == 4:
        cases["mesh"] = (wrapped_static_vs_dynamic, ("mesh",))
    if world == 2:
        cases["fsdp2"] = (wrapped_static_vs_dynamic, ("fsdp2",))
        for family in FAMILIES:
            cases[f"model/{family}/float64"] = (model_static_vs_dynamic, (family, "float64", [9, 5]))
        for family in ("deepseek_v3", "gpt_oss"):
            cases[f"silent_rank/{family}"] = (model_static_vs_dynamic, (family, "float64", [8, 10], "silent_rank"))
        cases["checkpointing"] = (model_static_vs_dynamic, ("qwen3_moe", "float64", [6, 11], "checkpointing"))
        cases["fixed_tokens"] = (
            model_static_vs_dynamic,
            ("qwen3_moe", "float64", [6, 11], "plain", {"static_tokens": 40, "check_steps": False}),
        )
        for dtype in ("float32", "bfloat16"):
            cases[f"model/qwen3_moe/{dtype}"] = (model_static_vs_dynamic, ("qwen3_moe", dtype, [7, 12]))
        cases["model/gpt_oss/float32"] = (model_static_vs_dynamic, ("gpt_oss", "float32", [7, 12]))
        cases["host_reads"] = (no_host_read, (16,))
        cases["fixed_overflow_checked"] = (overflow, (True, 6))
        cases["fixed_overflow_unchecked"] = (overflow, (False, 6))
        cases["out_of_step"] = (out_of_step, ())
        cases["generate"] = (static_generate, ())
        cases["auto_generate"] = (auto_generate, ())
        cases["compiled"] = (compiled_static, ())
        cases["trainer"] = (trainer_static, (out_dir,))
    return cases


@functools.cache
def batch_results(world):
    with tempfile.TemporaryDirectory() as out_dir:
        return start_ranks(run_cases, world, cases_of(world, out_dir), timeout=850)


def results_of(world, label):
    out = [by_label[label] for by_label in batch_results(world)]
    for rank, result in enumerate(out):
        assert not (isinstance(result, dict) and "error" in result), f"{label}, rank {rank}:\n{result['error']}"
    return out


batched = pytest.mark.timeout(900)


@pytest.mark.multirank
@batched
@pytest.mark.parametrize("family", FAMILIES)
def test_static_equals_dynamic_bitwise_every_family(family):
    for result in results_of(2, f"model/{family}/float64"):
        assert result["transport"] == ["static"] and result["compared"] > 10
        assert result["differences"] == {}


@pytest.mark.multirank
@batched
@pytest.mark.parametrize("label", ["silent_rank/deepseek_v3", "silent_rank/gpt_oss", "checkpointing", "fixed_tokens"])
def test_static_equals_dynamic_bitwise_scenarios(label):
    for result in results_of(2, label):
        assert result["differences"] == {}


@pytest.mark.multirank
@batched
@pytest.mark.parametrize("world,label", [(2, "ddp"), (2, "fsdp2"), (4, "ddp"), (4, "mesh")])
def test_static_equals_dynamic_bitwise_data_parallel(world, label):
    """Under DistributedDataParallel and FSDP2, and on a ("dp", "ep") mesh (the expert gradients
    reduced over "dp"): two training steps, every output and gradient bitwise."""
    for result in results_of(world, label):
        assert result["compared"] > 20 and result["differences"] == {}, result


@pytest.mark.multirank
@batched
@pytest.mark.parametrize("label", ["model/qwen3_moe/float32", "model/qwen3_moe/bfloat16", "model/gpt_oss/float32"])
def test_static_equals_dynamic_bitwise_in_float32_and_bfloat16(label):
    """On the ``torch`` grouped-matmul backend both transports run the same kernels on the same rows
    (device offsets against host counts): bitwise too."""
    for result in results_of(2, label):
        assert result["differences"] == {}


@pytest.mark.multirank
@batched
@pytest.mark.parametrize("world", [2, 4])
def test_static_equals_dynamic_routing_cases(world):
    """Ranks with different token counts, a rank with none, a rank receiving nothing, an expert with
    none, every slot on one expert: out, input and weight gradients and expert gradients bitwise."""
    for rank, result in enumerate(results_of(world, "layer")):
        assert set(result) == set(LAYER_CASES)
        assert all(diff == {} for diff in result.values()), (rank, result)
    for result in results_of(world, "model/qwen3_moe/float64"):
        assert result["differences"] == {}


@pytest.mark.multirank
@batched
def test_static_reads_nothing_and_exchanges_no_counts():
    """float32 on the ``torch`` backend, ``check_steps`` off, ``static_tokens`` given: no host read
    at all from the first call (the dynamic path reads its counts once per forward), and two
    exchanges forward, two backward (route with the rows, combine; combine and rows back), none of
    counts."""
    for result in results_of(2, "host_reads"):
        assert [call["reads"] for call in result["alltoallv"]] == [["tolist"], ["tolist"]]
        assert [call["reads"] for call in result["static"]] == [[], []]
        assert [call["exchanges"] for call in result["static"]] == [4, 4]
        # to the one peer: the route (header + B*K ids, int64), the rows with their weights (H + K
        # float32 each) forward and backward, the combine's rows (H) forward and backward
        B, K, H, header = 16, 2, 64, ROUTE_HEAD  # step header, dtype, B, T, rows, the step guard's 4 values
        assert result["static"][0]["bytes"] == (header + B * K) * 8 + 2 * B * (H + K) * 4 + 2 * B * H * 4, result


@pytest.mark.multirank
@batched
@pytest.mark.parametrize("world", [2, 4])
def test_static_buffer_regrows_with_step_checks(world):
    """A rank whose batch outgrows the agreed buffer: with ``check_steps`` on the ranks re-agree on
    a larger one, every output still bitwise the dynamic path's."""
    for result in results_of(world, "reagree"):
        assert result == {"equal": [True, True, True], "block": 9}


@pytest.mark.multirank
@batched
@pytest.mark.parametrize("label", ["fixed_overflow_checked", "fixed_overflow_unchecked"])
def test_static_overflow_of_a_fixed_buffer_raises_on_every_rank(label):
    """``static_tokens=6`` and a rank with 9 tokens: every rank raises at that forward (the one that
    overflows with ValueError, its peers by the header: ValueError where read, a device assertion
    otherwise), naming ``static_tokens``; nothing hangs, nothing is dropped."""
    for result in results_of(2, label):
        assert result["step"] == 1 and "static_tokens" in result["raised"], result


@pytest.mark.multirank
@batched
def test_static_ranks_out_of_step_raise_on_every_rank():
    for result in results_of(2, "out_of_step"):
        assert result["raised"] and "static route header" in result["raised"], result


@pytest.mark.multirank
@batched
def test_static_generate_gives_the_same_tokens():
    assert all(result["equal"] for result in results_of(2, "generate"))


@pytest.mark.multirank
@batched
def test_auto_takes_the_static_exchange_at_decode_steps_only():
    """``dispatch="auto"``: ``generate`` gives the dynamic path's tokens (float64), each layer's
    prompt forward on the all-to-all-v and every decode step on the static exchange (ranks with
    other batch sizes, prompts and ``max_new_tokens``: 6 forwards on both, in lockstep; with
    ``use_cache=False`` the buffer re-agrees as the steps grow); training stays on the all-to-all-v
    and the layers keep their own dispatchers after the call."""
    for result in results_of(2, "auto_generate"):
        assert result["equal"] == [True, True], result
        assert result["calls"] == {
            "cached/alltoallv": 1,
            "cached/static": 5,
            "no_cache/alltoallv": 1,
            "no_cache/static": 3,
            "train/alltoallv": 1,
        }, result
        assert result["transports"] == ["alltoallv"], result


def test_auto_rule():
    """The static exchange at decode steps is ``"auto"``'s alone, and never with a capacity (dropless)."""
    assert epmoe.ExpertParallelConfig().decodes_static()
    for config in ({"dispatch": "alltoallv"}, {"dispatch": "static"}, {"dispatch": "fused"}, {"capacity_factor": 1.25}):
        assert not epmoe.ExpertParallelConfig(**config).decodes_static(), config


@pytest.mark.multirank
@batched
def test_static_compiles_fullgraph_forward_and_backward():
    """``torch.compile(model, fullgraph=True)`` at EP 2: no graph break, equal to eager (fp32 1e-5)."""
    for result in results_of(2, "compiled"):
        assert result["sites"] == [] and result["logits_close"], result
        assert result["loss_diff"] <= 1e-5 and result["grad_diff"] <= 1e-5, result


@pytest.mark.multirank
@batched
def test_static_trainer_equals_trainer_without_ep():
    """``prepare_trainer`` on the EP model with ``dispatch="static"`` trains like the same Trainer on
    the unsharded model (AdamW, clipping, gradient checkpointing, accumulation 2, float64): every
    parameter after 6 steps (1e-10 element-wise), the logged losses and grad norms, the eval loss,
    the saved model; the replicated weights identical on both ranks."""
    for rank, result in enumerate(results_of(2, "trainer")):
        assert result["transport"] == ["static"] and result["num_steps"] == 6 and result["checkpointing"], result
        errors = result["errors"]
        assert any(name.startswith("param/") and "experts" in name for name in errors), sorted(errors)
        bad = {name: error for name, error in errors.items() if not error <= 1e-10}
        assert not bad, (rank, bad)
        assert result["replicated_equal"]


class _OwnForwardExpert(nn.Module):
    """An expert the static transport cannot run grouped (not a Linear triple)."""

    def __init__(self, hidden, inter):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, inter), nn.Linear(inter, hidden)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_static_config_conflicts_raise():
    for bad, named in (
        ({"capacity_factor": 1.0}, "capacity_factor"),
        ({"num_chunks": 2}, "num_chunks"),
        ({"static_tokens": 0}, "static_tokens"),
        ({"static_tokens": True}, "static_tokens"),
    ):
        with pytest.raises(ValueError, match=named):
            epmoe.ExpertParallelConfig(dispatch="static", **bad)
    with pytest.raises(ValueError, match="static_tokens.*dispatch='static'"):
        epmoe.ExpertParallelConfig(dispatch="alltoallv", static_tokens=8)
    model = TinyMoELM(expert_cls=_OwnForwardExpert)
    with pytest.raises(ValueError, match="dispatch='static' cannot run"):
        epmoe.apply_expert_parallel(model, config={"dispatch": "static"})
    assert not any(hasattr(m, "_epmoe") for m in model.modules())


def test_static_on_one_rank_equals_alltoallv():
    torch.manual_seed(0)
    base = build_model("qwen3_moe", dtype=torch.float64)
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(1))
    results = []
    for dispatch in ("alltoallv", "static"):
        model = copy.deepcopy(base)
        epmoe.apply_expert_parallel(model, config={"dispatch": dispatch})
        out = model(ids, labels=ids)
        out.loss.backward()
        results.append([out.logits, *(p.grad for p in model.parameters() if p.grad is not None)])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize(
    "family,dtype", [("qwen3_moe", torch.float32), ("gpt_oss", torch.float32), ("gpt_oss", torch.float64)]
)
def test_padded_pairs_contribute_nothing(family, dtype):
    """The routed MLP on padded pairs (every (row, k); choices of other ranks' experts and whole
    padding rows past the counts) equals it on the exact pairs, forward and backward: outputs and
    every gradient (biases included), with the padding rows' inputs NaN."""
    from epmoe.ep.experts import LocalExperts
    from epmoe.ep.routing import pair_rows

    torch.manual_seed(0)
    module = build_model(family, dtype=dtype).model.layers[0].mlp.experts
    with torch.no_grad():  # GPT-OSS's biases start at zero: a padding pair's bias would not show
        for name, param in module.named_parameters():
            if name.endswith("_bias"):
                param.normal_(0, 0.5)
    experts = LocalExperts(module)
    R, K, e = 10, 2, 8
    g = torch.Generator().manual_seed(3)
    local = torch.randint(0, e + 3, (R, K), generator=g).clamp(max=e)  # e: another rank's expert
    local[-3:] = e  # padding rows
    x = torch.randn(R, module.config.hidden_size if hasattr(module, "config") else 64, generator=g, dtype=dtype)
    x[-3:] = float("nan")
    weights = torch.rand(R, K, generator=g, dtype=dtype)
    found = []
    for padded in (False, True):
        experts.module.zero_grad(set_to_none=True)
        exact = pair_rows(local, e, int((local < e).sum()), None)
        pairs = pair_rows(local, e, padded=True) if padded else exact
        xr, wr = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = experts.routed_mlp(xr, wr, pairs)
        out[:-3].sum().backward()
        found.append([out[:-3], xr.grad[:-3], wr.grad, *(p.grad for p in module.parameters())])
    for a, b in zip(*found):
        assert torch.equal(a, b) if dtype == torch.float64 else torch.allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_bench_static_quick_rows():
    """``epmoe bench layer --part static`` on the quick plan: every mode at both batches, the static
    path with no counts exchange (fewer collectives per layer, fewer host reads; with the headers
    read, as many host reads as the dynamic path), the floor from a bare all-to-all, and the cost
    rows with their peak memory."""
    from epmoe.bench import common
    from epmoe.bench.static import COST_CASES, DECODE_BATCHES, run_static

    settings = common.Settings(device=torch.device("cpu"), threads=2, warmup=0, repeats=1, seed=0, quick=True, out=None)
    report = run_static(settings)
    for batch in DECODE_BATCHES:
        (_, reads_d, coll_d), (_, reads_s, coll_s) = report.decode[batch, "dynamic"], report.decode[batch, "static"]
        assert coll_s == 2 and coll_d == 3 and reads_d - reads_s == 1, report.decode
        _, reads_r, coll_r = report.decode[batch, "static, headers read"]  # auto's decode steps
        assert coll_r == 2 and reads_r == reads_d, report.decode
        assert 0 < report.floor(batch) < 1, report.decode
    assert report.train["static"] == (0, 4) and report.train["dynamic"][1] == 5, report.train
    assert [(row[0], row[1]) for row in report.cost] == list(COST_CASES)
    assert all(row[4] == row[0] * row[2] and row[3] <= row[4] for row in report.cost)
    assert all(float(row[8]) > 0 and float(row[9]) > 0 for row in report.cost), report.cost
    assert "static / dynamic" in report.markdown()


def test_peak_bytes_sees_what_the_step_held_at_once():
    """``bench.static.peak_bytes``: 1 MiB freed before 2 MiB are taken, then 1 MiB more beside them:
    3 MiB at once at most, whatever was held before the step."""
    from epmoe.bench.static import peak_bytes

    before = torch.ones(2**19)  # held before: not counted

    def step():
        first = torch.ones(2**18)  # 1 MiB of float32
        del first
        second = torch.ones(2**19)
        third = torch.ones(2**18)
        return second, third

    assert peak_bytes(step) == 3 * 2**20
    assert before.sum() > 0
