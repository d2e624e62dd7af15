"""The ``loop`` backend: one ``torch.mm`` per group. Always eligible; the reference the others match."""

from __future__ import annotations

import torch

from epmoe.gmm.backend import GmmBackend


def group_bounds(counts: list[int]) -> list[tuple[int, int, int]]:
    """``(g, start, end)`` row ranges of the non-empty groups."""
    bounds, start = [], 0
    for g, n in enumerate(counts):
        if n:
            bounds.append((g, start, start + n))
        start += n
    return bounds


class LoopBackend(GmmBackend):
    name = "loop"
    accelerated = False

    def ineligible_reason(self, x, weight, *, trans_weight=False):
        return None

    def forward(self, x_TK, weight, counts, trans_weight):
        w_GKN = weight.transpose(1, 2) if trans_weight else weight
        y_TN = x_TK.new_empty(x_TK.shape[0], w_GKN.shape[2])
        for g, start, end in group_bounds(counts):
            torch.mm(x_TK[start:end], w_GKN[g], out=y_TN[start:end])
        return y_TN

    def grad_weight(self, x_TK, dy_TN, counts, trans_weight):
        G, K, N = len(counts), x_TK.shape[1], dy_TN.shape[1]
        dw = x_TK.new_empty((G, N, K) if trans_weight else (G, K, N))
        for g, start, end in group_bounds(counts):
            if trans_weight:
                torch.mm(dy_TN[start:end].t(), x_TK[start:end], out=dw[g])
            else:
                torch.mm(x_TK[start:end].t(), dy_TN[start:end], out=dw[g])
        empty = [g for g, n in enumerate(counts) if n == 0]
        if empty:  # only these: zero-filling all of dW first would be one more pass over G x N x K
            dw[empty] = 0
        return dw
