"""The transport interface: what a layer gives a transport for one call, and what it gets back.

A :class:`Dispatcher` moves one layer's tokens to the ranks of their experts and their outputs back
(one subclass per transport, :mod:`epmoe.ep.dispatch`); it only moves tokens. Everything else of the
call is the layer's (:mod:`epmoe.ep.layer`): its position, the counts exchange, the experts, the
load counters, the step guard, the backward header. The layer hands the transport a :class:`Link`
(what this call knows: the step channel, the shard, the position, the counts where the transport
needs them) and gets back the rows and a frozen *meta* record of the transport's own, whose
:class:`Arrived` tells the layer what the local experts run and what the call saw::

    rows, meta = transport.dispatch(hidden_TH, top_k_index_TK, top_k_weights_TK, link)
    out_rows   = <the local experts on rows, as meta.arrived says>         (the layer's)
    out_TH     = transport.combine(out_rows, meta)

A dispatcher is built once per layer, when EP is applied (:mod:`epmoe.ep.transports`), and holds
only what was decided then (nothing that points back at the layer: a deep copy of the model copies
it as a value).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from epmoe.comm.steps import Position, StepChannel
from epmoe.ep.config import ExpertShard
from epmoe.ep.counts import LayerCounts
from epmoe.ep.replicas import ReplicaPlan
from epmoe.ep.routing import RowPairs, RowSources
from epmoe.gmm import GmmBackend


@dataclass(frozen=True)
class SharedExpert:
    """A block's shared expert ``down(act_fn(gate(x)) * up(x))`` of bias-free Linears (``mlp``), and
    the block's gate on its output, ``sigmoid(gate(x))`` (Qwen2-MoE), or ``None`` (DeepSeek)."""

    mlp: nn.Module
    gate: nn.Module | None = None


@dataclass(frozen=True)
class Link:
    """What a layer gives its transport for one call."""

    channel: StepChannel | None  # the EP group's step channel (None: a group of one, nothing moves)
    shard: ExpertShard  # which experts this rank holds
    position: Position  # the call's forward position (its step headers name it)
    checks: bool  # whether the optional step checks run on this device (ExpertParallelConfig.check_steps)
    counts: LayerCounts | None = None  # the counts exchange's, where the transport needs_counts
    capacity: int | None = None  # pairs each expert keeps (capacity_factor), None: dropless
    guard: torch.Tensor | None = None  # the step guard's values to carry, where no counts exchange carried them
    projections: tuple[torch.Tensor, ...] = ()  # the expert weights a transport multiplies by (its projection_names)
    gmm_backend: GmmBackend | None = None  # their grouped-matmul backend, with projections
    shared: SharedExpert | None = None  # the block's shared expert, where the transport carries_shared
    plan: ReplicaPlan | None = None  # the call's expert replicas (epmoe.ep.replicas), where it has any


@dataclass(frozen=True)
class RoutedRows:
    """What the local experts run on a transport's rows: the routed MLP (``epmoe::routed_mlp``), each
    row expanded to its ``pairs``, weighted by ``weights_RK`` and summed per row; ``sources``: where
    the rows came from, where more than one rank sent them."""

    weights_RK: torch.Tensor  # (R, K) each received row's routing weights
    pairs: RowPairs  # the pairs the rows expand to, expert-major
    sources: RowSources | None = None
    replica_pairs: RowPairs | None = None  # the pairs of the experts other ranks lend this call (epmoe.ep.replicas)


@dataclass(frozen=True)
class Arrived:
    """What a dispatch tells its layer: ``routed``, how the local experts run the rows (``None``: the
    rows are already up-projected, the experts' gate / activation is left: the fused transport);
    ``load_e``, the call's slots per local expert (a host list or a device tensor), ``dropped_e`` the
    slots capacity dropped, ``peer_guards`` the step guard's values the peers sent, where they
    travelled with the rows."""

    routed: RoutedRows | None
    load_e: list[int] | torch.Tensor
    dropped_e: list[int] | None = None
    peer_guards: list[list[int]] | None = None


class Dispatcher(ABC):
    """One layer's transport (see the module docstring); ``name`` is its ``ExpertParallelConfig.dispatch``
    value. ``needs_counts``: whether the layer runs the counts exchange before :meth:`dispatch`;
    ``carries_shared``: whether it takes a block's shared expert (``link.shared``), computed in its
    communication gaps and added by :meth:`combine`; ``projection_names``: the expert weights it
    multiplies by itself (``link.projections``, in this order)."""

    name: ClassVar[str]
    needs_counts: bool = True
    ranks_per_node: int | None = None  # the two-level exchange's P: the counts exchange carries its splits
    carries_shared: ClassVar[bool] = False
    projection_names: tuple[str, ...] = ()

    def for_call(self) -> Dispatcher:
        """The transport that runs the layer's next call (itself; one that switches per call differs)."""
        return self

    def traced_whole(self, checks: bool) -> bool:
        """Whether a call runs on the device alone (no host read), which ``torch.compile`` traces
        whole; otherwise the layer runs it behind one graph break. ``checks``: the step checks run."""
        return False

    @abstractmethod
    def dispatch(
        self, hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor, link: Link
    ) -> tuple[torch.Tensor, Any]:
        """``(rows, meta)``: the tokens on their experts' ranks, in the transport's row order, and
        what :meth:`combine` needs of this call (its ``arrived``: :class:`Arrived`)."""

    @abstractmethod
    def combine(self, out_rows: torch.Tensor, meta: Any) -> torch.Tensor:
        """``(T, H)``: each token's experts' outputs back on its rank, weighted and summed (plus the
        shared expert's, where one was given)."""
