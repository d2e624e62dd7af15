"""Rank functions for tests/ep/test_ep_layer.py (module level, so spawned ranks can import them).

The expert-parallel experts module is called directly, the way the model's MoE block calls it:
``experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])``, with crafted routing. The
reference is a deepcopy of the same module taken before ``apply_expert_parallel``, running
transformers' eager forward on the concatenation of every EP rank's inputs (each rank generates
every rank's inputs from seeds). Results come back as plain dicts; the test asserts on them, so one
failing scenario does not hide the others.
"""

from __future__ import annotations

import copy
import re
import traceback
import zlib

import torch
import torch.distributed as dist
from torch import nn

import epmoe
from epmoe.ep.layer import expert_parallel_forward
from epmoe.models import build_model

NUM_EXPERTS = 8
HIDDEN = 64

# Routing cases run on 2 ranks: name -> (top_k, tokens per rank, routing kind, kind argument).
CASES_2 = {
    "random_k2": (2, [6, 9], "random", None),
    "all_on_one_expert_k1": (1, [5, 7], "one_expert", 5),  # every slot on expert 5: rank 0 receives nothing
    "all_on_one_expert_k2": (2, [5, 7], "one_expert", 2),  # slot 0 of every token on expert 2
    "expert_without_tokens": (2, [8, 8], "skip_expert", 6),
    "rank_with_zero_tokens": (2, [0, 7], "random", None),
    "rank_receives_nothing": (4, [5, 6], "avoid_rank", 1),  # K=4 among experts 0..3 only
    "top_k_1": (1, [4, 6], "random", None),
    "top_k_4": (4, [8, 3], "random", None),
}
# Cases repeated under every other group form / config (kept short: each costs a few ms).
CASES_SHORT = ["random_k2", "rank_with_zero_tokens", "rank_receives_nothing"]
CASES_BF16 = ["random_k2", "all_on_one_expert_k2", "top_k_4"]


# --------------------------------------------------------------------------------------------
# inputs and the reference


def pick(names):
    return {name: CASES_2[name] for name in names}


