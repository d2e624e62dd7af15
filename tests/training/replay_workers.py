"""Rank functions for the routing replay tests (module level, so spawned ranks can import them)."""

import copy

import torch
import torch.distributed as dist
from ep_workers import batch_of, max_rel

import epmoe
from epmoe.models import build_model

ROUTER_NAMES = ("gate.weight", "router.weight")


def _perturb_routers(*models):
    """Move every router's weights the same way in each model (their own routing no longer the recorded one)."""
    for model in models:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(ROUTER_NAMES) and p.dim() == 2:
                    p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def replay_parity(rank, world, family):
    """Routes recorded by ``generate`` at EP ``world`` (ranks generating different lengths), replayed at EP
    ``world``, at EP 1 (a one-rank group) and without EP after the routers moved: every loss and gradient."""
    torch.manual_seed(0)
    ref = build_model(family, dtype=torch.float64)
    model = copy.deepcopy(ref)
    shards = epmoe.apply_expert_parallel(model)
    singles = [dist.new_group([r]) for r in range(world)]
    ep1 = copy.deepcopy(ref)
    epmoe.apply_expert_parallel(ep1, singles[rank])

    prompt = batch_of(rank, [5] * world, vocab=ref.config.vocab_size)
    new_tokens = 3 + 2 * rank  # rank 0 stops first and keeps serving the others (synced generate)
    with epmoe.record_routing(model) as rec:
        sequences = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    _perturb_routers(model, ref, ep1)
    with torch.no_grad():
        unreplayed = model(sequences, labels=sequences).loss

    with epmoe.replay_routing(model, rec), epmoe.record_routing(model) as during:
        out = model(sequences, labels=sequences)
    out.loss.backward()
    length = sequences.shape[1]
    routes = rec.routes_by_position()[:, :, : length - 1]  # this rank's positions (the last token: never an input)
    errors = {
        "record_during_replay": int(not torch.equal(during.routes_by_position()[:, :, : length - 1], routes)),
        "replay_changes_the_loss": float((out.loss - unreplayed).abs() > 1e-8),
    }

    with epmoe.replay_routing(ep1, routes):
        ep1_out = ep1(sequences, labels=sequences)
    ep1_out.loss.backward()
    everyone = [None] * world
    dist.all_gather_object(everyone, (sequences, routes))
    ref_params = dict(ref.named_parameters())
    expert_names = {
        f"{s.module_name}.{n}"
        for s in shards
        for n, _ in model.get_submodule(s.module_name).named_parameters(recurse=False)
    }
    expert_sum = {name: torch.zeros_like(ref_params[name]) for name in expert_names}
    for source, (source_sequences, source_routes) in enumerate(everyone):
        ref.zero_grad()
        with epmoe.replay_routing(ref, source_routes):
            ref_out = ref(source_sequences, labels=source_sequences)
        ref_out.loss.backward()
        for name in expert_names:
            expert_sum[name] += ref_params[name].grad
        if source == rank:
            errors["loss_vs_no_ep"] = max_rel(out.loss, ref_out.loss)
            errors["loss_vs_ep1"] = max_rel(out.loss, ep1_out.loss)
            own = {n: p.grad.clone() for n, p in ref_params.items() if p.grad is not None}
    errors.update(_gradient_errors(model, ep1, shards, own, expert_sum))
    return errors


def _gradient_errors(model, ep1, shards, own, expert_sum):
    """Max relative error of every gradient of the EP model against the unsharded model's (its own batch;
    expert gradients: summed over the ranks' batches) and against the EP-1 model's."""
    errors = {"grads_vs_no_ep": 0.0, "grads_vs_ep1": 0.0, "compared": 0}
    ep1_grads = dict(ep1.named_parameters())
    local = {
        f"{s.module_name}.{n}": s
        for s in shards
        for n, _ in model.get_submodule(s.module_name).named_parameters(recurse=False)
    }
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} has no gradient under replay"
        shard = local.get(name)
        full = own[name] if shard is None else expert_sum[name][shard.local_start : shard.local_end]
        errors["grads_vs_no_ep"] = max(errors["grads_vs_no_ep"], max_rel(param.grad, full))
        if shard is None:  # EP 1 holds every expert; its expert gradients come from this rank's batch only
            errors["grads_vs_ep1"] = max(errors["grads_vs_ep1"], max_rel(param.grad, ep1_grads[name].grad))
        errors["compared"] += 1
    return errors


def bad_routes_on_one_rank(rank, world):
    """Rank 0's routes are out of range / left over: every rank raises ValueError, none hangs."""
    torch.manual_seed(0)
    model = build_model("qwen3_moe", dtype=torch.float64)
    epmoe.apply_expert_parallel(model)
    ids = batch_of(rank, [6] * world, vocab=model.config.vocab_size)
    with epmoe.record_routing(model) as rec:
        model(ids)
    routes = rec.routes()
    raised = []
    broken = routes.clone()
    if rank == 0:
        broken[0, 0, 0] = model.config.num_experts
    try:
        epmoe.replay_routing(model, broken)
    except ValueError as exc:
        raised.append(str(exc))
    try:
        with epmoe.replay_routing(model, routes):
            model(ids if rank else ids[:1])
    except ValueError as exc:
        raised.append(str(exc))
    try:  # rank 1's own code raises inside the block: rank 0 learns of it at once, not after a timeout
        with epmoe.replay_routing(model, routes):
            model(ids)
            if rank == 1:
                raise RuntimeError("the user's code failed")
    except (ValueError, RuntimeError) as exc:
        raised.append(f"{type(exc).__name__}: {exc}")
    return raised
