"""The compute the fused ops interleave with communication: grouped matmuls and shared-expert matmuls.

Grouped matmuls go through epmoe's backend registry (:func:`epmoe.gmm.select_backend`), called on
the backend object directly because the fused ops carry their own autograd. Shared-expert work is a
list of plain products ``a @ b`` whose outputs are allocated on the current stream before the
products run (on a side stream where there is one), so the outputs belong to the current stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from epmoe import platform
from epmoe.gmm import select_backend

# Launches its products on the given side stream (inline for None) and returns their outputs; the
# caller makes the current stream wait for the side stream (platform.wait_stream) before using them.
SideJob = Callable[[Any], list[torch.Tensor]]


def gmm(x_TD: torch.Tensor, weight: torch.Tensor, counts: list[int], trans_weight: bool, backend: str) -> torch.Tensor:
    """``y_TN``: rows of group ``g`` of ``x_TD`` times ``weight[g]`` (transposed with ``trans_weight``)."""
    n = weight.shape[1] if trans_weight else weight.shape[2]
    if x_TD.shape[0] == 0:
        return x_TD.new_zeros(0, n)
    x_TD = x_TD.contiguous()
    chosen = select_backend(x_TD, weight, trans_weight=trans_weight, backend=backend)
    return chosen.forward(x_TD, weight, counts, trans_weight)


def gmm_grad_weight(
    x_TD: torch.Tensor, dy_TN: torch.Tensor, weight: torch.Tensor, counts: list[int], trans_weight: bool, backend: str
) -> torch.Tensor:
    """``dW`` shaped like ``weight``: ``x_g^T dy_g`` per group (``dy_g^T x_g`` with ``trans_weight``); zero if empty."""
    if x_TD.shape[0] == 0:
        return torch.zeros_like(weight, memory_format=torch.contiguous_format)
    x_TD = x_TD.contiguous()
    chosen = select_backend(x_TD, weight, trans_weight=trans_weight, backend=backend)
    return chosen.grad_weight(x_TD, dy_TN.contiguous(), counts, trans_weight)


def dense_products(products: list[tuple[torch.Tensor, torch.Tensor]]) -> SideJob:
    """A side job computing ``a @ b`` for each pair."""

    def run(side_stream: Any) -> list[torch.Tensor]:
        outs = [a.new_empty(a.shape[0], b.shape[1]) for a, b in products]
        with platform.stream(side_stream):
            for (a, b), out in zip(products, outs):
                torch.mm(a, b, out=out)
        return outs

    return run


def shared_forward(shared_x: torch.Tensor, shared_weight: torch.Tensor, trans: bool) -> SideJob:
    """``[shared_x @ shared_weight]`` (``shared_weight.T`` with ``trans``)."""
    return dense_products([(shared_x, shared_weight.t() if trans else shared_weight)])


def shared_backward(
    shared_x: torch.Tensor, shared_weight: torch.Tensor, trans: bool, dy: torch.Tensor, need_x: bool, need_w: bool
) -> SideJob:
    """The shared expert's ``[dx][, dW]`` (whichever is needed), ``dW`` in ``shared_weight``'s layout."""
    products = []
    if need_x:
        products.append((dy, shared_weight if trans else shared_weight.t()))
    if need_w:
        products.append((dy.t(), shared_x) if trans else (shared_x.t(), dy))
    return dense_products(products)
