"""What an experts module holds besides per-expert weights, and the dtype its family computes in.

* Parameters shared by every expert (MuseSpark's ``post_expert_norm``, a learned scale or bias, a norm
  module all ``ModuleList`` experts hold, a learned activation): not expert parameters, whole on every
  rank, and with exactly the unsharded model's gradient on the rank's own batch at EP 2 without a
  wrapper; under DDP averaged like the rest.
* Families whose own experts forward computes in float32 in a bfloat16 model (Inkling2, Inkling2Loop,
  OpenAI's privacy filter): EP computes in float32 too, so the bfloat16 EP run is as close
  to float64 as the bfloat16 run without EP.

The 2-rank cases run in one spawned run (``experts_inside_workers.all_cases``)."""

import functools

import pytest
import torch
from experts_inside_models import FLOAT32_FAMILIES, build_custom, build_family, to_dtype
from experts_inside_workers import SHARED_KINDS, all_cases, run_cases
from ranks import start_ranks

import epmoe
from epmoe.ep.adopt import find_experts_modules
from epmoe.ep.expert_weights import ExpertWeights, family_compute_dtype
from epmoe.ep.recognize import shared_parameters
from epmoe.models import build_model

EXACT = 1e-10
# the family's own code computes in float32 whatever the model's dtype (MuseSpark's norms; the
# float32 families' experts), so float64 against it is float32-exact: the parity tests' float32 bound
FLOAT32_EXACT = 1e-5
# bfloat16: EP's distance from float64 at most this factor times the distance of the run without EP
# (both summed over the ranks; the runs differ by rounding order and, where the family's matmuls stay
# in bfloat16 but its sum is float32, by epmoe's float32 matmuls)
BF16_FACTOR = 1.15


@functools.cache
def results():
    """Each rank's ``{label: result}`` of one spawned run of every 2-rank case."""
    return start_ranks(run_cases, 2, all_cases(), timeout=800)


def results_of(label):
    out = [by_label[label] for by_label in results()]
    for rank, result in enumerate(out):
        assert "error" not in result, f"{label}, rank {rank}:\n{result['error']}"
    return out


def assert_exact(errors, bound, case, shared_bound=None):
    counted = errors["counted"]
    assert counted["expert"] > 0 and counted["other"] > 0, f"{case}: nothing compared ({counted})"
    for kind in ("loss", "expert", "shared", "other"):
        limit = shared_bound if kind == "shared" and shared_bound is not None else bound
        assert errors[kind] <= limit, f"{case}: {kind} relative error {errors[kind]:.3g} > {limit}"


@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", SHARED_KINDS)
def test_shared_parameters_get_the_local_batch_gradient(kind):
    """No wrapper: every gradient equals the unsharded model's (experts: summed over the ranks'
    batches; the shared parameters and the rest: on this rank's batch). Before, a shared parameter's
    gradient came from the rows this rank's experts ran (MuseSpark: relative error 1.44 and 0.83)."""
    for rank, errors in enumerate(results_of(f"shared/{kind}")):
        assert errors["counted"]["shared"] > 0, f"{kind} rank {rank}: no shared parameter compared"
        # MuseSpark's post-expert norm computes in float32 in a float64 model
        assert_exact(errors, EXACT, f"{kind} rank {rank}", FLOAT32_EXACT if kind == "muse_spark" else None)


@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["muse_spark", "module_list"])
def test_shared_parameters_under_ddp_are_averaged(kind):
    """DistributedDataParallel averages the shared parameters with the rest (the mean over ranks of
    the local-batch gradients), and expert gradients are the mean over ranks (``expert_grad="auto"``);
    MuseSpark keeps some modules in float32 (its ``_keep_in_fp32_modules_strict``): float32's bound."""
    for rank, errors in enumerate(results_of(f"shared_ddp/{kind}")):
        assert errors["counted"]["shared"] > 0
        assert_exact(errors, FLOAT32_EXACT if kind == "muse_spark" else EXACT, f"{kind} DDP rank {rank}")


@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["packed", "module_list"])
def test_shared_parameters_under_fsdp2_are_averaged(kind):
    """FSDP2 (the experts ignored, as docs/training.md's recipe) shards the shared parameters with the rest
    and averages their gradients; expert gradients are the mean over ranks."""
    for rank, errors in enumerate(results_of(f"shared_fsdp2/{kind}")):
        assert errors["counted"]["shared"] > 0
        assert_exact(errors, EXACT, f"{kind} FSDP2 rank {rank}")


@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize("launcher", ["trainer", "deepspeed"])
@pytest.mark.parametrize("kind", ["packed", "module_list"])
def test_shared_parameters_under_trainer_and_deepspeed_are_averaged(kind, launcher):
    """transformers.Trainer (prepare_trainer, DDP inside) and DeepSpeed ZeRO-2 (prepare_deepspeed): one
    SGD step moves the shared parameters, like every other, by the mean over ranks of the unsharded
    model's gradients on their batches (experts: their rows of it)."""
    # DeepSpeed's ZeRO steps float32 copies of the weights: their rounding, relative to the step's size
    # (not the weights'), reaches 2e-5; a gradient averaged wrongly misses by tens of percent
    bound = 1e-4 if launcher == "deepspeed" else EXACT
    for rank, errors in enumerate(results_of(f"shared_{launcher}/{kind}")):
        assert errors["counted"]["shared"] > 0 and errors["counted"]["expert"] > 0
        for what in ("expert", "shared", "other"):
            assert errors[what] <= bound, f"{kind} {launcher} rank {rank}: {what} relative error {errors[what]:.3g}"


