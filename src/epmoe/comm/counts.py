"""Counts exchange: every rank learns how many rows it sends to and receives from each expert.

One ``all_to_all_single`` of the per-global-expert histograms with equal splits of ``e`` rows (each
followed by one flag saying whether the sender's histogram has a negative count, so that bad input
raises on every rank rather than on some while the others wait in their next collective), then one
host read for both lists. With ``W = 2`` ranks and ``e = 2`` local experts::

    rank 0 tokens_per_expert = [a00 a01 | a10 a11]      (global expert g = r*e + j)
    rank 1 tokens_per_expert = [b00 b01 | b10 b11]

    rank 0: send_counts = [a00 a01 a10 a11]   recv_counts = [a00 a01 | b00 b01]   (source-rank-major)
    rank 1: send_counts = [b00 b01 b10 b11]   recv_counts = [a10 a11 | b10 b11]
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from epmoe import platform


def exchange_counts(
    tokens_per_expert: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[list[int], list[int]]:
    """``(send_counts, recv_counts)`` as Python lists of length ``W*e`` (see the module docstring).

    ``tokens_per_expert``: ``(W*e,)`` integer tensor, this rank's histogram over global experts, on
    the device the group communicates on. Costs one collective and one host synchronisation.
    """
    if not isinstance(tokens_per_expert, torch.Tensor):
        raise TypeError(f"exchange_counts(tokens_per_expert): expected a Tensor, got {type(tokens_per_expert).__name__}")
    if tokens_per_expert.dim() != 1 or tokens_per_expert.dtype.is_floating_point or tokens_per_expert.dtype == torch.bool:
        raise ValueError(
            f"exchange_counts(tokens_per_expert): expected a 1-D integer tensor, got shape "
            f"{tuple(tokens_per_expert.shape)} dtype {tokens_per_expert.dtype}"
        )
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if tokens_per_expert.numel() == 0 or tokens_per_expert.numel() % world:
        raise ValueError(
            f"exchange_counts(tokens_per_expert): length {tokens_per_expert.numel()} is not a positive multiple "
            f"of the group size {world}"
        )
    send_E = tokens_per_expert.to(torch.int64)
    if world == 1:
        both = send_E.tolist()
        _check_non_negative(both, [min(both) < 0])
        return both, list(both)
    negative = (send_E < 0).any().to(torch.int64).expand(world, 1)  # on the device: no host read yet
    send_We1 = torch.cat([send_E.view(world, -1), negative], dim=1)
    recv_We1 = torch.empty_like(send_We1)
    dist.all_to_all_single(recv_We1.view(-1), send_We1.view(-1), group=group)
    # The collective may run on its own stream (HCCL): host reads are not ordered with it.
    platform.synchronize(send_E.device)
    both = torch.stack([send_We1, recv_We1]).tolist()  # [sent, received]: W rows of e counts + the flag
    send_counts = [c for row in both[0] for c in row[:-1]]
    recv_counts = [c for row in both[1] for c in row[:-1]]
    _check_non_negative(send_counts, [row[-1] for row in both[1]])
    return send_counts, recv_counts


def _check_non_negative(send_counts: list[int], negative_by_rank: list[int]) -> None:
    """Raise, on every rank alike, if any rank's histogram had a negative count."""
    bad = [rank for rank, flag in enumerate(negative_by_rank) if flag]
    if bad:
        raise ValueError(
            f"exchange_counts(tokens_per_expert): negative counts on rank(s) {bad}; this rank sends {send_counts}"
        )
