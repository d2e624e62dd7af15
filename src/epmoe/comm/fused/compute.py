"""The shared-expert compute the fused ops interleave with communication.

(Their grouped matmuls run the one grouped-matmul body, :func:`epmoe.gmm.registry.run_grouped_mm`
and :func:`~epmoe.gmm.registry.run_grouped_mm_backward`, on the backend object each call carries.)
Shared-expert work is a list of plain products ``a @ b`` whose outputs are allocated on the current
stream before the products run (on a side stream where there is one), so the outputs belong to the
current stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from epmoe import platform

# Launches its products on the given side stream (inline for None) and returns their outputs; the
# caller makes the current stream wait for the side stream (platform.wait_stream) before using them.
SideJob = Callable[[Any], list[torch.Tensor]]


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
