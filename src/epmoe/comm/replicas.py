"""Expert replicas' weight exchange: some experts' weights to the ranks that compute their rows for one call.

Each owner sends the experts a replica plan names (:mod:`epmoe.ep.replicas`) to their helpers, and
each helper receives them, every tensor of an expert flattened into one row, all in one
:func:`~epmoe.comm.all_to_all.all_to_all_v`; its backward is the reverse exchange, so the gradient of
each copy comes back to its owner and autograd adds it to the owner's own::

    owner 0 up (e, N, H), down (e, H, I)   sends expert j to helper 1
      row [up[j] | down[j]] --all-to-all-v--> helper 1: up_rep (1, N, H), down_rep (1, H, I)
    backward: d up_rep, d down_rep --all-to-all-v--> owner 0: added to d up[j], d down[j]

Every rank of the group calls it, also one that sends or receives nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from epmoe.comm.all_to_all import all_to_all_v, record_replica_weights


def send_expert_weights(
    weights: Sequence[torch.Tensor | None],
    send_index: list[int],
    send_W: list[int],
    recv_W: list[int],
    group: dist.ProcessGroup | None,
) -> list[torch.Tensor | None]:
    """Each of ``weights`` (``(e, ...)`` per local expert, one dtype; ``None``: absent, stays
    ``None``) at the local experts ``send_index`` (destination-major: ``send_W[r]`` of them to rank
    ``r``), exchanged; returns ``(sum(recv_W), ...)`` per tensor, source-major. Differentiable."""
    present = [w for w in weights if w is not None]
    if len({w.dtype for w in present}) > 1:
        raise ValueError(f"send_expert_weights(weights): expected one dtype, got {[w.dtype for w in present]}")
    if len(send_index) != sum(send_W):
        raise ValueError(
            f"send_expert_weights(send_index): {len(send_index)} experts for send_W summing to {sum(send_W)}"
        )
    index = torch.tensor(send_index, dtype=torch.int64, device=present[0].device)
    sizes = [math.prod(w.shape[1:]) for w in present]
    sent = torch.cat([w.index_select(0, index).reshape(len(send_index), n) for w, n in zip(present, sizes)], dim=1)
    # every row goes to another rank; its gradient comes back the same way
    record_replica_weights(sent.numel() * sent.element_size() * (2 if sent.requires_grad else 1))
    received = all_to_all_v(sent, recv_W, send_W, group)
    pieces = iter(received.split(sizes, dim=1))
    n = received.shape[0]
    return [None if w is None else next(pieces).reshape(n, *w.shape[1:]) for w in weights]
