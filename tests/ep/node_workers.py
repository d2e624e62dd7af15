"""Rank functions for tests/ep/test_nodes.py (module level, so spawned ranks can import them).

The two-level exchange (``dispatch="nodes"``) against the per-rank exchange and the unsharded model,
on nodes emulated with ``ExpertParallelConfig(ranks_per_node=P)``: the experts module on crafted
routing, and the whole model's training steps.
"""

from __future__ import annotations

import copy
import zlib

import torch
from ep_layer_workers import compare_case, experts_of

import epmoe
from epmoe.models import build_model

NUM_EXPERTS = 8

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
    model = build_model("qwen3_moe", num_experts=NUM_EXPERTS, dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            for param in layer.mlp.experts.parameters():
                param.copy_(torch.randn(param.shape, generator=g, dtype=torch.float64) * 0.1)
    return model


def module_cases(rank, world, ranks_per_node, cases=CASES_4):
    """Each routing case on the experts module with the two-level exchange, against the unsharded
    module and the per-rank exchange: relative errors, and the transport that ran."""
    model = base_model()
    ref = copy.deepcopy(experts_of(model))
    plain = copy.deepcopy(model)
    epmoe.apply_expert_parallel(model, config={"dispatch": "nodes", "ranks_per_node": ranks_per_node})
    epmoe.apply_expert_parallel(plain, config={"dispatch": "alltoallv"})
    transport = experts_of(model)._epmoe.transport.name
    out = {}
    for name, case in cases.items():
        seed = zlib.crc32(name.encode())
        errors, zeros = compare_case(name, case, ref, experts_of(model), list(range(world)), rank, torch.float64, seed)
        plain_errors, _ = compare_case(
            name, case, ref, experts_of(plain), list(range(world)), rank, torch.float64, seed
        )
        out[name] = {"errors": errors, "exact_zero": zeros, "plain": plain_errors, "transport": transport}
    return out


def four_rank_run(rank, world):
    return {"module_2x2": module_cases(rank, world, 2), "module_1x4": module_cases(rank, world, 4)}
