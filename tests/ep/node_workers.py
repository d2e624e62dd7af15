"""Rank functions for tests/ep/test_nodes.py (module level, so spawned ranks can import them).

The two-level exchange (``dispatch="nodes"``) against the per-rank exchange and the unsharded model,
on nodes emulated with ``ExpertParallelConfig(ranks_per_node=P)``: the experts module on crafted
routing, and the whole model's training steps.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import zlib

import torch
from ep_layer_workers import base_model as layer_base_model
from ep_layer_workers import compare_case, experts_of

import epmoe
from epmoe.models import build_model

# routing cases at EP 4: name -> (top_k, tokens per rank, kind, argument)
CASES_4 = {
    "random_k2": (2, [6, 9, 4, 7], "random", None),
    "random_k4": (4, [5, 3, 8, 6], "random", None),
    "rank_with_zero_tokens": (2, [0, 7, 5, 3], "random", None),
    "expert_without_tokens": (2, [8, 8, 6, 5], "skip_expert", 6),
    "node_receives_nothing": (2, [5, 6, 4, 7], "avoid_ranks", (2, 3)),  # at 2 x 2: node 1 gets no row
    "all_on_one_expert": (1, [5, 7, 3, 4], "one_expert", 5),
}


def base_model():
    """The small Qwen3-MoE in float64 with O(0.1) expert weights (ep_layer_workers')."""
    return layer_base_model("qwen3_moe")


def module_cases(rank, world, ranks_per_node, cases=CASES_4, replicas=0):
    """Each routing case on the experts module with the two-level exchange (and ``replicas``, every
    link free so that the plans move slots), against the unsharded module and the per-rank exchange:
    relative errors, the transport that ran and the moves its plans made."""
    from replica_workers import recorded_plans, with_replicas

    model = base_model()
    ref = copy.deepcopy(experts_of(model))
    plain = copy.deepcopy(model)
    config = with_replicas(replicas, dispatch="nodes", ranks_per_node=ranks_per_node)
    epmoe.apply_expert_parallel(model, config=config)
    epmoe.apply_expert_parallel(plain, config={"dispatch": "alltoallv"})
    transport = experts_of(model)._epmoe.transport.name
    peers = list(range(world))
    out = {}
    for name, case in cases.items():
        seed = zlib.crc32(name.encode())
        with recorded_plans() as plans:
            errors, zeros = compare_case(name, case, ref, experts_of(model), peers, rank, torch.float64, seed)
        plain_errors, _ = compare_case(name, case, ref, experts_of(plain), peers, rank, torch.float64, seed)
        moves = sum(len(p) for p in plans)
        out[name] = {
            "errors": errors,
            "exact_zero": zeros,
            "plain": plain_errors,
            "transport": transport,
            "moves": moves,
        }
    return out


def four_rank_run(rank, world, out_dir):
    """Everything the 4-rank tests ask, in one spawn."""
    from torch.distributed.device_mesh import init_device_mesh

    results = {"module_2x2": module_cases(rank, world, 2), "module_1x4": module_cases(rank, world, 4)}
    skewed = {name: CASES_4[name] for name in ("random_k2", "all_on_one_expert", "node_receives_nothing")}
    skewed["zipf_k2"] = (2, [9, 4, 12, 6], "zipf", 1.5)
    results["module_2x2_replicas"] = module_cases(rank, world, 2, skewed, replicas=2)
    from replica_workers import recorded_plans, with_replicas

    with recorded_plans() as plans:
        results["replicas_ddp"] = train_arms(rank, world, with_replicas(2, dispatch="nodes", ranks_per_node=2))
    results["replicas_ddp"]["moves"] = sum(len(p) for p in plans)
    nodes = {"dispatch": "nodes", "ranks_per_node": 2}
    results["ddp"] = train_arms(rank, world, nodes)
    results["fsdp2"] = train_arms(rank, world, nodes, recipe="fsdp2")
    results["checkpointing"] = train_arms(
        rank, world, nodes, prepare=lambda m: m.gradient_checkpointing_enable({"use_reentrant": False})
    )
    results["auto"] = train_arms(rank, world, {"ranks_per_node": 2})  # "auto" over 2 nodes takes it
    # EP x DP meshes: the EP group inside one node ([0, 1], [2, 3]), and across nodes ([0, 2], [1, 3])
    inside = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    results["mesh_inside"] = train_arms(rank, world, {"dispatch": "nodes", "ranks_per_node": 2}, group=inside)
    across = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp"))
    results["mesh_across"] = train_arms(rank, world, {"dispatch": "nodes", "ranks_per_node": 1}, group=across)
    results["launcher_layouts"] = launcher_layouts(rank, world)
    results["node_groups_freed"] = node_groups_freed(rank)
    results["link_costs"] = link_costs_at_apply()
    results["parameters_logged"] = parameters_logged()
    results["replay_and_save"] = replay_and_save(rank, world, out_dir)
    return results


def replay_and_save(rank, world, out_dir):
    """Routing replay (routes recorded on the per-rank exchange's model, the routers then moved,
    replayed on both) and ``save_pretrained`` after a step of the experts (at EP 4, 2 nodes of 2; the file is the
    unsharded model's, read back by plain transformers at world size 1): the two-level exchange's
    losses, gradients and saved tensors equal the per-rank exchange's."""
    from replica_workers import rel, tokens
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = build_model("qwen3_moe", dtype=torch.float64)
    models = {}
    for arm, config in (
        ("alltoallv", {"dispatch": "alltoallv"}),
        ("nodes", {"dispatch": "nodes", "ranks_per_node": 2}),
    ):
        models[arm] = copy.deepcopy(base)
        epmoe.apply_expert_parallel(models[arm], config=config)
    ids = tokens(0, rank, ((2, 8), (1, 11), (3, 5), (2, 6)))
    with epmoe.record_routing(models["alltoallv"]) as recorded, torch.no_grad():
        models["alltoallv"](ids)
    out, errors = {}, {}
    for arm, model in models.items():
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(-1.0)
        with epmoe.replay_routing(model, recorded):
            loss = model(ids, labels=ids).loss
        loss.backward()
        out[arm] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        # the experts only: without a data-parallel wrapper the other gradients are each rank's own
        opt = torch.optim.AdamW(epmoe.expert_parameters(model), lr=1e-2)
        opt.step()
        model.save_pretrained(f"{out_dir}/{arm}")
        torch.distributed.barrier()
    errors["replay/loss"] = rel(out["nodes"][0], out["alltoallv"][0])
    for name, grad in out["nodes"][1].items():
        errors[f"replay/{name}"] = rel(grad, out["alltoallv"][1][name])
    saved = {arm: load_file(f"{out_dir}/{arm}/model.safetensors") for arm in models}
    for key, tensor in saved["nodes"].items():
        errors[f"saved/{key}"] = rel(tensor, saved["alltoallv"][key])
    reloaded = AutoModelForCausalLM.from_pretrained(
        f"{out_dir}/nodes", dtype=torch.float64, experts_implementation="eager"
    )
    with torch.no_grad():
        errors["reloaded/logits"] = rel(reloaded(ids).logits, models["nodes"](ids).logits)
    return {"errors": errors, "same_keys": sorted(saved["nodes"]) == sorted(saved["alltoallv"])}


def eight_rank_run(rank, world):
    """2 nodes x 4 ranks: the module cases and the DDP recipe."""
    cases = {
        "random_k4": (4, [5, 3, 8, 6, 0, 7, 4, 2], "random", None),
        "random_k2": (2, [6, 2, 5, 4, 3, 7, 1, 5], "random", None),
    }
    return {
        "module_2x4": module_cases(rank, world, 4, cases),
        "ddp": train_arms(rank, world, {"dispatch": "nodes", "ranks_per_node": 4}, sizes=((2, 6), (1, 9), (2, 4))),
        "groups_of_two_layouts": eight_rank_groups(rank, world),
    }


@contextlib.contextmanager
def launcher_says(node):
    """This process on launcher node ``node`` (torchrun's ``GROUP_RANK``), for the block."""
    os.environ["GROUP_RANK"] = str(node)
    try:
        yield
    finally:
        del os.environ["GROUP_RANK"]


@contextlib.contextmanager
def logged(name="epmoe", level=logging.WARNING):
    """The messages logged at ``level`` or above under ``name`` in the block (a list, filled as they come)."""
    messages = []
    handler = logging.Handler(level)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(name)
    saved = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level, logger.getEffectiveLevel()))
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


