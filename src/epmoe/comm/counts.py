"""Counts exchange: every rank learns how many rows it sends to and receives from each expert.

One ``all_to_all_single`` of the per-global-expert histograms with equal splits of ``e`` rows, each
row behind a step header (:mod:`epmoe.comm.steps`) whose flag says whether the sender's histogram
has a negative count, so that bad input raises on every rank rather than on some while the others
wait in their next collective; then one host read of what was received and sent. With ``W = 2`` ranks and
``e = 2`` local experts::

    rank 0 tokens_per_expert = [a00 a01 | a10 a11]      (global expert g = r*e + j)
    rank 1 tokens_per_expert = [b00 b01 | b10 b11]

    rank 0: send_counts = [a00 a01 a10 a11]   recv_counts = [a00 a01 | b00 b01]   (source-rank-major)
    rank 1: send_counts = [b00 b01 b10 b11]   recv_counts = [a10 a11 | b10 b11]

An EP layer's forward runs :func:`exchange_counts_on` on its model's step channel (the header names the
layer and its forward call). The public :func:`exchange_counts` first agrees on the histogram's
length in a small header exchange, so ranks with different lengths raise instead of aborting.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from epmoe import errors, platform
from epmoe.comm.steps import COUNTS, DTYPE_CODES, MODEL_WIDE, Position, StepChannel, dtype_name, world_size


def exchange_counts(
    tokens_per_expert: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[list[int], list[int]]:
    """``(send_counts, recv_counts)`` as Python lists of length ``W*e`` (see the module docstring).

    ``tokens_per_expert``: ``(W*e,)`` integer tensor, this rank's histogram over global experts, on
    the device the group communicates on. Costs two small collectives (lengths, then counts) and two
    host synchronisations; ranks whose lengths differ, or a rank whose histogram is invalid, raise
    ``ValueError`` on every rank.
    """
    ep_size = world_size(group, "exchange_counts")
    try:
        _validate(tokens_per_expert, ep_size)
    except (TypeError, ValueError):
        if ep_size > 1:  # the peers are entering the lengths exchange: join it, flagged, then raise
            lengths = torch.zeros(ep_size, 1, dtype=torch.int64, device=platform.group_device(group))
            StepChannel(group, 1, what="exchange_counts").exchange(
                Position(MODEL_WIDE, COUNTS, 0), lengths, torch.ones((), dtype=torch.int64, device=lengths.device)
            )
        raise
    if ep_size == 1:
        both = tokens_per_expert.to(torch.int64).tolist()
        if min(both) < 0:
            raise _negative_counts(both, [1])
        return both, list(both)
    device, length = tokens_per_expert.device, tokens_per_expert.numel()
    lengths, invalid = StepChannel(group, 1, what="exchange_counts").exchange(
        Position(MODEL_WIDE, COUNTS, 0), torch.full((ep_size, 1), length, dtype=torch.int64, device=device)
    )
    if any(invalid):
        bad = [rank for rank, flag in enumerate(invalid) if flag]
        raise ValueError(
            f"exchange_counts(tokens_per_expert): rank(s) {bad} passed an invalid histogram (see "
            f"their error); no rank exchanges counts"
        )
    theirs = [row[0] for row in lengths]
    if any(n != length for n in theirs):
        raise ValueError(
            f"exchange_counts(tokens_per_expert): the ranks' histograms differ in length: {errors.summarize(theirs)} "
            f"by rank (each must be W*e = the global number of experts)"
        )
    channel = StepChannel(group, length // ep_size + 2, what="exchange_counts")
    exchanged = exchange_counts_on(channel, Position(MODEL_WIDE, COUNTS, 1), tokens_per_expert)
    return exchanged.send_counts, exchanged.recv_counts


class CountsExchanged(NamedTuple):
    """What :func:`exchange_counts_on` returns, on the host."""

    send_counts: list[int]  # (W*e,) rows this rank sends to expert (r, j), rank-major
    recv_counts: list[int]  # (W*e,) rows this rank receives from rank s for local expert j, (s, j)
    slots_by_rank: list[int]  # (W,) every source's histogram total
    extras_received: list[list[int]]  # (W, k) the extra columns each source sent this rank
    extras_sent: list[list[int]]  # (W, k) the extra columns this rank sent each peer


def exchange_counts_on(
    channel: StepChannel,
    position: Position,
    tokens_per_expert: torch.Tensor,
    rows_dtype: torch.dtype | None = None,
    extra: torch.Tensor | None = None,
) -> CountsExchanged:
    """:func:`exchange_counts` as one header exchange on ``channel`` at ``position`` (lengths known
    to agree; ``channel.width`` at least ``e + 2``, ``e + 2 + k`` with ``k`` extra columns), plus
    every source's total slots (each row also carries its sender's histogram total and ``rows_dtype``,
    the dtype of the rows about to travel) and ``extra`` columns (int64 on the device: a ``(k,)``
    vector sent to every peer alike, e.g. :mod:`epmoe.ep.guard`'s values, or ``(W, k)``, row ``r`` to
    peer ``r``, e.g. how many rows it is about to receive). Raises on every rank if the headers differ,
    any rank's histogram is negative, or the ranks' rows differ in dtype (their exchanges would not
    fit together: gloo aborts the process)."""
    W = channel.size
    send_We = tokens_per_expert.to(torch.int64).view(W, -1)
    negative = (send_We < 0).any().to(torch.int64)  # on the device: no host read yet
    total = send_We.sum().expand(W, 1)
    dtype = send_We.new_full((W, 1), DTYPE_CODES[rows_dtype] if rows_dtype is not None else 0)
    columns = [send_We, total, dtype]
    if extra is not None:
        columns.append(extra.to(torch.int64).view(-1 if extra.dim() == 2 else 1, extra.shape[-1]).expand(W, -1))
    received, flags, sent = channel.exchange(position, torch.cat(columns, dim=1), negative, echo=True)
    k = 0 if extra is None else extra.shape[-1]
    extras_received, extras_sent = [row[len(row) - k :] for row in received], [row[len(row) - k :] for row in sent]
    received, sent = [row[: len(row) - k] for row in received], [row[: len(row) - k] for row in sent]
    send_counts = [c for row in sent for c in row[:-2]]
    recv_counts = [c for row in received for c in row[:-2]]
    if any(flags):
        raise _negative_counts(send_counts, flags)
    dtypes = [row[-1] for row in received]
    if len(set(dtypes)) > 1:
        raise ValueError(
            f"epmoe: the EP ranks run {position.describe(channel.layer_names)} in different dtypes: "
            f"{[dtype_name(d) for d in dtypes]} by rank (this is EP rank {channel.rank}); every rank must hold "
            f"the model in the same dtype (call model.to(dtype) on every rank)"
        )
    return CountsExchanged(send_counts, recv_counts, [row[-2] for row in received], extras_received, extras_sent)


def _validate(tokens_per_expert, ep_size: int) -> None:
    if not isinstance(tokens_per_expert, torch.Tensor):
        raise TypeError(
            f"exchange_counts(tokens_per_expert): expected a Tensor, got {type(tokens_per_expert).__name__}"
        )
    if (
        tokens_per_expert.dim() != 1
        or tokens_per_expert.dtype.is_floating_point
        or tokens_per_expert.dtype == torch.bool
    ):
        raise ValueError(
            f"exchange_counts(tokens_per_expert): expected a 1-D integer tensor, got shape "
            f"{tuple(tokens_per_expert.shape)} dtype {tokens_per_expert.dtype}"
        )
    if tokens_per_expert.device.type == "meta":
        raise ValueError(
            "exchange_counts(tokens_per_expert): the tensor is on the meta device and has no values to exchange; "
            "materialise the model first (epmoe.from_pretrained, or to_empty() then load the weights)"
        )
    if tokens_per_expert.numel() == 0 or tokens_per_expert.numel() % ep_size:
        raise ValueError(
            f"exchange_counts(tokens_per_expert): length {tokens_per_expert.numel()} is not a positive multiple "
            f"of the group size {ep_size}"
        )


def _negative_counts(send_counts: list[int], negative_by_rank: list[int]) -> ValueError:
    """The error every rank raises alike when some rank's histogram had a negative count."""
    bad = [rank for rank, flag in enumerate(negative_by_rank) if flag]
    mine = f"; this rank's: {errors.negatives(send_counts)}" if min(send_counts) < 0 else ""
    return ValueError(f"exchange_counts(tokens_per_expert): negative counts on rank(s) {bad}{mine}")
