"""The ``reference`` implementation: one exchange, one permutation, one grouped matmul; plain autograd.

No rounds, no overlap, no hand-written backward: the differentiable all-to-all-v of
:mod:`epmoe.comm.all_to_all`, one row permutation by an index tensor (whose backward is one
scatter) and :func:`epmoe.grouped_mm`. The oracle the tests hold the other implementations to, and
the "exchange, then grouped matmul" baseline of ``epmoe bench fused``.
"""

from __future__ import annotations

from typing import Any

import torch

from epmoe import platform
from epmoe.comm.all_to_all import all_to_all_v
from epmoe.comm.layout import Block, RowLayout, rows_index
from epmoe.gmm import grouped_mm


def _permute(x: torch.Tensor, blocks: list[Block]) -> torch.Tensor:
    """The rows of ``blocks`` of ``x``, in that order, by one indexing (built on the host, no sync)."""
    return x[platform.host_to_device(rows_index(blocks, x.shape[0]), x.device)]


def _shared(shared: tuple[torch.Tensor, torch.Tensor, bool] | None) -> torch.Tensor | None:
    if shared is None:
        return None
    shared_x, shared_weight, trans = shared
    return shared_x @ (shared_weight.t() if trans else shared_weight)


def dispatch(
    plan: RowLayout,
    x_rank_major: torch.Tensor,
    weight: torch.Tensor,
    trans_weight: bool,
    group: Any,
    *,
    shared: tuple[torch.Tensor, torch.Tensor, bool] | None,
    return_permuted: bool,
    gmm_backend: str,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(y_expert_major, shared_y, permuted_expert_major)`` of ``alltoallv_gmm``."""
    x_source_major = all_to_all_v(x_rank_major, plan.expert_major_splits_W, plan.rank_major_splits, group)
    x_expert_major = _permute(x_source_major, plan.to_expert_major(0, plan.e))
    y_expert_major = grouped_mm(
        x_expert_major, weight, plan.rows_per_expert_e, trans_weight=trans_weight, backend=gmm_backend
    )
    return y_expert_major, _shared(shared), x_expert_major if return_permuted else None


def combine(
    plan: RowLayout,
    x_expert_major: torch.Tensor,
    weight: torch.Tensor,
    trans_weight: bool,
    group: Any,
    *,
    shared: tuple[torch.Tensor, torch.Tensor, bool] | None,
    gmm_backend: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y_rank_major, shared_y)`` of ``gmm_alltoallv``."""
    y_expert_major = grouped_mm(
        x_expert_major, weight, plan.rows_per_expert_e, trans_weight=trans_weight, backend=gmm_backend
    )
    y_source_major = _permute(y_expert_major, plan.to_source_major(0, plan.e))
    y_rank_major = all_to_all_v(y_source_major, plan.rank_major_splits, plan.expert_major_splits_W, group)
    return y_rank_major, _shared(shared)