LAYOUTS_4 = {"uneven_1_3": [0, 1, 1, 1], "uneven_3_1": [0, 0, 0, 1], "scattered": [0, 1, 0, 1], "blocks": [0, 0, 1, 1]}


def launcher_layouts(rank, world):
    """Each launcher layout of :data:`LAYOUTS_4` (nodes by rank, told by ``GROUP_RANK`` alone): the
    transport ``dispatch="auto"`` took, what it logged, and the error ``dispatch="nodes"`` raised
    (``None``: none); on the first uneven layout, 3 training steps under "auto" against the unsharded model."""
    out = {}
    for name, nodes in LAYOUTS_4.items():
        seen = {}
        with launcher_says(nodes[rank]):
            with logged() as messages:
                model = build_model("qwen3_moe")
                epmoe.apply_expert_parallel(model)
            seen["auto"] = sorted({s.transport.name for _, _, s in epmoe.ep.state.ep_states(model)})
            seen["logged"] = messages
            try:
                epmoe.apply_expert_parallel(build_model("qwen3_moe"), config={"dispatch": "nodes"})
                seen["nodes"] = None
            except ValueError as exc:
                seen["nodes"] = str(exc)
            if name == "uneven_1_3":
                seen["training"] = train_arms(rank, world, {})
                replicas = build_model("qwen3_moe")  # link costs measured over uneven nodes: no rank waits
                epmoe.apply_expert_parallel(replicas, config={"replicas": 1})
                links = epmoe.ep_model(replicas).links
                seen["links"] = (links.inside, links.between, list(links.nodes_by_rank))
        out[name] = seen
    return out


