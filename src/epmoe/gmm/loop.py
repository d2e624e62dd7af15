"""The ``loop`` backend: one ``torch.mm`` per group. Always eligible; the reference the others match."""

from __future__ import annotations

import torch

from epmoe.gmm.backend import GmmBackend, prefix


def group_bounds(counts: list[int]) -> list[tuple[int, int, int]]:
    """``(g, start, end)`` row ranges of the non-empty groups."""
    starts = prefix(counts)
    return [(g, starts[g], starts[g + 1]) for g, n in enumerate(counts) if n]


class LoopBackend(GmmBackend):
    name = "loop"
    accelerated = False

    def ineligible_reason(self, x, weight, *, trans_weight=False):
        return None

    def forward(self, x_TD, weight, counts, trans_weight):
        w_GDN = weight.transpose(1, 2) if trans_weight else weight
        y_TN = x_TD.new_empty(x_TD.shape[0], w_GDN.shape[2])
        for g, start, end in group_bounds(counts):
            torch.mm(x_TD[start:end], w_GDN[g], out=y_TN[start:end])
        return y_TN

    def grad_weight(self, x_TD, dy_TN, counts, trans_weight):
        G, D, N = len(counts), x_TD.shape[1], dy_TN.shape[1]
        dw = x_TD.new_empty((G, N, D) if trans_weight else (G, D, N))
        for g, start, end in group_bounds(counts):
            if trans_weight:
                torch.mm(dy_TN[start:end].t(), x_TD[start:end], out=dw[g])
            else:
                torch.mm(x_TD[start:end].t(), dy_TN[start:end], out=dw[g])
        empty = [g for g, n in enumerate(counts) if n == 0]
        if empty:  # only these: zero-filling all of dW first would be one more pass over G x N x D
            dw[empty] = 0
        return dw
