"""Reference models that stay expert-parallel (epmoe.reference_model, and prepare_trainer on TRL's
DPOTrainer with ref_model=None): exact, and holding only the local experts."""

import copy

import pytest
import torch
from ranks import start_ranks
from reference_workers import reference_parity, reference_weights

import epmoe
from epmoe.models import build_model


def _ep_model():
    torch.manual_seed(0)
    model = build_model("qwen3_moe", dtype=torch.float64)
    epmoe.apply_expert_parallel(model)
    return model


def test_reference_model_is_a_frozen_twin_with_the_given_weights():
    model = _ep_model()
    source = build_model("qwen3_moe", dtype=torch.float64)
    ref = epmoe.reference_model(model, weights_from=source)
    assert epmoe.ep_model(ref) is not None and epmoe.ep_model(ref) is not epmoe.ep_model(model)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, source(ids).logits, rtol=1e-12, atol=1e-12)


def test_reference_model_rejects_bad_input():
    model = _ep_model()
    with pytest.raises(TypeError, match="reference_model\\(model\\)"):
        epmoe.reference_model("model")
    with pytest.raises(ValueError, match="reference_model\\(model\\)"):
        epmoe.reference_model(build_model("qwen3_moe"))
    with pytest.raises(TypeError, match="reference_model\\(weights_from\\)"):
        epmoe.reference_model(model, weights_from={"a": 1})
    with pytest.raises(ValueError, match="already expert-parallel"):
        epmoe.reference_model(model, weights_from=copy.deepcopy(model))
    with pytest.raises(ValueError, match="not the same architecture"):
        epmoe.reference_model(model, weights_from=build_model("mixtral", dtype=torch.float64))
    other = build_model("qwen3_moe", dtype=torch.float64)
    with torch.no_grad():
        other.lm_head.weight = torch.nn.Parameter(other.lm_head.weight[:, :-1].clone())
    with pytest.raises(ValueError, match="lm_head.weight is"):
        epmoe.reference_model(model, weights_from=other)


def test_the_accelerator_still_lists_its_prepared_models():
    """prepare_trainer drops an unsharded reference from ``Accelerator._models`` (the launcher table's
    one attribute of accelerate it edits): it must still be that list."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    prepared = accelerator.prepare_model(model, evaluation_mode=True)
    assert isinstance(accelerator._models, list) and any(m is prepared for m in accelerator._models)


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_references_stay_sharded_and_exact(tmp_path):
    """At EP 2: reference_model with an unsharded model's weights equals that model (packed and
    ModuleList experts) holding the EP model's bytes; DPO and GRPO (beta > 0) with ref_model=None (TRL
    loads the reference from the path, unsharded) under prepare_trainer train like the same runs without
    EP, every parameter (fp64, 1e-9), their reference holding only the local experts and the unsharded
    one freed."""
    twins = start_ranks(reference_weights, 2, timeout=300)
    for per_rank in twins:
        for family, got in per_rank.items():
            assert got["max_abs"] < 1e-10, (family, got)
            assert got["ref_bytes"] == got["policy_bytes"] < got["full_bytes"], (family, got)
            assert got["frozen"] and got["eval"], (family, got)
    out = start_ranks(reference_parity, 2, str(tmp_path), timeout=600)
    for rank, per_trainer in enumerate(out):
        for trainer, got in per_trainer.items():
            ep = got["ep"]
            assert got["max_rel"] < 1e-9, (rank, trainer, got)
            assert ep["unsharded_freed"] and ep["ref_is_ep"] and ep["ref_frozen"], (rank, trainer, ep)
            assert ep["ref_bytes"] == ep["policy_bytes"] < ep["unsharded_bytes"], (rank, trainer, ep)
            assert len(ep["losses"]) == 2 and ep["losses"] == pytest.approx(got["ddp_losses"], rel=1e-9), (rank, got)