def node_groups_freed(rank):
    """transformers' EP keeps an EP group's two-level groups while the group lives: a group destroyed
    and collected leaves nothing behind, and a new group (whatever its ``id``) gets groups of its own,
    over its own ranks. Returns what went wrong (empty: nothing)."""
    import gc

    import torch.distributed as dist

    from epmoe.ep.topology import NodeLayout
    from epmoe.integrations import transformers_ep

    wrong, layout = [], NodeLayout(2, 2)
    first = dist.new_group([0, 1, 2, 3])
    made = transformers_ep.node_groups(first, layout, rank, 30.0)
    if transformers_ep.node_groups(first, layout, rank, 30.0) is not made:
        wrong.append("made twice for one group")
    dist.destroy_process_group(first)
    del first
    gc.collect()
    if len(transformers_ep._NODE_GROUPS):
        wrong.append("a destroyed group's entry is kept")
    second = dist.new_group([0, 1, 2, 3])
    again = transformers_ep.node_groups(second, layout, rank, 30.0)
    if again is made or again.ranks != {1: layout.rail_ranks(rank), 2: layout.node_ranks(rank)}:
        wrong.append("a new group got a dead group's groups")
    return wrong


def parameters_logged():
    """``(what apply logged of the model's parameters, the unsharded model's count)`` at EP 4."""
    model = build_model("qwen3_moe")
    whole = sum(p.numel() for p in model.parameters())
    with logged(level=logging.INFO) as messages:
        epmoe.apply_expert_parallel(model)
    return [m for m in messages if "parameters, every expert once" in m], f"{whole:,}"


def link_costs_at_apply():
    """The link costs of EP models with replicas over 2 emulated nodes of 2: measured (each class's
    flops per byte, whether measured, nodes by rank) and set by the config."""
    seen = {}
    for name, given in (("measured", None), ("set", {"between": 900.0, "inside": 80.0})):
        model = build_model("qwen3_moe")
        epmoe.apply_expert_parallel(model, config={"replicas": 2, "ranks_per_node": 2, "flops_per_link_byte": given})
        links = epmoe.ep_model(model).links
        seen[name] = (links.inside, links.between, links.measured, list(links.nodes_by_rank))
    return seen


