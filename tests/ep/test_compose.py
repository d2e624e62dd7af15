"""Expert parallelism composed with what real training runs use: PEFT LoRA and FSDP2 (2 gloo ranks, CPU).

Recipes that work (each checked against the unsharded model):

* LoRA on non-expert modules (``target_modules``): ``get_peft_model`` and ``apply_expert_parallel`` in
  either order; ``apply_expert_parallel(peft_model)`` finds the experts under ``base_model.model.``.
* LoRA on the packed experts (``target_parameters``): ``apply_expert_parallel`` FIRST, then
  ``get_peft_model``; peft then builds LoRA factors for the E/P local experts only, and their gradients
  are summed over every rank's tokens like the expert weights'. The other order fails (see below).
* The LoRA factors EP gives those experts are the unsharded model's with the same seed (each rank its
  experts' slice), for peft's random inits, and training from them matches the unsharded model.
* FSDP2: ``apply_expert_parallel`` -> ``fully_shard(layer, mesh=mesh, ignored_params=expert_params)``
  per decoder layer -> ``fully_shard(root, mesh=mesh, ignored_params=expert_params)`` with
  ``expert_params = set(epmoe.expert_parameters(model))``; the expert parameters (and expert LoRA
  factors) stay plain local tensors, FSDP2 averages the rest, and ``expert_grad="auto"`` sees
  ``fully_shard`` around the experts and averages the expert gradients the same way: no manual
  division.
"""

import functools

import pytest
from compose_workers import compose_checks, copies_own_ep_model
from ranks import start_ranks

pytest.importorskip("transformers")

TOL = 1e-10  # float64 (transformers computes the loss from fp32-upcast logits: compared at 1e-6)


def _needs_peft():
    pytest.importorskip("peft")


def _needs_fully_shard():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("torch.distributed.fsdp.fully_shard is not available")


@functools.lru_cache(maxsize=1)
def _all_results():
    """Every recipe of compose_workers.compose_checks in one spawned run on 2 ranks."""
    return start_ranks(compose_checks, 2, [7, 12], timeout=600)


def results_of(recipe):
    """Each rank's result of ``recipe`` (a recipe that raised fails here, with its traceback)."""
    _needs_peft()  # every recipe but "fsdp2" uses peft, and the batch runs them all
    _needs_fully_shard()
    out = [by_recipe[recipe] for by_recipe in _all_results()]
    for rank, result in enumerate(out):
        assert not (isinstance(result, dict) and "error" in result), f"{recipe}, rank {rank}:\n{result['error']}"
    return out


# the spawned run is shared: the first test to need it pays for it
pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]


def test_lora_on_attention_either_order():
    """LoRA on q_proj/v_proj: PEFT then EP (deepcopy of the reference PeftModel) and EP then PEFT (same
    seed): loss and every LoRA gradient equal the unsharded PEFT model's on that rank's batch."""
    for rank, errors in enumerate(results_of("peft_attention")):
        for key, err in errors.items():
            tol = 1e-6 if key.endswith("loss") else TOL
            assert err <= tol, f"rank {rank}: {key} relative error {err:.3g}"


def test_lora_on_packed_experts_after_ep():
    """target_parameters on gate_up_proj/down_proj (+ q/v), EP first: the local LoRA factors are the
    reference's sliced to the rank's experts, and their gradients are the reference's summed over ranks.

    PEFT first, then EP, is refused with a clear ValueError and an untouched model: peft's
    ParamWrappers hold LoRA factors for all E experts, which EP cannot slice consistently."""
    for rank, errors in enumerate(results_of("peft_expert_lora")):
        names, peft_first_error = errors.pop("peft_first")
        for key, err in errors.items():
            tol = 1e-6 if key == "loss" else TOL
            assert err <= tol, f"rank {rank}: {key} relative error {err:.3g}"
        assert names == []
        assert peft_first_error.startswith("ValueError"), peft_first_error
        assert "call apply_expert_parallel before get_peft_model" in peft_first_error, peft_first_error


def test_lora_on_shared_expert_with_fused_dispatch():
    """dispatch="fused" then LoRA on the shared expert and the packed experts: the block notices the
    wrapped shared expert and runs its own forward; loss and LoRA gradients equal the unsharded model's."""
    for rank, errors in enumerate(results_of("peft_fused_shared_expert")):
        for key, err in errors.items():
            tol = 1e-6 if key == "loss" else TOL
            assert err <= tol, f"rank {rank}: {key} relative error {err:.3g}"


