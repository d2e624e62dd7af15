"""Rank functions for tests/test_balance.py: expert-load telemetry, LoadBalancer, auxiliary losses."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import epmoe
from epmoe.models import build_model


def batch(rank, step=0, length=9):
    return torch.randint(0, 256, (2, length + rank), generator=torch.Generator().manual_seed(100 * step + rank))


def _histogram(model, ids) -> dict[str, list[int]]:
    """The unsharded model's routed slots per expert, read from its routers' own choices."""
    out, handles = {}, []
    for name, module in model.named_modules():
        if hasattr(module, "experts") and isinstance(getattr(module, "gate", None), torch.nn.Module):
            experts = f"{name}.experts"

            def hook(gate, _inputs, output, experts=experts):
                index = output[2]
                E = gate.weight.shape[0]
                counts = torch.bincount(index.reshape(-1), minlength=E)
                out[experts] = [a + b for a, b in zip(out.get(experts, [0] * E), counts.tolist())]
            handles.append(module.gate.register_forward_hook(hook))
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    return out


def telemetry_run(rank, world):
    """expert_load after two forwards and a backward (gradient checkpointing on) equals the unsharded
    model's histogram of every rank's batches; identical on every rank; reset; dropped."""
    ref = build_model("qwen3_moe", dtype=torch.float64)
    model = copy.deepcopy(ref)
    epmoe.apply_expert_parallel(model)
    model.gradient_checkpointing_enable()
    model.train()
    want: dict[str, list[int]] = {}
    for step in range(2):
        for src in range(world):
            for name, counts in _histogram(ref, batch(src, step)).items():
                want[name] = [a + b for a, b in zip(want.get(name, [0] * len(counts)), counts)]
        model(batch(rank, step), labels=batch(rank, step)).loss.backward()  # the recomputed forward adds nothing
    load = epmoe.expert_load(model)
    mine = {name: t.tolist() for name, t in load.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    summary = epmoe.load_summary(load)
    dropped = {name: t.tolist() for name, t in epmoe.expert_load(model, dropped=True).items()}
    epmoe.reset_expert_load(model)
    after_reset = {name: t.tolist() for name, t in epmoe.expert_load(model).items()}
    return {"load": mine, "want": want, "same_on_every_rank": all(g == mine for g in gathered),
            "summary": summary, "dropped": dropped, "after_reset": after_reset}


def _sgd(model, lr):
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
                p.grad = None


def balancer_parity_run(rank, world, family):
    """LoadBalancer at EP 1 (one process, every rank's batch in turn) vs EP 2 (each rank its own),
    3 SGD steps on the sum of the ranks' losses: the same biases (bitwise) and parameters."""
    ref = build_model(family, dtype=torch.float64)
    model = copy.deepcopy(ref)
    shards = epmoe.apply_expert_parallel(model)
    epmoe.apply_expert_parallel(ref, _group_of_one(rank, world))
    balancers = {"ep": epmoe.LoadBalancer(model, update_rate=0.05), "ref": epmoe.LoadBalancer(ref, update_rate=0.05)}
    for step in range(3):
        for src in range(world):
            ids = batch(src, step)
            ref(ids, labels=ids).loss.backward()
        ids = batch(rank, step)
        model(ids, labels=ids).loss.backward()
        for p in model.parameters():
            if p.grad is not None and not epmoe.is_expert_parameter(p):
                dist.all_reduce(p.grad)  # the sum of the ranks' losses, like the reference
        _sgd(model, 0.05)
        _sgd(ref, 0.05)
        for balancer in balancers.values():
            balancer.step()
    bias_equal = all(torch.equal(balancers["ep"].bias[n], balancers["ref"].bias[n]) for n in balancers["ref"].bias)
    moved = all(balancers["ref"].bias[n].abs().sum() > 0 for n in balancers["ref"].bias)
    ref_params = dict(ref.named_parameters())
    local = {s.module_name: s for s in shards}
    worst = 0.0
    for name, p in model.named_parameters():
        want = ref_params[name]
        module = name.rsplit(".", 1)[0]
        if module in local and p.shape != want.shape:
            want = want[local[module].local_start:local[module].local_end]
        worst = max(worst, ((p - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
    return {"bias_equal": bias_equal, "moved": moved, "param_error": worst}


_ONE: dict = {}


def _group_of_one(rank, world):
    """This rank alone (every rank creates every group, in the same order)."""
    if not _ONE:
        _ONE.update({r: dist.new_group([r]) for r in range(world)})
    return _ONE[rank]


def balancing_run(rank, world):
    """A skewed router (most tokens' first choice on expert 0) and LoadBalancer(update_rate=0.05) over
    25 forwards (no training): max/mean load of the first and the last forward."""
    model = build_model("qwen3_moe")
    epmoe.apply_expert_parallel(model)
    gate = model.model.layers[0].mlp.gate
    captured = []
    handle = gate.register_forward_hook(lambda _m, inputs, _o: captured.append(inputs[0].detach()))
    with torch.no_grad():
        model(batch(rank))
    handle.remove()
    mean_hidden = captured[0].reshape(-1, captured[0].shape[-1]).mean(0)
    mean_hidden = torch.tensor(_all_mean(mean_hidden.tolist(), world))  # the same skew on every rank
    with torch.no_grad():
        gate.weight[0] += 4 * mean_hidden / mean_hidden.norm() ** 2
    balancer = epmoe.LoadBalancer(model, update_rate=0.05)
    name = "model.layers.0.mlp.experts"
    imbalance = []
    for step in range(25):
        epmoe.reset_expert_load(model)
        with torch.no_grad():
            model(batch(rank, step))
        imbalance.append(epmoe.load_summary(epmoe.expert_load(model))[name]["max_over_mean"])
        balancer.step()
    return {"first": imbalance[0], "last": imbalance[-1], "best_late": min(imbalance[-5:])}


def _all_mean(values, world):
    gathered = [None] * world
    dist.all_gather_object(gathered, values)
    return [sum(v[i] for v in gathered) / world for i in range(len(values))]


def aux_loss_run(rank, world, family):
    """output_router_logits=True: the model's own auxiliary loss, the total loss and every router and
    other non-expert gradient equal the unsharded model's on this rank's batch."""
    ref = build_model(family, dtype=torch.float64)
    model = copy.deepcopy(ref)
    epmoe.apply_expert_parallel(model)
    ids = batch(rank)
    out_ref = ref(ids, labels=ids, output_router_logits=True)
    out = model(ids, labels=ids, output_router_logits=True)
    out_ref.loss.backward()
    out.loss.backward()
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        if epmoe.is_expert_parameter(p):
            continue
        g, want = p.grad, ref_params[name].grad
        worst = max(worst, ((g - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
    return {"aux": abs(out.aux_loss.item() - out_ref.aux_loss.item()) / abs(out_ref.aux_loss.item()),
            "loss": abs(out.loss.item() - out_ref.loss.item()) / abs(out_ref.loss.item()),
            "router_coef": model.config.router_aux_loss_coef, "non_expert_grads": worst}


def all_checks(rank, world):
    return {"telemetry": telemetry_run(rank, world),
            "parity/qwen3_moe": balancer_parity_run(rank, world, "qwen3_moe"),
            "parity/deepseek_v3": balancer_parity_run(rank, world, "deepseek_v3"),
            "balancing": balancing_run(rank, world),
            "aux/qwen3_moe": aux_loss_run(rank, world, "qwen3_moe"),
            "aux/mixtral": aux_loss_run(rank, world, "mixtral")}