def eight_rank_groups(rank, world):
    """Two EP groups of 4 in one world of 8 (a ``("dp", "ep")`` mesh of 2 x 4), the launcher's nodes
    ``[0, 0, 1, 1 | 1, 1, 1, 2]``: ``dispatch="auto"`` runs the two-level exchange in the first group
    and the per-rank one in the second, neither waiting on the other; DDP training over the mesh
    equals the unsharded model's."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "ep"))
    with launcher_says([0, 0, 1, 1, 1, 1, 1, 2][rank]):
        return train_arms(rank, world, {}, group=mesh, sizes=((2, 6), (1, 9), (2, 4)))


# --------------------------------------------------------------------------------------------
# the whole model: the two-level exchange against the per-rank exchange and the unsharded model


def train_arms(
    rank, world, config, recipe="ddp", steps=3, sizes=((2, 8), (1, 11), (3, 5), (2, 6)), prepare=None, group=None
):
    """``steps`` clipped AdamW steps under ``recipe`` (replica_workers.wrap): unsharded, EP with
    ``dispatch="alltoallv"``, EP with ``config`` (the two-level exchange); errors of the last against
    each other arm (losses, step 0's logits and gradients, parameters after the steps)."""
    from replica_workers import compare_arms, full, tokens, wrap

    base = build_model("qwen3_moe", dtype=torch.float64)
    arms, shards = {}, {}
    configs = {"unsharded": None, "ep": {"dispatch": "alltoallv"}, "replicas": config}  # compare_arms' names
    for arm, options in configs.items():
        model = copy.deepcopy(base)
        if options is not None:
            shards[arm] = epmoe.apply_expert_parallel(model, group, config=options)
        if prepare is not None:
            prepare(model)
        wrapped = wrap(recipe, model, world)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        record = {"loss": [], "moves": 0}
        for step in range(steps):
            ids = tokens(step, rank, sizes)
            out = wrapped(ids, labels=ids)
            out.loss.backward()
            record["loss"].append(out.loss.item())
            if step == 0:
                record["logits"] = out.logits.detach().clone()
                record["grads"] = {n: full(p.grad).detach().clone() for n, p in model.named_parameters()}
            record.setdefault("norms", []).append(epmoe.clip_grad_norm_(wrapped, 0.05).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        record["params"] = {n: full(p).detach().clone() for n, p in model.named_parameters()}
        record["model"] = model
        arms[arm] = record
    out = compare_arms(arms, shards["replicas"])
    nodes_model = arms["replicas"]["model"]
    out["transports"] = sorted({s.transport.name for _, _, s in epmoe.ep.state.ep_states(nodes_model)})
    out["load_equal"] = all(
        torch.equal(a, b)
        for a, b in zip(epmoe.expert_load(nodes_model).values(), epmoe.expert_load(arms["ep"]["model"]).values())
    )
    return out


# --------------------------------------------------------------------------------------------
# a rank that dies or hangs between the hops: the survivors raise, naming the hop


def failing_run(rank, world, how, tmp):
    """At 2 nodes x 2, EP rank 3 dies (``how="dies"``: SIGKILL) or hangs alive (``"hangs"``: sleeps past
    the timeout, in no collective) once its hop 1 is done; every other rank records what it raised, and when."""
    import json
    import os
    import signal
    import time
    from pathlib import Path

    import epmoe.ep.dispatch.nodes as nodes

    timeout = 4.0
    model = base_model()
    epmoe.apply_expert_parallel(model, config={"dispatch": "nodes", "ranks_per_node": 2, "timeout": timeout})
    if rank == 3:
        rows, calls = nodes.token_rows, []

        def fail_before_hop_2(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # the forwarder's rows: hop 1 done
                Path(tmp, "failed.json").write_text(json.dumps({"time": time.time()}))
                if how == "dies":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(timeout + 6)
            return rows(*args, **kwargs)

        nodes.token_rows = fail_before_hop_2
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(rank))
    try:
        model(ids).logits.sum().backward()
    except Exception as exc:
        Path(tmp, f"rank{rank}.json").write_text(
            json.dumps({"type": type(exc).__name__, "message": str(exc), "time": time.time()})
        )
        raise
