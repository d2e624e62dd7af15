"""Counts exchange: every rank learns how many rows it sends to and receives from each expert.

One ``all_to_all_single`` of the per-global-expert histograms with equal splits of ``e`` rows, then one
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
        return both, list(both)
    recv_E = torch.empty_like(send_E)
    dist.all_to_all_single(recv_E, send_E, group=group)
    # The collective may run on its own stream (HCCL): host reads are not ordered with it.
    platform.synchronize(send_E.device)
    both = torch.cat([send_E, recv_E]).tolist()
    num = send_E.numel()
    send_counts, recv_counts = both[:num], both[num:]
    if min(both) < 0:
        raise ValueError(f"exchange_counts(tokens_per_expert): negative counts after the exchange: {both}")
    return send_counts, recv_counts