def make_inputs(case_seed: int, src: int, T: int, K: int, kind: str, arg, ep_size: int):
    """Rank ``src``'s (hidden, top_k_index, top_k_weights, upstream grad), float64, from seeds only."""
    g = torch.Generator().manual_seed(10_000 * case_seed + src)
    E = NUM_EXPERTS
    hidden = torch.randn(T, HIDDEN, generator=g, dtype=torch.float64)
    if kind == "avoid_rank":  # only experts not owned by ep rank ``arg``
        local = E // ep_size
        pool = torch.tensor([e for e in range(E) if not arg * local <= e < (arg + 1) * local])
    elif kind == "avoid_ranks":  # only experts not owned by the EP ranks in ``arg``
        local = E // ep_size
        pool = torch.tensor([e for e in range(E) if e // local not in arg])
    elif kind == "skip_expert":
        pool = torch.tensor([e for e in range(E) if e != arg])
    else:
        pool = torch.arange(E)
    order = torch.rand(T, len(pool), generator=g).argsort(dim=1)[:, :K]  # K distinct experts per token
    index = pool[order]
    if kind == "zipf" and T:  # expert g drawn with weight 1 / (g + 1) ** arg, K distinct per token
        prob = (torch.arange(E, dtype=torch.float64) + 1) ** -arg
        index = torch.multinomial(prob.expand(T, E), K, replacement=False, generator=g)
    if kind == "one_expert":
        if K == 1:
            index[:] = arg
        else:  # slot 0 on ``arg``; the other slots distinct experts different from it
            others = torch.tensor([e for e in range(E) if e != arg])
            rest = torch.rand(T, E - 1, generator=g).argsort(dim=1)[:, : K - 1]
            index = torch.cat([torch.full((T, 1), arg), others[rest]], dim=1)
    weights = torch.softmax(torch.randn(T, K, generator=g, dtype=torch.float64), dim=-1)
    grad_out = torch.randn(T, HIDDEN, generator=g, dtype=torch.float64)
    return hidden, index, weights, grad_out


def run_module(module, hidden, index, weights, grad_out, dtype, needs_graph=False):
    """Forward + backward of ``module``; returns (out, hidden.grad, weights.grad) in float64.

    Eager on zero tokens returns a constant (no graph): its gradients are zero. ``needs_graph``: the
    output must be part of a graph even then (an EP rank with no tokens still joins the backward
    exchanges of the others)."""
    h = hidden.to(dtype).requires_grad_(True)
    w = weights.to(dtype).requires_grad_(True)
    out = module(h, index, w)
    assert out.dtype == h.dtype and out.shape == h.shape, (out.dtype, tuple(out.shape))
    if out.requires_grad or needs_graph:
        (out.to(torch.float64) * grad_out).sum().backward()
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in (h, w)]
    return out.detach().double(), grads[0].double(), grads[1].double()


def max_rel(a, b):
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != reference {tuple(b.shape)}"
    if b.numel() == 0:
        return 0.0
    scale = b.abs().max().clamp_min(1e-12)
    return ((a.double() - b).abs().max() / scale).item()


def randomize_(module: nn.Module, seed: int) -> None:
    """Give every expert weight and bias an O(0.1) value, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=g, dtype=torch.float64).to(param.dtype) * 0.1)


def experts_of(model):
    return model.model.layers[0].mlp.experts


def base_model(family):
    model = build_model(family, num_experts=NUM_EXPERTS, dtype=torch.float64)
    for layer in model.model.layers:
        randomize_(layer.mlp.experts, seed=7)
    return model


def compare_case(name, case, ref_experts, ep_experts, peers, ep_rank, dtype, case_seed, grad_sources=None):
    """One routing case on this rank vs the eager reference on all ``peers``' inputs concatenated.

    ``grad_sources``: the global ranks whose tokens the expert-weight gradients sum over (on a
    ("dp", "ep") mesh: every rank, since epmoe reduces them over "dp"); default ``peers``."""
    K, lengths, kind, arg = case
    ep_size = len(peers)
    make = lambda src: make_inputs(case_seed, src, lengths[src % len(lengths)], K, kind, arg, ep_size)  # noqa: E731
    inputs = [make(src) for src in peers]
    ref = copy.deepcopy(ref_experts)
    ep = ep_experts
    ep.zero_grad(set_to_none=True)
    # the reference: eager forward on the concatenated batch (expert-weight grads summed over all tokens)
    cat = [torch.cat(parts) for parts in zip(*inputs)]
    ref_out, ref_dh, ref_dw = run_module(ref, *cat, dtype=torch.float64)
    if grad_sources is not None and list(grad_sources) != list(peers):
        ref = copy.deepcopy(ref_experts)
        cat = [torch.cat(parts) for parts in zip(*[make(src) for src in grad_sources])]
        run_module(ref, *cat, dtype=torch.float64)
    mine = inputs[ep_rank]
    out, dh, dw = run_module(ep, *mine, dtype=dtype, needs_graph=ep_size > 1)
    start = sum(len(inputs[r][0]) for r in range(ep_rank))
    rows = slice(start, start + len(mine[0]))
    errors = {
        "out": max_rel(out, ref_out[rows]),
        "grad_hidden": max_rel(dh, ref_dh[rows]),
        "grad_top_k_weights": max_rel(dw, ref_dw[rows]),
    }
    shard = ep._epmoe.shard
    lo, hi = shard.local_start, shard.local_end
    exact_zero = {}
    ref_params = dict(ref.named_parameters())
    for pname, param in ep.named_parameters():
        full = ref_params[pname].grad
        want = (full if full is not None else torch.zeros_like(ref_params[pname]))[lo:hi]
        assert param.grad is not None, f"{pname} has no gradient"
        assert param.shape == want.shape, f"{pname}: shape {tuple(param.shape)} != {tuple(want.shape)}"
        errors[f"grad_{pname}"] = max_rel(param.grad, want)
        # every local expert that got no token anywhere has an exactly zero gradient
        for j in range(hi - lo):
            if not torch.any(cat[1] == lo + j):
                exact_zero[f"{pname}[{lo + j}]"] = torch.count_nonzero(param.grad[j]).item()
    return errors, exact_zero


def check(results, name, fn):
    """Record ``None`` for a passing check, else its traceback (the test asserts on these)."""
    try:
        fn()
        results[name] = None
    except BaseException:  # noqa: BLE001
        results[name] = traceback.format_exc()


def engine_variant(
    results, label, family_model, peers, ep_rank, group, config, cases, dtype=torch.float64, grad_sources=None
):
    """Shard a copy of ``family_model`` over ``group`` (``peers``: its global ranks, by EP rank) and run
    ``cases`` (name -> routing case) on its first experts module; this rank is EP rank ``ep_rank``.

    Numbers are recorded, not asserted. An exception is not caught: after a rank-local failure the
    ranks' collectives no longer match, so the whole run must stop (the launcher reports the rank)."""
    model = copy.deepcopy(family_model)
    ref_experts = copy.deepcopy(experts_of(model))
    if dtype != torch.float64:
        model.to(dtype)
    shards = epmoe.apply_expert_parallel(model, group, config=config)
    assert shards[0].ep_size == len(peers) and shards[0].ep_rank == ep_rank, (label, shards[0])
    ep = experts_of(model)
    for name, case in cases.items():
        try:
            errors, zeros = compare_case(
                name, case, ref_experts, ep, peers, ep_rank, dtype, zlib.crc32(name.encode()), grad_sources
            )
        except Exception as exc:
            raise RuntimeError(f"scenario {label}/{name} failed on this rank") from exc
        results[f"{label}/{name}"] = {"errors": errors, "exact_zero": zeros}


# --------------------------------------------------------------------------------------------
# the 2-rank run: every routing case, every group form, both families, bf16, and the contract


def two_rank_run(rank, world):
    results: dict = {"cases": {}, "checks": {}}
    cases, checks = results["cases"], results["checks"]
    qwen = base_model("qwen3_moe")
    gpt = base_model("gpt_oss")
    peers = list(range(world))

    engine_variant(cases, "qwen3_moe/default", qwen, peers, rank, None, None, CASES_2)
    engine_variant(cases, "gpt_oss/default", gpt, peers, rank, None, None, CASES_2)
    engine_variant(
        cases,
        "qwen3_moe/new_group",
        qwen,
        peers,
        rank,
        dist.new_group(peers),
        {"dispatch": "alltoallv"},
        pick(CASES_SHORT),
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    engine_variant(cases, "qwen3_moe/mesh_1d", qwen, peers, rank, mesh, None, pick(CASES_SHORT))
    engine_variant(
        cases,
        "qwen3_moe/fused_chunks2",
        qwen,
        peers,
        rank,
        None,
        epmoe.ExpertParallelConfig(dispatch="fused", num_chunks=2),
        pick(CASES_SHORT),
    )
    engine_variant(cases, "gpt_oss/fused", gpt, peers, rank, None, {"dispatch": "fused"}, pick(CASES_SHORT))
    # a group of one inside a 2-rank world: nothing sharded, no exchange with the other rank
    singles = [dist.new_group([r]) for r in range(world)]
    engine_variant(cases, "qwen3_moe/own_group_of_one", qwen, [rank], 0, singles[rank], None, pick(CASES_SHORT))
    engine_variant(cases, "qwen3_moe/bf16", qwen, peers, rank, None, None, pick(CASES_BF16), dtype=torch.bfloat16)
    engine_variant(cases, "gpt_oss/bf16", gpt, peers, rank, None, None, pick(CASES_BF16), dtype=torch.bfloat16)

    def mesh_without_ep():
        mesh2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        model = copy.deepcopy(qwen)
        try:
            epmoe.apply_expert_parallel(model, mesh2d)
        except ValueError as exc:
            assert "ep" in str(exc), exc
        else:
            raise AssertionError("a 2-D mesh without an 'ep' dim did not raise ValueError")
        assert_untouched(model, qwen)

    check(checks, "mesh_2d_without_ep_raises", mesh_without_ep)
    check(checks, "shards_and_parameters", lambda: contract_shards(qwen, rank, world))
    check(checks, "second_call_is_noop", lambda: contract_twice(qwen, rank, world))
    check(checks, "indivisible_is_atomic", lambda: contract_atomic(qwen, world))
    check(checks, "one_host_read_and_each_token_once_per_rank", lambda: lean_exchange(qwen, rank, world))
    return results


def lean_exchange(base, rank, world):
    """A layer's forward + backward at EP 2 with ``check_steps`` off reads the host once (the counts
    exchange), hands all-to-all-v each token once per remote rank holding one of its experts, four
    times (dispatch, combine, their backward), plus its ``K`` expert ids and weights twice, keeps the
    rows once per (token, rank), and gives bitwise the same results run to run."""
    from host_reads import counting_host_reads

    from epmoe.comm import count_traffic

    model = copy.deepcopy(base)
    epmoe.apply_expert_parallel(model, config={"check_steps": False})
    experts = experts_of(model)
    K, e = 4, NUM_EXPERTS // world
    inputs = [make_inputs(21, src, 12, K, "random", None, world) for src in range(world)]
    hidden, index, weights, grad_out = inputs[rank]
    h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    params = {p.untyped_storage().data_ptr() for p in experts.parameters()}
    saved = {}

    def pack(t):  # every storage autograd keeps, parameters excluded
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // 8
        return t

    with counting_host_reads() as reads, count_traffic() as traffic:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = experts(h, index, w)
        (out * grad_out).sum().backward()
    assert reads == ["tolist"], reads

    def remote_rows(src, dst):  # rows rank src sends rank dst: its tokens with an expert there
        return sum(1 for t in inputs[src][1].tolist() if any(x // e == dst for x in t))

    sent = sum(remote_rows(rank, dst) for dst in range(world) if dst != rank)
    received = sum(remote_rows(src, rank) for src in range(world) if src != rank)
    row, route = HIDDEN * 8, 2 * K * 8  # fp64 rows; the expert ids and weights travel in fp64 too
    assert traffic.bytes_to_peers == 2 * (sent + received) * row + (sent + received) * route, traffic
    assert sent < 12 * K  # fewer rows than slots: the test says something
    # kept: the rows received once per (token, rank) and the gate/up output per pair, plus indices
    # and weights (a few K per row); the per-slot layout keeps K rows of H per token at least
    rows_in = sum(remote_rows(src, rank) for src in range(world))
    pairs = sum(1 for src in range(world) for t in inputs[src][1].tolist() for x in t if x // e == rank)
    up = 2 * model.config.moe_intermediate_size  # the gate/up output's width
    assert sum(saved.values()) <= rows_in * HIDDEN + pairs * up + 4 * K * (rows_in + 12), (saved, rows_in, pairs)

    def results():  # forward + backward again: bitwise the same, run to run
        experts.zero_grad(set_to_none=True)
        h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        out = experts(h, index, w)
        (out * grad_out).sum().backward()
        return [out, h.grad, w.grad, *(p.grad for p in experts.parameters())]

    first = results()
    assert all(torch.equal(a, b) for a, b in zip(first, results()))


def assert_untouched(model, original):
    """``model`` has exactly ``original``'s parameters and no experts module was converted."""
    mine = dict(model.named_parameters())
    assert list(mine) == [n for n, _ in original.named_parameters()]
    for name, param in original.named_parameters():
        assert mine[name].shape == param.shape, (
            f"{name} changed shape {tuple(param.shape)} -> {tuple(mine[name].shape)}"
        )
        assert torch.equal(mine[name], param), f"{name} changed value"
    for name, module in model.named_modules():
        assert not hasattr(module, "_epmoe"), f"{name} was converted"
        assert "forward" not in vars(module), f"{name}'s forward was replaced"


def contract_shards(base, rank, world):
    model = copy.deepcopy(base)
    names_before = [n for n, _ in model.named_parameters()]
    shapes_before = {n: p.shape for n, p in model.named_parameters()}
    shards = epmoe.apply_expert_parallel(model)
    experts_names = [n for n, m in model.named_modules() if type(m).__name__.endswith("Experts")]
    assert (
        [s.module_name for s in shards] == experts_names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    )
    local = NUM_EXPERTS // world
    for shard in shards:
        assert isinstance(shard, epmoe.ExpertShard)
        assert (
            shard.num_experts,
            shard.num_local_experts,
            shard.local_start,
            shard.local_end,
            shard.ep_rank,
            shard.ep_size,
        ) == (NUM_EXPERTS, local, rank * local, (rank + 1) * local, rank, world), shard
        module = model.get_submodule(shard.module_name)
        assert "forward" in vars(module) and module.forward.__func__ is expert_parallel_forward
    assert [n for n, _ in model.named_parameters()] == names_before
    base_params = dict(base.named_parameters())
    for name, param in model.named_parameters():
        assert type(param) is nn.Parameter, f"{name} is a {type(param).__name__}"
        if ".mlp.experts." in name:
            assert param.shape == (local, *shapes_before[name][1:]), f"{name}: {tuple(param.shape)}"
            assert torch.equal(param, base_params[name][rank * local : (rank + 1) * local]), f"{name}: wrong slice"
            assert param.requires_grad
        else:  # routers and everything else untouched
            assert param.shape == shapes_before[name] and torch.equal(param, base_params[name]), name
    for name, module in model.named_modules():  # only the experts modules converted
        if name not in experts_names:
            assert not hasattr(module, "_epmoe") and "forward" not in vars(module), name


def contract_twice(base, rank, world):
    model = copy.deepcopy(base)
    first = epmoe.apply_expert_parallel(model)
    params = {n: p for n, p in model.named_parameters()}
    second = epmoe.apply_expert_parallel(model)
    assert second == first, (first, second)
    for name, param in model.named_parameters():
        assert param is params[name], f"{name} replaced by the second call"
        assert param.shape[0] == NUM_EXPERTS // world or ".mlp.experts." not in name, f"{name} sharded twice"


def contract_atomic(base, world):
    """E % P != 0 in the second experts module: ValueError naming it, E and P; the model untouched."""
    model = copy.deepcopy(base)
    bad = model.model.layers[1].mlp.experts
    with torch.no_grad():
        for name, param in list(bad.named_parameters(recurse=False)):
            setattr(bad, name, nn.Parameter(param[: NUM_EXPERTS - 1].clone()))
    original = copy.deepcopy(model)
    try:
        epmoe.apply_expert_parallel(model)
    except ValueError as exc:
        msg = str(exc)
        assert "model.layers.1.mlp.experts" in msg, msg
        for number in (NUM_EXPERTS - 1, world):  # E and P, as whole numbers
            assert re.search(rf"(?<![\d.]){number}(?![\d.])", msg), f"{number} not in {msg!r}"
    else:
        raise AssertionError("E % P != 0 did not raise ValueError")
    assert_untouched(model, original)


# --------------------------------------------------------------------------------------------
# the 4-rank run: uneven batches, subgroups and 2-D meshes


def four_rank_run(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    results: dict = {"cases": {}, "checks": {}}
    cases = results["cases"]
    qwen = base_model("qwen3_moe")
    # uneven T per rank (one rank with none) over the whole world: 2 local experts per rank
    uneven = {"uneven_4": (2, [5, 0, 11, 3], "random", None), "uneven_4_k4": (4, [1, 9, 0, 6], "random", None)}
    engine_variant(cases, "qwen3_moe/world_4", qwen, list(range(world)), rank, None, None, uneven)
    # a 2-D mesh (dp, ep): EP inside each pair [0, 1] and [2, 3]; expert gradients reduced over "dp"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    pair = [r for r in range(world) if r // 2 == rank // 2]
    engine_variant(
        cases,
        "qwen3_moe/mesh_dp_ep",
        qwen,
        pair,
        rank % 2,
        mesh,
        None,
        pick(["random_k2", "rank_with_zero_tokens"]),
        grad_sources=list(range(world)),
    )
    # a (dp=4, ep=1) mesh: EP size 1, no exchange with anyone
    mesh41 = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "ep"))
    engine_variant(cases, "qwen3_moe/mesh_dp4_ep1", qwen, [rank], 0, mesh41, None, pick(["random_k2"]))
    from balance_workers import capacity_run

    results["capacity"] = capacity_run(rank, world)
    return results


# --------------------------------------------------------------------------------------------
# bad input: one rank raises, the launcher reports it


def bad_index_shape_run(rank, world):
    model = base_model("qwen3_moe")
    epmoe.apply_expert_parallel(model)
    experts = experts_of(model)
    hidden, index, weights, _ = make_inputs(1, rank, 6, 2, "random", None, world)
    if rank == world - 1:
        index = index[:, :1].reshape(-1)  # (T,) instead of (T, K)
    experts(hidden, index, weights)
    dist.barrier()
    return True
