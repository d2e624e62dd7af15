"""Expert-load telemetry: how many routed slots each global expert received, summed over the EP group.

Each forward already tells every rank, in its counts exchange, how many rows its own ``e`` local
experts receive from every source; the layer adds them to its counters (small host tensors, added to
in place: no collective, and a compiled forward traces the addition). A recomputed forward (gradient
checkpointing, inside the backward) adds nothing. :func:`expert_load` then assembles the global
histogram in one step-header exchange per experts module, each rank's row carrying its local
counters::

    EP = 2, E = 4          rank 0 counts experts 0 1      rank 1 counts experts 2 3
    expert_load            [n0 n1 | n2 n3] on both ranks  (= the unsharded model's histogram of the
                                                           ranks' batches concatenated)

Every rank of the EP group must call :func:`expert_load` (a collective, tagged like every EP
collective: :mod:`epmoe.comm.steps`). A model loaded through transformers' own expert parallelism with
``ep_implementation="epmoe"`` is counted the same way (its experts modules carry their counters:
:func:`epmoe.ep.counters.attach_counted`), its names those of the experts modules. ``dropped=True`` gives the slots
``ExpertParallelConfig.capacity_factor`` dropped (none when dropless, the default), counted the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from epmoe.comm.steps import TELEMETRY
from epmoe.ep.config import DROPPED_COUNTER, TELEMETRY_COUNTER
from epmoe.ep.counters import CountedLayer, counted_modules
from epmoe.ep.state import ExpertParallelState, ep_states


def counted_layers(model: nn.Module, caller: str) -> list[tuple[str, CountedLayer]]:
    """``(experts module name, its counted layer)`` of every experts module of ``model`` that epmoe
    runs (made expert-parallel by epmoe, or run by it inside transformers' EP); ``TypeError`` /
    ``ValueError`` naming ``caller`` for anything else."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}(model): expected an nn.Module, got {type(model).__name__}")
    found = [(state.shard.module_name, state) for _, _, state in ep_states(model)] + list(counted_modules(model))
    if not found:
        raise ValueError(
            f"{caller}(model): {type(model).__name__} is not expert-parallel (call apply_expert_parallel, or load it "
            f"with transformers' DistributedConfig(ep_size=..., ep_implementation='epmoe'))"
        )
    return found


def global_load(layer: CountedLayer, counter: str) -> torch.Tensor:
    """``(E,)`` int64: the slots each global expert received in ``counter`` of one layer, summed over
    the EP group (one header exchange; none on a single rank)."""
    local = layer.loads[counter].tolist()
    channel = layer.channel
    if channel is None:
        return torch.tensor(local, dtype=torch.int64)
    rows = torch.tensor([local] * channel.size, dtype=torch.int64, device=layer.device)
    received, _ = channel.exchange(channel.next_call(TELEMETRY), rows)
    return torch.tensor([c for row in received for c in row], dtype=torch.int64)


def replicas_load(state: ExpertParallelState, load_E: torch.Tensor) -> torch.Tensor:
    """``load_E`` (one EP group's) summed over the ``"dp"`` replicas of an EP x DP mesh too (a header
    exchange then an all-reduce over ``"dp"``; nothing without replicas): every rank's batches."""
    channel = state.model.dp_channel
    if channel is None:
        return load_E
    total = load_E.to(state.device)
    channel.all_reduce(total, channel.next_call(TELEMETRY))
    return total.cpu()


def expert_load(model: nn.Module, *, dropped: bool = False, computed: bool = False) -> dict[str, torch.Tensor]:
    """Experts module name -> ``(E,)`` int64 routed slots per global expert since the last
    :func:`reset_expert_load` (see the module docstring); with ``dropped``, the slots capacity
    dropped (dropless: zeros); with ``computed``, ``(W,)``: the slots each EP rank computed, its
    expert replicas' included (:mod:`epmoe.ep.replicas`; without them, its experts' routed slots
    less those dropped). Collective over the EP group."""
    for name, value in (("dropped", dropped), ("computed", computed)):
        if not isinstance(value, bool):
            raise TypeError(f"expert_load({name}): expected a bool, got {type(value).__name__}")
    if dropped and computed:
        raise ValueError("expert_load(dropped, computed): ask for one at a time")
    if computed:
        return {name: computed_load(layer) for name, layer in counted_layers(model, "expert_load")}
    counter = DROPPED_COUNTER if dropped else TELEMETRY_COUNTER
    return {name: global_load(layer, counter) for name, layer in counted_layers(model, "expert_load")}


def computed_load(layer: CountedLayer) -> torch.Tensor:
    """``(W,)`` int64: the slots each EP rank of one layer computed (see :func:`expert_load`)."""
    routed_E = global_load(layer, TELEMETRY_COUNTER) - global_load(layer, DROPPED_COUNTER)
    W = 1 if layer.channel is None else layer.channel.size
    computed_W = routed_E.view(W, -1).sum(1)
    if layer.loads.moved_W is not None:
        computed_W += torch.tensor(layer.loads.moved_W, dtype=torch.int64)
    return computed_W


def reset_expert_load(model: nn.Module) -> None:
    """Start counting afresh (local: no collective)."""
    for _, layer in counted_layers(model, "reset_expert_load"):
        layer.loads[TELEMETRY_COUNTER].zero_()
        layer.loads[DROPPED_COUNTER].zero_()
        layer.loads.moved_W = None


def max_over_mean(counts) -> float:
    """The busiest expert's load over the mean (1.0: perfect balance; NaN when nothing was routed)."""
    counts = [float(c) for c in counts]
    total = sum(counts)
    return max(counts) * len(counts) / total if total else float("nan")


def load_summary(loads: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Per experts module: ``max_over_mean`` (the busiest expert's load over the mean; 1.0 is
    perfect balance) and ``idle_share`` (the share of experts that received nothing)."""
    if not isinstance(loads, dict) or not all(isinstance(v, torch.Tensor) and v.dim() == 1 for v in loads.values()):
        raise TypeError("load_summary(loads): expected what expert_load returns, {name: (E,) tensor}")
    out = {}
    for name, load in loads.items():
        out[name] = {"max_over_mean": max_over_mean(load.tolist()), "idle_share": (load == 0).double().mean().item()}
    return out
