"""epmoe runs a transformers model only under a transformers release its suite tests
(epmoe.integrations.releases): any other is refused when EP is applied, naming the range, before
anything changes; models that are not transformers models are not concerned."""

import pytest
import torch

import epmoe
from epmoe.integrations import releases, transformers_ep
from epmoe.models import build_model


@pytest.mark.parametrize("version", ["5.6.0", "5.19.0", "5.24.0", "5.26.0", "6.0.0"])
def test_a_release_outside_the_tested_range_is_named(version):
    reason = releases.untested_transformers(version)
    assert reason is not None and f"transformers {version} is not a release epmoe is tested with" in reason
    assert str(releases.TESTED) in reason


def test_the_installed_release_is_tested():
    """The pinned test environment's release (constraints/test.txt) is in the range: widen one with the other."""
    assert releases.untested_transformers(releases.installed_transformers()) is None


def test_apply_refuses_a_transformers_model_under_an_untested_release_changing_nothing(monkeypatch):
    model = build_model("qwen3_moe")
    before = {n: p.clone() for n, p in model.state_dict().items()}
    forward = type(model.model.layers[0].mlp.experts).forward
    monkeypatch.setattr(releases, "installed_transformers", lambda: "5.6.0")  # what LLaMA-Factory 0.9.5 pins
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM: transformers 5\.6\.0 is not a release epmoe is"):
        epmoe.apply_expert_parallel(model)
    assert model.model.layers[0].mlp.experts.forward.__func__ is forward
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    # inside transformers' own EP: refused when transformers builds the implementation, at load
    assert "transformers 5.6.0 is not a release" in transformers_ep.why_not_served(model.model.layers[0].mlp.experts)


def test_a_custom_model_runs_under_any_release(monkeypatch):
    from custom_moe import TinyMoELM

    monkeypatch.setattr(releases, "installed_transformers", lambda: "5.6.0")
    model = TinyMoELM()
    assert releases.untested_release(model) is None
    epmoe.apply_expert_parallel(model)
