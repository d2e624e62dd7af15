"""epmoe runs a transformers model only under a transformers release its suite tests
(epmoe.integrations.releases): any other is refused when EP is applied, naming the range, before
anything changes; models that are not transformers models are not concerned. The suite's two
environments hold the range's ends: .venv (constraints/test.txt, the newest release) and .venv-oldest
(constraints/oldest.txt, the oldest a popular fine-tuning framework pins)."""

import re
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import epmoe
from epmoe.integrations import releases, transformers_ep
from epmoe.models import build_model


@pytest.mark.parametrize("version", ["5.5.0", "5.26.0", "6.0.0"])
def test_a_release_outside_the_tested_range_is_named(version):
    reason = releases.untested_transformers(version)
    assert reason is not None and f"transformers {version} is not a release epmoe is tested with" in reason
    assert str(releases.TESTED) in reason


@pytest.mark.parametrize("version", ["5.6.0", "5.16.1", "5.19.0", "5.25.0"])  # LLaMA-Factory, axolotl, ms-swift
def test_the_releases_frameworks_pin_are_served(version):
    assert releases.untested_transformers(version) is None


def _pinned(constraints: str) -> Version:
    text = (Path(__file__).parents[2] / "constraints" / constraints).read_text()
    return Version(re.search(r"^transformers==(\S+)$", text, re.MULTILINE).group(1))


def test_the_range_ends_at_the_test_environments_releases():
    """Both ends of the range run the suite: widen the range with the environment that runs the new end."""
    oldest, newest = _pinned("oldest.txt"), _pinned("test.txt")
    assert oldest in releases.TESTED and newest in releases.TESTED
    assert Version(f"{oldest.major}.{oldest.minor - 1}") not in releases.TESTED
    assert Version(f"{newest.major}.{newest.minor + 1}") not in releases.TESTED
    assert Version(releases.installed_transformers()) in (oldest, newest)


def test_apply_refuses_a_transformers_model_under_an_untested_release_changing_nothing(monkeypatch):
    model = build_model("qwen3_moe")
    before = {n: p.clone() for n, p in model.state_dict().items()}
    forward = type(model.model.layers[0].mlp.experts).forward
    monkeypatch.setattr(releases, "installed_transformers", lambda: "5.26.0")
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM: transformers 5\.26\.0 is not a release epmoe is"):
        epmoe.apply_expert_parallel(model)
    assert model.model.layers[0].mlp.experts.forward.__func__ is forward
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    # inside transformers' own EP: refused when transformers builds the implementation, at load
    assert "transformers 5.26.0 is not a release" in transformers_ep.why_not_served(model.model.layers[0].mlp.experts)


def test_a_custom_model_runs_under_any_release(monkeypatch):
    from custom_moe import TinyMoELM

    monkeypatch.setattr(releases, "installed_transformers", lambda: "5.5.0")
    model = TinyMoELM()
    assert releases.untested_release(model) is None
    epmoe.apply_expert_parallel(model)


def test_distributed_config_migration_needs_its_fields():
    """``from_pretrained(distributed_config=)`` reads ep_size, fsdp_size and ep_implementation (transformers
    5.24 on): under a release whose DistributedConfig lacks them it raises naming the release it needs."""
    from transformers.distributed import DistributedConfig

    config = DistributedConfig()
    if all(hasattr(config, field) for field in ("ep_size", "fsdp_size", "ep_implementation")):
        with pytest.raises(ValueError, match="torch.distributed is not initialized"):  # past the release check
            epmoe.from_pretrained(object, "unused", distributed_config=DistributedConfig(ep_size=2, fsdp_size=2))
    else:
        with pytest.raises(ValueError, match=r"needs transformers >= 5\.24 .*this is transformers 5\."):
            epmoe.from_pretrained(object, "unused", distributed_config=config)
