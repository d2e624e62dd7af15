"""All-to-all-v with autograd: the backward of an exchange is the reverse exchange.

    rank 0 rows [to 0 | to 1]          rank 0 rows [from 0 | from 1]
    rank 1 rows [to 0 | to 1]   ---->  rank 1 rows [from 0 | from 1]
                input_splits                      output_splits

Every rank calls the collective in forward and in backward, also with zero rows to move, so a
rank that routes or receives nothing never leaves the others waiting. The exchange is a
``torch.library`` custom op (``epmoe::all_to_all_v``, with a fake kernel and registered autograd),
which ``torch.compile`` traces as one call.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from epmoe.comm.steps import world_size
from epmoe.errors import double_backward_error

_GROUPS: dict[str, dist.ProcessGroup] = {}  # group_name -> the latest group of that name: the op takes names


@dataclass
class Traffic:
    """What :func:`all_to_all_v` and :func:`~epmoe.comm.static.static_exchange` handed the collective
    for other ranks (this rank's own rows, which stay in memory, excluded; a static exchange's padding
    included), forward and backward, while :func:`count_traffic` was open."""

    bytes_to_peers: int = 0
    exchanges: int = 0
    replica_weight_bytes: int = 0  # of bytes_to_peers: expert replicas' weights and their gradients (comm.replicas)
    bytes_by_peer: dict[int, int] = field(default_factory=dict)  # global rank -> bytes all_to_all_v handed it


_RECORDERS: list[Traffic] = []


@contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count this process's :func:`all_to_all_v`, :func:`~epmoe.comm.static.static_exchange` and
    shared-batch sums' (:mod:`epmoe.comm.reduce`) traffic inside the ``with`` block (the fused ops' pipelined exchanges and the small step-header
    exchanges are not counted)."""
    traffic = Traffic()
    _RECORDERS.append(traffic)
    try:
        yield traffic
    finally:
        _RECORDERS.remove(traffic)


def record_traffic(bytes_to_peers: int) -> None:
    """Add one exchange handing ``bytes_to_peers`` to other ranks to every open :func:`count_traffic`."""
    for traffic in _RECORDERS:
        traffic.bytes_to_peers += bytes_to_peers
        traffic.exchanges += 1


def record_replica_weights(bytes_to_peers: int) -> None:
    """Say that ``bytes_to_peers`` of what the exchanges hand other ranks are expert replicas' weights
    and gradients (counted by :func:`all_to_all_v` as well), to every open :func:`count_traffic`."""
    for traffic in _RECORDERS:
        traffic.replica_weight_bytes += bytes_to_peers


@torch.library.custom_op("epmoe::all_to_all_v", mutates_args=())
def _all_to_all_v_op(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group_name: str
) -> torch.Tensor:
    """The op behind :func:`all_to_all_v` (a ``torch.library`` custom op: ``torch.compile`` traces
    it as one call, its output rows ``sum(output_splits)``); counted by :func:`count_traffic`."""
    group = _GROUPS[group_name]
    if _RECORDERS:
        _record_splits(group, input_splits, math.prod(x.shape[1:]) * x.element_size())
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def _record_splits(group: dist.ProcessGroup, input_splits: list[int], row_bytes: int) -> None:
    """One exchange of ``input_splits`` rows of ``row_bytes`` each, to every open :func:`count_traffic`:
    in total and by destination (global rank), this rank's own rows left out."""
    me = dist.get_rank(group)
    record_traffic((sum(input_splits) - input_splits[me]) * row_bytes)
    for peer, rows in enumerate(input_splits):
        if peer != me and rows:
            destination = dist.get_global_rank(group, peer)
            for traffic in _RECORDERS:
                traffic.bytes_by_peer[destination] = traffic.bytes_by_peer.get(destination, 0) + rows * row_bytes


@_all_to_all_v_op.register_fake
def _all_to_all_v_fake(x, output_splits, input_splits, group_name):
    return x.new_empty((sum(output_splits), *x.shape[1:]))


def _setup_context(ctx, inputs, output):
    _, output_splits, input_splits, group_name = inputs
    ctx.splits, ctx.group_name = (output_splits, input_splits), group_name


def _backward(ctx, dy):
    if torch.is_grad_enabled():
        raise double_backward_error("all_to_all_v")
    output_splits, input_splits = ctx.splits
    return torch.ops.epmoe.all_to_all_v(dy, input_splits, output_splits, ctx.group_name), None, None, None


_all_to_all_v_op.register_autograd(_backward, setup_context=_setup_context)


def all_to_all_v(
    x: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Send ``input_splits[r]`` consecutive rows of ``x`` to rank ``r``; receive ``output_splits[s]`` from ``s``.

    Differentiable; returns ``(sum(output_splits), *x.shape[1:])``. With a group of size 1 it returns
    ``x`` itself (splits must then equal ``[len(x)]``).
    """
    initialised = dist.is_available() and dist.is_initialized()
    ep_size = dist.get_world_size(group) if initialised else world_size(group, "all_to_all_v")  # 1, or its error
    output_splits, input_splits = list(output_splits), list(input_splits)
    if len(output_splits) != ep_size or len(input_splits) != ep_size:
        raise ValueError(
            f"all_to_all_v(output_splits, input_splits): need {ep_size} splits each, got "
            f"{len(output_splits)} and {len(input_splits)}"
        )
    if sum(input_splits) != x.shape[0]:
        raise ValueError(f"all_to_all_v(input_splits): splits sum to {sum(input_splits)}, x has {x.shape[0]} rows")
    if ep_size == 1:
        if output_splits != input_splits:
            raise ValueError(f"all_to_all_v(output_splits): {output_splits} differs from input_splits on a group of 1")
        return x
    group = group if group is not None else dist.group.WORLD
    _GROUPS[group.group_name] = group  # a re-initialised default group reuses its name
    return torch.ops.epmoe.all_to_all_v(x, output_splits, input_splits, group.group_name)
