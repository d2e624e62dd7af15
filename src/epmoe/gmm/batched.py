"""The ``batched`` backend: every group padded to the largest one, one ``torch.bmm``.

Many experts with a few rows each (decoding, small batches) are bound by one kernel call per group;
padding the groups to a common size ``M = max(counts)`` turns them into one batched matmul::

    x_TD (rows grouped by g)      x_pad (G, M, D), zero rows after each group's own
    | g0: 3 rows |                | g0 g0 g0 0 |
    | g1: 4 rows |   scatter  ->  | g1 g1 g1 g1|   bmm with W (G, D, N)   ->   y_pad (G, M, N)  --gather-->  y_TN
    | g2: 1 row  |                | g2 0  0  0 |

It multiplies ``G * M`` rows for ``T``: it pays only where the groups are small and even. So it is
eligible for every floating dtype and device, but ``auto`` takes it only where
:meth:`BatchedBackend.counts_reason` finds the group sizes inside the region measured to win on
that device type (:data:`WINS`, from ``epmoe bench gmm``: many small, even groups, in a forward that
is not differentiated, as in decoding); elsewhere ``auto`` passes over it, and a user may still name
it.
"""

from __future__ import annotations

import torch

from epmoe import platform
from epmoe.gmm.backend import GmmBackend

# Where padded bmm was measured faster than every other backend, beyond noise (``epmoe bench gmm``,
# the small-group cases, benchmarks/gmm_cpu.md): device type -> (fewest groups, largest mean rows
# per group, largest max/mean group size), forward only (with the backward, dW dominates and
# padding did not win beyond noise).
WINS = {"cpu": (128, 16, 1.5)}


class BatchedBackend(GmmBackend):
    name = "batched"
    by_counts = True

    def ineligible_reason(self, x, weight, *, trans_weight=False):
        return None

    def calls_reason(self, x: torch.Tensor, *, backward: bool) -> str | None:
        kind = platform.device_type(x)
        if kind not in WINS:
            return f"no measured region where padding wins on {kind}"
        if backward:
            return "the call is differentiated: padding was measured to win in the forward only"
        return None

    def counts_reason(self, counts: list[int], x: torch.Tensor, *, backward: bool) -> str | None:
        reason = self.calls_reason(x, backward=backward)
        if reason is not None:
            return reason
        min_groups, max_mean_rows, max_spread = WINS[platform.device_type(x)]
        if len(counts) < min_groups:
            return f"{len(counts)} groups (padding wins from {min_groups})"
        mean = sum(counts) / len(counts)
        if mean > max_mean_rows:
            return f"{mean:.0f} rows per group on average (padding wins up to {max_mean_rows})"
        if max(counts) > max_spread * mean:
            return f"largest group {max(counts)} rows, {max(counts) / mean:.2f}x the mean (padding wins up to {max_spread}x)"
        return None

    def forward(self, x_TD, weight, counts, trans_weight):
        w_GDN = weight.transpose(1, 2) if trans_weight else weight
        slots, M = _padded_slots(counts, x_TD.device)
        x_pad = x_TD.new_zeros(len(counts) * M, x_TD.shape[1]).index_copy_(0, slots, x_TD)
        y_pad = torch.bmm(x_pad.view(len(counts), M, -1), w_GDN)
        return y_pad.view(len(counts) * M, -1).index_select(0, slots)

    def grad_weight(self, x_TD, dy_TN, counts, trans_weight):
        G = len(counts)
        slots, M = _padded_slots(counts, x_TD.device)
        x_pad = x_TD.new_zeros(G * M, x_TD.shape[1]).index_copy_(0, slots, x_TD).view(G, M, -1)
        dy_pad = dy_TN.new_zeros(G * M, dy_TN.shape[1]).index_copy_(0, slots, dy_TN).view(G, M, -1)
        if trans_weight:
            return torch.bmm(dy_pad.transpose(1, 2), x_pad)  # (G, N, D); zero rows add nothing, empty groups 0
        return torch.bmm(x_pad.transpose(1, 2), dy_pad)  # (G, D, N)


def _padded_slots(counts: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """``(slots, M)``: ``M = max(counts)``, and for each row of ``x`` its row in the ``(G * M)``
    padded tensor (group ``g`` starts at ``g * M``); built on the host."""
    M = max(counts)
    starts = torch.arange(len(counts)) * M
    counts_t = torch.tensor(counts)
    begins = torch.cumsum(counts_t, 0) - counts_t
    slots = torch.repeat_interleave(starts - begins, counts_t, output_size=sum(counts)) + torch.arange(sum(counts))
    return platform.host_to_device(slots, device), M