def test_fsdp2_with_expert_params_ignored():
    """EP + FSDP2 (experts ignored, no manual division), 3 AdamW steps clipped by epmoe.clip_grad_norm_:
    the loss curve, the clip norms and the final parameters equal the non-EP model's under DDP."""
    results = results_of("fsdp2")
    for rank, (losses, losses_ref, param_err) in enumerate(results):
        assert losses == pytest.approx(losses_ref, rel=1e-6, abs=0), f"rank {rank}"
        assert param_err <= TOL, f"rank {rank}: parameters after 3 steps differ by {param_err:.3g}"
    assert results[0][0] == results[1][0]  # every rank reports the same global loss
    assert results[0][0][-1] != results[0][0][0]  # and it trained


def test_fsdp2_lora_qwen3_5_moe():
    """The seed project's recipe on Qwen3.5-MoE: EP -> PEFT LoRA (q/v + packed experts) -> FSDP2 with
    the expert weights and expert LoRA factors ignored -> 3 AdamW steps on the LoRA parameters, vs the
    unsharded PEFT model trained data-parallel."""
    results = results_of("fsdp2_lora")
    for rank, (losses, losses_ref, param_err) in enumerate(results):
        assert losses == pytest.approx(losses_ref, rel=1e-6, abs=0), f"rank {rank}"
        assert param_err <= TOL, f"rank {rank}: LoRA parameters after 3 steps differ by {param_err:.3g}"
    assert results[0][0][-1] != results[0][0][0]


@pytest.mark.parametrize("init", ["True", "gaussian", "False"])
def test_lora_on_packed_experts_starts_like_unsharded(init):
    """Same seed, get_peft_model on the EP model and on the unsharded one (LoRA on the packed experts
    and q/v): every factor bitwise the unsharded model's right after get_peft_model (expert factors for
    all E experts), and after the first forward the expert factors are this rank's slice of them; 3
    AdamW steps under DDP then match the unsharded model under DDP per parameter. Without the shard's
    ds_shape (what peft <= 0.20 reads: it takes the shard's shape) the factors would differ: refused by
    name at the first read, and exact again when added inside whole_experts_for_peft."""
    for rank, by_init in enumerate(results_of("lora_init")):
        r = by_init[init]
        assert r["factors"] == 16 and r["expert_factors"] == 8, f"rank {rank}: {r}"
        assert r["unequal_after_get_peft_model"] == 0, f"rank {rank}: {r}"
        assert r["unequal_after_forward"] == 0 and r["local_shapes"], f"rank {rank}: {r}"
        assert r["loss_err"] <= 1e-6 and r["param_err"] <= TOL and r["trained"], f"rank {rank}: {r}"
        assert "_proj from this rank's shard (4 of 8 experts)" in r["older_peft_plain"], r
        assert r["older_peft_whole_experts_for_peft"] == 0, f"rank {rank}: {r}"


def test_an_adapter_added_after_the_slice_is_refused_or_exact():
    """A second adapter on expert wrappers that already hold their slice: refused by name, or, added
    inside whole_experts_for_peft, every factor of both adapters the unsharded model's (experts sliced)."""
    for rank, result in enumerate(results_of("second_adapter")):
        assert "from this rank's shard (4 of 8 experts)" in result["refused"], (rank, result)
        assert result["compared"] == 24 and result["unequal"] == 0, (rank, result)  # 2 adapters x 12 factors


def test_unsharded_adapter_loads_into_ep_model():
    """PeftModel.from_pretrained(ep_model, path) of an adapter plain peft saved from the unsharded model:
    every factor (experts: this rank's slice) bitwise the saved one, and the unsharded model's logits."""
    for rank, (compared, unequal, logits_err) in enumerate(results_of("lora_load_unsharded")):
        assert compared == 16 and unequal == 0, f"rank {rank}: {compared} compared, {unequal} unequal"
        assert logits_err <= TOL, f"rank {rank}: logits relative error {logits_err:.3g}"


def test_copies_have_their_own_ep_model():
    """copy.deepcopy, AveragedModel and TRL's create_reference_model of an EP model and of a PeftModel
    with LoRA on the experts: each copy has its own EPModel (rooted at the copy, found from every module
    and parameter, sharing the process groups and step channels), is_expert_parameter agrees with
    expert_parameters on it (asked first), and its forward runs on its own EPModel."""
    _needs_peft()
    pytest.importorskip("trl")
    for rank, by_copy in enumerate(start_ranks(copies_own_ep_model, 2, timeout=600)):
        assert set(by_copy) == {f"{m} {k}" for m in ("bare", "peft") for k in ("deepcopy", "averaged", "reference")}
        for kind, checks in by_copy.items():
            experts, original_experts = checks.pop("experts"), checks.pop("original_experts")
            assert experts == original_experts > 0, f"rank {rank}, {kind}: {experts} vs {original_experts}"
            assert all(checks.values()), f"rank {rank}, {kind}: {checks}"
