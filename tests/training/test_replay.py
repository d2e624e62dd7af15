"""Routing replay (R3) on one process: record, replay, the router's own weights, coverage, bad input.

The multi-rank half (recorded at EP 2, replayed at EP 2 and without EP, equal; errors on every rank)
is in tests/training/test_replay_ranks.py.
"""

import copy

import pytest
import torch

import epmoe
from epmoe.models import FAMILIES, build_model

ROUTER_NAMES = ("gate.weight", "router.weight")


def _perturbed(model, seed=1):
    """A copy of ``model`` whose routers' weights moved (its own routing differs from ``model``'s)."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name.endswith(ROUTER_NAMES) and p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return other


def _ids(model, batch=2, length=8, seed=0):
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_selects_the_recorded_experts_and_keeps_the_routers_weights(family):
    torch.manual_seed(0)
    model = build_model(family, dtype=torch.float64)
    ids = _ids(model)
    with epmoe.record_routing(model) as rec:
        model(ids)
    routes = rec.routes()
    assert routes.dtype == torch.int64 and routes.shape[1] == ids.numel()

    other = _perturbed(model)
    with epmoe.record_routing(other) as own:
        other(ids)
    assert not torch.equal(own.routes(), routes)  # the perturbed routers choose otherwise
    with epmoe.replay_routing(other, routes), epmoe.record_routing(other) as during:
        loss = other(ids, labels=ids).loss
    assert torch.equal(during.routes(), routes)  # a record taken during a replay is the replayed routes
    with epmoe.record_routing(other) as outer, epmoe.replay_routing(other, routes):
        other(ids)
    assert torch.equal(outer.routes(), routes)  # whichever block was entered first
    loss.backward()
    router_grads = [g for n, g in _grads(other).items() if n.endswith(ROUTER_NAMES)]
    assert router_grads and all(g.abs().sum() > 0 for g in router_grads)  # gradients reach the routers

    fresh = _perturbed(model)  # replaying a model's own routes changes nothing, bitwise
    with epmoe.replay_routing(fresh, own.routes()):
        replayed = fresh(ids, labels=ids).loss
    replayed.backward()
    plain = _perturbed(model)
    plain(ids, labels=ids).loss.backward()
    assert torch.equal(replayed, plain(ids, labels=ids).loss)
    assert all(torch.equal(g, _grads(plain)[n]) for n, g in _grads(fresh).items())


def _router_output(family, routes_TK):
    """The replayed routing weights (as the first block hands them to its experts) against the family's
    rule written out, on random hidden states: ``(router, hidden, weights, index)``. The block runs
    whole: its router selects (transformers 5.25), or the block itself from its router's logits
    (DeepSeek-V3 at 5.6)."""
    torch.manual_seed(0)
    model = build_model(family, dtype=torch.float64)
    blocks = [m for m in model.modules() if hasattr(m, "experts") and (hasattr(m, "gate") or hasattr(m, "router"))]
    router = getattr(blocks[0], "gate", None) or blocks[0].router
    hidden = torch.randn(routes_TK.shape[0], model.config.hidden_size, dtype=torch.float64)
    seen = {}

    def experts_call(_module, args):
        seen["index"], seen["weights"] = args[1], args[2]

    hook = blocks[0].experts.register_forward_pre_hook(experts_call)
    with epmoe.replay_routing(model, routes_TK.expand(len(blocks), -1, -1).clone()) as replay:
        blocks[0](hidden[None])
        replay.used = [routes_TK.shape[0]] * len(blocks)  # one block ran alone: the others' are not left over
    hook.remove()
    return router, hidden, seen["weights"], seen["index"]


def test_replayed_weights_follow_each_familys_normalisation():
    routes = torch.tensor([[0, 3], [5, 1], [7, 2]])
    gate, hidden, weights, index = _router_output("qwen3_moe", routes)
    probs = torch.softmax(hidden @ gate.weight.T, dim=-1)
    expected = probs.gather(-1, routes)
    assert torch.equal(index, routes)  # Qwen3-MoE's softmax runs in float32
    torch.testing.assert_close(weights, expected / expected.sum(-1, keepdim=True), rtol=1e-6, atol=0)

    gate, hidden, weights, index = _router_output("gpt_oss", routes)
    logits = hidden @ gate.weight.T + gate.bias
    assert torch.equal(index, routes)
    torch.testing.assert_close(weights, torch.softmax(logits.gather(-1, routes), dim=-1), rtol=1e-12, atol=0)

    gate, hidden, weights, index = _router_output("deepseek_v3", routes)
    scores = torch.sigmoid(hidden @ gate.weight.T)
    expected = scores.gather(-1, routes)
    expected = (
        expected / (expected.sum(-1, keepdim=True) + 1e-20) * build_model("deepseek_v3").config.routed_scaling_factor
    )
    assert torch.equal(index, routes)  # DeepSeek-V3's router runs in float32
    torch.testing.assert_close(weights, expected.float(), rtol=1e-6, atol=0)


def test_generate_is_recorded_position_by_position_and_replays_on_the_sequences():
    torch.manual_seed(0)
    model = build_model("qwen3_moe", dtype=torch.float64)
    prompt = _ids(model, batch=2, length=5)
    with epmoe.record_routing(model) as rec:
        sequences = model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert rec.calls == [(2, 5), (2, 1), (2, 1), (2, 1)]  # the prompt, then one step per new token but the last
    by_position = rec.routes_by_position()
    assert by_position.shape[1:3] == (2, 8)
    with epmoe.record_routing(model) as whole:
        model(sequences)
    assert torch.equal(whole.routes_by_position()[:, :, :8], by_position)  # KV-cache steps route as the forward

    other = _perturbed(model)
    with epmoe.replay_routing(other, rec), epmoe.record_routing(other) as during:
        other(sequences, labels=sequences).loss.backward()
    with epmoe.record_routing(other) as live:
        other(sequences)
    replayed = during.routes_by_position()
    assert torch.equal(replayed[:, :, :8], by_position)
    # the last token is routed as usual (the first layer's input does not depend on the replay)
    assert torch.equal(replayed[0, :, 8], live.routes_by_position()[0, :, 8])


def test_flat_routes_cover_the_first_tokens_and_the_rest_route_as_usual():
    torch.manual_seed(0)
    model = build_model("mixtral", dtype=torch.float64)
    ids = _ids(model)
    with epmoe.record_routing(model) as rec:
        model(ids)
    other = _perturbed(model)
    with epmoe.record_routing(other) as live:
        other(ids[:1])
        other(ids[1:])
    covered = ids.shape[1] + 3  # the first sequence and 3 tokens of the second (two forwards)
    with epmoe.replay_routing(other, rec.routes()[:, :covered]), epmoe.record_routing(other) as during:
        other(ids[:1])
        other(ids[1:])
    assert torch.equal(during.routes()[:, :covered], rec.routes()[:, :covered])
    assert torch.equal(during.routes()[0, covered:], live.routes()[0, covered:])  # the first layer's own choice


def test_routes_from_vllm_places_each_sequences_rows_at_its_positions():
    layers, top_k = 2, 2
    first = torch.arange(3 * layers * top_k).view(3, layers, top_k)
    second = torch.arange(5 * layers * top_k).view(5, layers, top_k) + 100
    right = epmoe.routes_from_vllm([first, second.numpy()])
    assert right.shape == (layers, 2, 5, top_k) and right.dtype == torch.int64
    assert torch.equal(right[:, 0, :3], first.transpose(0, 1)) and (right[:, 0, 3:] == -1).all()
    assert torch.equal(right[:, 1], second.transpose(0, 1))
    left = epmoe.routes_from_vllm([first, second], length=6, padding_side="left")
    assert torch.equal(left[:, 0, 3:], first.transpose(0, 1)) and (left[:, 0, :3] == -1).all()
    assert torch.equal(left[:, 1, 1:], second.transpose(0, 1)) and (left[:, 1, 0] == -1).all()
    assert torch.equal(epmoe.routes_from_vllm(first)[:, 0], first.transpose(0, 1))

    torch.manual_seed(0)  # a record, turned into vLLM's per-sequence layout and back
    model = build_model("olmoe", dtype=torch.float64)
    with epmoe.record_routing(model) as rec:
        model(_ids(model))
    by_position = rec.routes_by_position()
    assert torch.equal(epmoe.routes_from_vllm([by_position[:, b].transpose(0, 1) for b in range(2)]), by_position)

    with pytest.raises(ValueError, match="padding_side"):
        epmoe.routes_from_vllm(first, padding_side="middle")
    with pytest.raises(ValueError, match="length"):
        epmoe.routes_from_vllm([first, second], length=4)
    with pytest.raises(ValueError, match="tokens, layers, K"):
        epmoe.routes_from_vllm([first, second[:, :1]])


def test_bad_routes_raise_naming_the_problem():
    torch.manual_seed(0)
    model = build_model("qwen3_moe", dtype=torch.float64)
    ids = _ids(model)
    with epmoe.record_routing(model) as rec:
        model(ids)
    routes = rec.routes()
    experts = model.config.num_experts
    with pytest.raises(TypeError, match="model"):
        epmoe.replay_routing("model", routes)
    with pytest.raises(ValueError, match="integer tensor"):
        epmoe.replay_routing(model, routes.double())
    with pytest.raises(ValueError, match="shape"):
        epmoe.replay_routing(model, routes[:1])
    for bad, reason in ((experts, "experts' count"), (-2, "below -1")):
        broken = routes.clone()
        broken[1, 3, 0] = bad
        with pytest.raises(ValueError, match=reason):
            epmoe.replay_routing(model, broken)
    twice = routes.clone()
    twice[0, 0, 1] = twice[0, 0, 0]
    with pytest.raises(ValueError, match="twice"):
        epmoe.replay_routing(model, twice)
    half = routes.clone()
    half[0, 0, 1] = -1
    with pytest.raises(ValueError, match="some of its K"):
        epmoe.replay_routing(model, half)
    with pytest.raises(ValueError, match="left over"):
        with epmoe.replay_routing(model, routes):
            model(ids[:1])
    with pytest.raises(ValueError, match="shorter"):
        with epmoe.replay_routing(model, rec.routes_by_position()):
            model(ids[:, :4])
    with epmoe.record_routing(model) as mixed:
        model(ids)
        model(ids[:1])
    with pytest.raises(ValueError, match="one batch"):
        mixed.routes_by_position()


def test_a_replayed_forward_reads_nothing_more_from_the_device():
    from host_reads import counting_host_reads

    torch.manual_seed(0)
    model = build_model("qwen3_moe", dtype=torch.float32)
    ids = _ids(model)
    with epmoe.record_routing(model) as rec:
        model(ids)
    with counting_host_reads() as plain:
        model(ids, labels=ids).loss.backward()
    with epmoe.replay_routing(model, rec.routes()):
        with counting_host_reads() as replayed:
            model(ids, labels=ids).loss.backward()
    assert replayed == plain


def test_gradient_checkpointing_replays_in_the_recomputation_or_raises():
    torch.manual_seed(0)
    model = build_model("qwen3_moe", dtype=torch.float64)
    ids = _ids(model)
    with epmoe.record_routing(model) as rec:
        model(ids)
    other = _perturbed(model)
    with epmoe.replay_routing(other, rec.routes_by_position()):
        other(ids, labels=ids).loss.backward()
    expected = _grads(other)
    checkpointed = _perturbed(model)
    checkpointed.gradient_checkpointing_enable()
    checkpointed.train()
    with epmoe.replay_routing(checkpointed, rec.routes_by_position()):
        checkpointed(ids, labels=ids).loss.backward()
    assert all(torch.equal(g, expected[n]) for n, g in _grads(checkpointed).items())
    with pytest.raises(ValueError, match="run the backward inside"):
        with epmoe.replay_routing(checkpointed, rec.routes_by_position()):
            loss = checkpointed(ids, labels=ids).loss
    del loss  # its backward would recompute with the routers' own routing (torch may or may not notice)
    with pytest.raises(ValueError, match="per-position"):
        with epmoe.replay_routing(checkpointed, rec.routes()):
            checkpointed(ids, labels=ids).loss.backward()


def test_a_record_of_micro_batches_replays_each_its_own_routes():
    """A record of two forwards of the same batch size (two micro-batches, not generate's steps) replays
    in call order: each forward gets its own routes, not the first one's."""
    torch.manual_seed(0)
    model = build_model("qwen3_moe", dtype=torch.float64)
    first, second = _ids(model, seed=1), _ids(model, seed=2)
    with epmoe.record_routing(model) as rec:
        model(first)
        model(second)
    moved = _perturbed(model)
    with epmoe.replay_routing(moved, rec), epmoe.record_routing(moved) as seen:
        moved(first)
        moved(second)
    assert torch.equal(seen.routes(), rec.routes())
