"""One object for a model's expert parallelism (``epmoe.ep_model``), on one process (a group of one).

The same at EP 2, with sharded experts, DDP-style marks and PEFT factors: ``tests/ep/test_compose.py``
(``test_copies_have_their_own_ep_model``).
"""

import copy

import pytest
import torch

import epmoe
from epmoe.ep.state import ep_group_of, ep_states, require_ep_states

pytest.importorskip("transformers")


def _ep_model():
    from epmoe.models import build_model

    model = build_model("qwen3_moe")
    epmoe.apply_expert_parallel(model)
    return model


def test_one_ep_model_per_model():
    """Every experts module's record points to one EPModel, rooted at the model, with the experts modules
    in order; it is found from the model, any of its modules and any of its parameters."""
    model = _ep_model()
    found = epmoe.ep_model(model)
    assert isinstance(found, epmoe.EPModel) and found.root is model
    states = [state for _, _, state in ep_states(model)]
    assert [state.model for state in states] == [found] * len(model.model.layers)
    assert found.experts_modules == [layer.mlp.experts for layer in model.model.layers]
    assert [state.layer for state in states] == list(range(len(states)))
    assert all(epmoe.ep_model(m) is found for m in model.modules())
    assert all(epmoe.ep_model(p) is found for p in model.parameters())
    assert ep_group_of(model) is None and [s for _, s in require_ep_states(model, "test")] == states
    assert epmoe.ep_model(torch.nn.Linear(2, 2)) is None
    assert epmoe.ep_model(torch.nn.Parameter(torch.zeros(2))) is None
    with pytest.raises(TypeError, match="ep_model"):
        epmoe.ep_model("model")


@pytest.mark.parametrize("kind", ["deepcopy", "AveragedModel"])
def test_a_copy_has_its_own_ep_model(kind):
    """A copy's EPModel is its own (rooted at the copy, its records point to it, the same groups and
    channels, its own policy and guard), found from the copy's modules and parameters; the copy's
    outputs are the original's, and the original's EPModel is untouched."""
    from torch.optim.swa_utils import AveragedModel

    model = _ep_model()
    original = epmoe.ep_model(model)
    made = copy.deepcopy(model) if kind == "deepcopy" else AveragedModel(model)
    root = made if kind == "deepcopy" else made.module
    own = epmoe.ep_model(made)
    assert own is not original and own.root is root and original.root is model
    assert own.policy is not original.policy and own.guard is not original.guard
    assert own.group is original.group and own.channel is original.channel
    assert own.experts_modules == [layer.mlp.experts for layer in root.model.layers]
    assert all(state.model is own for _, _, state in ep_states(made))
    assert all(epmoe.ep_model(m) is own for m in made.modules())
    assert all(epmoe.ep_model(p) is own for p in made.parameters())
    assert epmoe.ep_model(model) is original
    # a group of one shards nothing: no parameter is an expert parameter, on either model
    assert epmoe.expert_parameters(made) == [] and not any(map(epmoe.is_expert_parameter, made.parameters()))
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        assert torch.equal(made(ids).logits, model(ids).logits)
