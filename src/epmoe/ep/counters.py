"""A layer's routed-load counters: slots per local expert, added by each forward.

Each experts module keeps one :class:`LoadCounters`: counter name -> ``(e,)`` int64 slots per local
expert, on whatever device the counts were (counts that never left the device are added there, not
read). The counters epmoe keeps: :data:`~epmoe.ep.config.TELEMETRY_COUNTER` (what
:func:`epmoe.expert_load` reports) and :data:`~epmoe.ep.config.DROPPED_COUNTER` (the slots
``capacity_factor`` dropped); :class:`epmoe.LoadBalancer` adds its own. Counters are reset in
place, never removed: a compiled forward adds to them without recompiling.

What reads them (:mod:`epmoe.ep.load`) takes any :class:`CountedLayer`: its counters, the step channel
its EP group exchanges headers on and the device that group's collectives run on. A model epmoe made
expert-parallel gives one per experts module (its :class:`~epmoe.ep.state.ExpertParallelState`); an
experts module epmoe runs inside another library's expert parallelism (transformers' EP with
``ep_implementation="epmoe"``) carries one of its own, kept by :func:`attach_counted`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from epmoe.comm.steps import StepChannel
from epmoe.ep.config import DROPPED_COUNTER, TELEMETRY_COUNTER

_ATTRIBUTE = "_epmoe_counted"  # where an experts module run inside another library's EP keeps its CountedLayer


class LoadCounters(dict):
    """``counter -> (e,) int64`` slots per local expert (see the module docstring). ``routed``: the
    counters each forward's routed slots add to (the telemetry's, and any added with ``routed=True``)."""

    def __init__(self, num_local_experts: int):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.routed: tuple[str, ...] = (TELEMETRY_COUNTER,)
        self.moved_W: list[int] | None = None  # slots expert replicas moved onto (+) / off (-) each EP rank
        for counter in (TELEMETRY_COUNTER, DROPPED_COUNTER):
            self.add_counter(counter)

    def add_counter(self, counter: str, *, routed: bool = False) -> None:
        """Keep ``counter`` (zero), if not kept yet; ``routed``: forwards add their routed slots to it."""
        self.setdefault(counter, torch.zeros(self.num_local_experts, dtype=torch.int64))
        if routed and counter not in self.routed:
            self.routed = (*self.routed, counter)

    def count(self, local_counts_e: list[int] | torch.Tensor, counters: tuple[str, ...] | None = None) -> None:
        """Add a forward's slots per local expert (a host list, or a tensor on whatever device holds
        it) to ``counters`` (default: :attr:`routed`). A forward recomputed inside the backward
        (gradient checkpointing) adds nothing (a compiled one replays no Python side effect: this runs
        once per traced forward)."""
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
            return
        counts = torch.as_tensor(local_counts_e, dtype=torch.int64)
        for counter in counters or self.routed:
            if self[counter].device != counts.device:  # counts on the device: the counter follows them
                self[counter] = self[counter].to(counts.device)
            self[counter].add_(counts)

    def count_moved(self, moved_W: list[int]) -> None:
        """Add a forward's slots that expert replicas moved onto (+) and off (-) each EP rank
        (:meth:`epmoe.ep.replicas.ReplicaPlan.moved_W`: the same on every rank); not in a recomputed forward."""
        if torch._C._current_graph_task_id() != -1:
            return
        self.moved_W = moved_W if self.moved_W is None else [a + b for a, b in zip(self.moved_W, moved_W)]


class CountedLayer(Protocol):
    """An experts module's routed-load counters and where its EP group meets (see the module docstring)."""

    loads: LoadCounters

    @property
    def channel(self) -> StepChannel | None:
        """The EP group's step channel (``None``: a group of one)."""

    @property
    def device(self) -> torch.device:
        """Where the EP group's collectives run."""


def attach_counted(module: nn.Module, layer: CountedLayer) -> None:
    """Keep ``layer`` on ``module``, an experts module epmoe runs inside another library's EP."""
    setattr(module, _ATTRIBUTE, layer)


def counted_modules(model: nn.Module) -> Iterator[tuple[str, CountedLayer]]:
    """``(name, layer)`` of every module of ``model`` that :func:`attach_counted` was given, in
    ``named_modules()`` order."""
    for name, module in model.named_modules():
        layer = getattr(module, _ATTRIBUTE, None)
        if layer is not None:
            yield name, layer
