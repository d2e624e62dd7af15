"""Rank functions for tests/training/test_balance.py: expert-load telemetry, LoadBalancer, auxiliary losses."""

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
    return {
        "load": mine,
        "want": want,
        "same_on_every_rank": all(g == mine for g in gathered),
        "summary": summary,
        "dropped": dropped,
        "after_reset": after_reset,
    }


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
    worst, compared = 0.0, {"experts": 0, "others": 0}
    for name, p in model.named_parameters():
        want = ref_params[name]
        module = name.rsplit(".", 1)[0]
        if module in local and p.shape != want.shape:
            want = want[local[module].local_start : local[module].local_end]
        worst = max(worst, ((p - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
        compared["experts" if module in local else "others"] += 1
    assert all(compared.values()), f"nothing compared: {compared}"
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
    worst, compared = 0.0, 0
    for name, p in model.named_parameters():
        if epmoe.is_expert_parameter(p):
            continue
        g, want = p.grad, ref_params[name].grad
        assert g is not None and want is not None, (
            f"{name}: no gradient (EP: {g is not None}, reference: {want is not None})"
        )
        worst = max(worst, ((g - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
        compared += 1
    assert compared, "no non-expert gradient compared"
    return {
        "aux": abs(out.aux_loss.item() - out_ref.aux_loss.item()) / abs(out_ref.aux_loss.item()),
        "loss": abs(out.loss.item() - out_ref.loss.item()) / abs(out_ref.loss.item()),
        "router_coef": model.config.router_aux_loss_coef,
        "non_expert_grads": worst,
    }


def all_checks(rank, world):
    return {
        "telemetry": telemetry_run(rank, world),
        "parity/qwen3_moe": balancer_parity_run(rank, world, "qwen3_moe"),
        "parity/deepseek_v3": balancer_parity_run(rank, world, "deepseek_v3"),
        "balancing": balancing_run(rank, world),
        "aux/qwen3_moe": aux_loss_run(rank, world, "qwen3_moe"),
        "aux/mixtral": aux_loss_run(rank, world, "mixtral"),
        "capacity": capacity_run(rank, world),
    }


def capacity_run(rank, world, factor=0.6):
    """capacity_factor at the experts module: EP ``world`` (2 or 4) against transformers' eager experts
    on the ranks' batches concatenated, the dropped slots' routing weights masked to zero (an
    independent oracle of the policy: per expert, the first C slots in (source rank, token, k) order
    are kept); then at the model: EP ``world`` against EP 1 on the concatenated batch, logits and
    dropped counts."""
    import math

    from ep_layer_workers import base_model, experts_of, max_rel, run_module

    base = base_model("qwen3_moe")
    reference = copy.deepcopy(experts_of(base))
    model = copy.deepcopy(base)
    epmoe.apply_expert_parallel(model, config={"capacity_factor": factor})
    ep = experts_of(model)
    E, K, H = 8, 2, reference.gate_up_proj.shape[-1]
    g = torch.Generator().manual_seed(7)
    inputs = []
    for T in (7, 11, 5, 9)[:world]:
        inputs.append(
            (
                torch.randn(T, H, generator=g, dtype=torch.float64),
                torch.rand(T, E, generator=g).argsort(dim=1)[:, :K],
                torch.softmax(torch.randn(T, K, generator=g, dtype=torch.float64), -1),
                torch.randn(T, H, generator=g, dtype=torch.float64),
            )
        )
    h, index, w, grad_out = (torch.cat(parts) for parts in zip(*inputs))
    capacity = math.ceil(factor * index.numel() / E)
    seen, keep = [0] * E, torch.zeros(index.shape, dtype=torch.float64)
    for t in range(index.shape[0]):
        for k in range(K):
            e = int(index[t, k])
            keep[t, k] = float(seen[e] < capacity)
            seen[e] += 1
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = reference(hh, index, ww * keep)
    (want * grad_out).sum().backward()
    out, dh, dw = run_module(ep, *[t.clone() for t in inputs[rank]], dtype=torch.float64, needs_graph=True)
    start = sum(len(inputs[r][0]) for r in range(rank))
    rows = slice(start, start + len(inputs[rank][0]))
    shard = ep._epmoe.shard
    errors = [max_rel(out, want.detach()[rows]), max_rel(dh, hh.grad[rows]), max_rel(dw, ww.grad[rows])]
    for name, param in ep.named_parameters():
        errors.append(
            max_rel(param.grad, dict(reference.named_parameters())[name].grad[shard.local_start : shard.local_end])
        )
    dropped = epmoe.expert_load(ep, dropped=True)[shard.module_name].tolist()
    want_dropped = [max(0, n - capacity) for n in seen]

    # the model: EP W on each rank's batch vs EP 1 on the concatenation (same lengths)
    full = copy.deepcopy(base)
    epmoe.apply_expert_parallel(full, _group_of_one(rank, world), config={"capacity_factor": factor})
    ids = [batch(r, length=10)[:, :10] for r in range(world)]
    with torch.no_grad():
        epmoe.reset_expert_load(model)
        mine = model(ids[rank]).logits
        theirs = full(torch.cat(ids)).logits[2 * rank : 2 * rank + 2]
    model_dropped = {n: t.tolist() for n, t in epmoe.expert_load(model, dropped=True).items()}
    full_dropped = {n: t.tolist() for n, t in epmoe.expert_load(full, dropped=True).items()}
    return {
        "errors": errors,
        "dropped": dropped,
        "want_dropped": want_dropped,
        "model_logits": max_rel(mine, theirs),
        "model_dropped": model_dropped,
        "full_dropped": full_dropped,
    }


def mesh_balancer_run(rank, world):
    """A ("dp", "ep") = (2, 2) mesh, every rank its own batches: the LoadBalancer's biases are the same
    on all four ranks (the load summed over the "dp" replicas too) and they moved."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))
    model = build_model("qwen3_moe")
    epmoe.apply_expert_parallel(model, mesh)
    balancer = epmoe.LoadBalancer(model, update_rate=0.01)
    for step in range(3):
        with torch.no_grad():
            model(batch(rank, step))
        balancer.step()
    return {name: bias.tolist() for name, bias in balancer.bias.items()}
