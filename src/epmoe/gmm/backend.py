"""The contract every grouped-matmul backend implements.

A backend computes, for groups ``g = 0..G-1`` of consecutive rows of ``x``::

    x_TD (rows grouped by g)      weight_GDN (or weight_GND with trans_weight)
    +--------+                    +-----+-----+-----+
    | g = 0  |  @ W[0]  ->        | W0  | W1  | W2  |
    | g = 1  |  @ W[1]  ->        +-----+-----+-----+
    | g = 2  |  @ W[2]  ->
    +--------+

``forward`` gives ``y_TN``; ``grad_weight`` gives ``dW`` with the weight's own layout. The autograd
lives in :mod:`epmoe.gmm.op` and every validation in :mod:`epmoe.gmm.registry`, so a backend only
multiplies: it receives validated, contiguous ``x``, ``counts`` as a Python list (or, for a backend
with ``device_counts``, possibly a ``(G,)`` int64 tensor on ``x``'s device, which it must not read
to the host) and never sees ``T == 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def prefix(values: list[int]) -> list[int]:
    """``[0, v0, v0+v1, ..., sum(values)]``: the first row of each group (or block), then the end.
    The package's one prefix sum of counts (:mod:`epmoe.comm.layout` uses it too)."""
    offsets, total = [0], 0
    for value in values:
        total += value
        offsets.append(total)
    return offsets


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend would run a given call, and why not."""

    name: str
    eligible: bool
    reason: str | None = None


class GmmBackend:
    """Base class of grouped-matmul backends. Subclasses set ``name`` and override the three methods.

    ``accelerated`` marks backends faster than the loop: falling back from them is worth a warning.
    ``by_counts`` marks backends that pay only for some group sizes: ``auto`` takes them only where
    :meth:`counts_reason` accepts the call's counts (never without counts). ``device_counts`` marks
    backends whose kernels take the counts on the device: a caller whose counts are there (an EP layer
    on one rank) then never reads them to the host.
    """

    name: str = ""
    accelerated: bool = True
    by_counts: bool = False
    device_counts: bool = False

    def ineligible_reason(self, x: torch.Tensor, weight: torch.Tensor, *, trans_weight: bool = False) -> str | None:
        """``None`` when this backend can run ``grouped_mm(x, weight, ...)``, else a short reason.

        Decided from what :class:`epmoe.gmm.registry.Operands` records of the operands (not the row
        count, not the values): a :class:`~epmoe.gmm.BackendChoice` asks once per such operands."""
        raise NotImplementedError

    def counts_reason(self, counts: list[int], x: torch.Tensor, *, backward: bool) -> str | None:
        """For a ``by_counts`` backend: why ``auto`` should not run it on these group sizes (on ``x``'s
        device; ``backward``: the call will be differentiated too), or ``None``."""
        return None

    def calls_reason(self, x: torch.Tensor, *, backward: bool) -> str | None:
        """For a ``by_counts`` backend: why ``auto`` should not run it on any group sizes for calls
        on ``x``'s device (``backward``: differentiated), or ``None`` where the counts decide
        (:meth:`counts_reason`, which must then decline too). A ``BackendChoice`` keeps its answer
        for such calls and asks no counts."""
        return None

    def forward(
        self, x_TD: torch.Tensor, weight: torch.Tensor, counts: list[int] | torch.Tensor, trans_weight: bool
    ) -> torch.Tensor:
        """``y_TN``: rows of group ``g`` times ``weight[g]`` (``weight[g].T`` when ``trans_weight``)."""
        raise NotImplementedError

    def grad_weight(
        self, x_TD: torch.Tensor, dy_TN: torch.Tensor, counts: list[int] | torch.Tensor, trans_weight: bool
    ) -> torch.Tensor:
        """``dW[g] = x_g^T dy_g`` as ``(G, D, N)``, or ``dy_g^T x_g`` as ``(G, N, D)`` when ``trans_weight``.

        A group with no rows gets an exactly zero gradient.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