@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", FLOAT32_FAMILIES)
def test_float32_families_in_bf16_as_close_as_without_ep(family):
    """bfloat16 EP 2 within ``BF16_FACTOR`` of the run without EP in distance from float64 (per-token
    losses, expert gradients), the static transport bitwise the all-to-all-v one; float64 EP exact
    against epmoe's unsharded model and float32-exact against the family's own loop (which computes
    in float32 there)."""
    out = results_of(f"float32/{family}")
    for rank, result in enumerate(out):
        assert result["experts"] > 0
        assert_exact(result["exact_one"], EXACT, f"{family} float64 vs EP 1, rank {rank}")
        assert_exact(result["exact"], FLOAT32_EXACT, f"{family} float64 vs its own loop, rank {rank}")
    for metric in ("losses", "expert_grads"):
        ep = sum(r[metric]["ep"] for r in out)
        no_ep = sum(r[metric]["no_ep"] for r in out)
        assert ep <= BF16_FACTOR * no_ep, f"{family} bf16 {metric}: EP {ep:.4g} from float64, without EP {no_ep:.4g}"
    assert all(r["static_vs_alltoallv"] == 0 for r in out), "the static transport differs from all-to-all-v"
    if family == "openai_privacy_filter":  # its MLP is all float32, as epmoe runs it: the same outputs
        assert all(r["outputs_vs_no_ep"] <= 1e-6 for r in out), [r["outputs_vs_no_ep"] for r in out]


def experts_of(model):
    return [module for _, module, _ in find_experts_modules(model)]


@pytest.mark.parametrize("family", FLOAT32_FAMILIES)
def test_float32_families_compute_in_float32(family):
    """Found from the family's own experts forward, not a list: float32 in a bfloat16 model; a float64
    model is never computed narrower than its weights."""
    model = build_family(family, torch.bfloat16)
    experts = experts_of(model)
    assert experts and all(family_compute_dtype(m) == torch.float32 for m in experts)
    assert all(ExpertWeights(m).compute_dtype(torch.bfloat16) == torch.float32 for m in experts)
    assert all(ExpertWeights(m).compute_dtype(torch.float64) == torch.float64 for m in experts)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_other_families_compute_in_their_dtype(family):
    """Families computing in the model's dtype (DeepSeek-V3's float32 routing weights included) keep it."""
    model = build_model(family, dtype=torch.bfloat16)
    assert all(family_compute_dtype(m) == torch.bfloat16 for m in experts_of(model))


def test_muse_spark_computes_in_its_dtype_and_shares_its_norm():
    """MuseSpark's norms upcast inside but return the model's dtype: its experts compute in bfloat16;
    its ``post_expert_norm.weight`` is found as shared."""
    experts = experts_of(build_family("muse_spark", torch.bfloat16))
    assert all(family_compute_dtype(m) == torch.bfloat16 for m in experts)
    assert all([n for n, _ in shared_parameters(m)] == ["post_expert_norm.weight"] for m in experts)


def test_shared_parameters_found_by_structure():
    """Packed: every parameter but the per-expert tensors; ModuleList: what more than one expert holds
    (under each of its names); none in a plain family."""
    packed = experts_of(build_custom("packed"))[0]
    assert [n for n, _ in shared_parameters(packed)] == ["post_expert_norm.weight", "post_expert_norm.bias"]
    gate = experts_of(build_custom("packed_gate"))[0]
    assert [n for n, _ in shared_parameters(gate)] == ["act_fn.scale"]
    module_list = experts_of(build_custom("module_list"))[0]
    assert [n for n, _ in shared_parameters(module_list)] == [
        f"{i}.norm.{w}" for i in range(4) for w in ("weight", "bias")
    ]
    assert not any(shared_parameters(m) for m in experts_of(build_model("qwen3_moe")))


def test_shared_parameters_keep_experts_off_the_lean_op_and_the_fused_and_static_transports():
    """The lean op and the fused ops compute no gradient for a shared parameter, nor split it by
    source: experts holding one run plain autograd on the all-to-all-v transport (a fused request
    falls back, naming why; a static one is refused)."""
    model = build_custom("packed_gate")
    epmoe.apply_expert_parallel(model, config={"dispatch": "fused"})
    state = model.blocks[0].experts._epmoe
    assert state.transport.name == "alltoallv" and not state.experts.lean
    with pytest.raises(ValueError, match="shared by every expert"):
        epmoe.apply_expert_parallel(build_custom("packed_gate"), config={"dispatch": "static"})


def test_float32_family_falls_back_from_fused(caplog):
    """The fused ops run one dtype: a family computing in float32 in a bfloat16 model runs all-to-all-v."""
    model = to_dtype(build_family("inkling2"), torch.bfloat16)
    with caplog.at_level("WARNING"):
        epmoe.apply_expert_parallel(model, config={"dispatch": "fused"})
    assert all(m._epmoe.transport.name == "alltoallv" for m in experts_of(model))
    assert "computes its experts in torch.float32" in caplog.text
