"""A grouped matmul's operands: validated, and its counts as a backend takes them.

:func:`check_operands` raises ``ValueError`` / ``TypeError`` naming the caller's argument;
:func:`counts_list` validates counts given as a list or a tensor (at most one host read);
:func:`backend_counts` and :func:`counts_once` hand a backend its counts as it takes them: a
``(G,)`` tensor on the device, unread, for a :attr:`~epmoe.gmm.backend.GmmBackend.device_counts`
backend, else a validated host list.
"""

from __future__ import annotations

import torch

from epmoe import errors
from epmoe.gmm.backend import GmmBackend


def check_operands(x: object, weight: object, trans_weight: object, caller: str = "grouped_mm") -> None:
    """``ValueError`` / ``TypeError`` naming ``caller(argument)`` unless ``x`` (T, D) and ``weight``
    (G, D, N), or (G, N, D) with ``trans_weight``, are floating tensors that fit together."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{caller}(x): expected a Tensor, got {type(x).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{caller}(weight): expected a Tensor, got {type(weight).__name__}")
    if not isinstance(trans_weight, bool):
        raise TypeError(f"{caller}(trans_weight): expected a bool, got {type(trans_weight).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{caller}(x): expected a 2-D (T, D) tensor, got shape {tuple(x.shape)}")
    if weight.dim() != 3:
        raise ValueError(f"{caller}(weight): expected a 3-D (G, D, N) tensor, got shape {tuple(weight.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{caller}(x): expected a floating dtype, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise ValueError(f"{caller}(weight): dtype {weight.dtype} does not match x's {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"{caller}(weight): on {weight.device}, x is on {x.device}")
    k_dim = 2 if trans_weight else 1
    if weight.shape[k_dim] != x.shape[1]:
        layout = "(G, N, D)" if trans_weight else "(G, D, N)"
        raise ValueError(
            f"{caller}(weight): shape {tuple(weight.shape)} read as {layout} has D={weight.shape[k_dim]}, "
            f"but x has D={x.shape[1]}"
        )


def counts_list(counts: object, num_groups: int, num_rows: int) -> list[int]:
    """``counts`` as a Python list, validated; at most one host read of a tensor."""
    values = errors.int_list("grouped_mm(counts)", counts)
    if len(values) != num_groups:
        raise ValueError(f"grouped_mm(counts): {len(values)} counts for {num_groups} groups in weight")
    if any(c < 0 for c in values):
        raise ValueError(f"grouped_mm(counts): counts must be non-negative, got {errors.negatives(values)}")
    if sum(values) != num_rows:
        raise ValueError(f"grouped_mm(counts): counts sum to {sum(values)}, but x has {num_rows} rows")
    return values


def backend_counts(
    backend: GmmBackend, counts_G: torch.Tensor, host_counts: list[int] | None, x_TD: torch.Tensor, num_groups: int
) -> list[int] | torch.Tensor:
    """The counts as ``backend`` takes them: ``host_counts`` where the caller has them, else the
    ``(G,)`` tensor on ``x_TD``'s device for a :attr:`~GmmBackend.device_counts` backend (not read:
    its values are trusted), else ``counts_G`` read to the host once and validated."""
    if host_counts is not None:
        return host_counts
    if backend.device_counts:
        return counts_G.to(device=x_TD.device, dtype=torch.int64)
    return counts_list(counts_G, num_groups, x_TD.shape[0])


def counts_once(
    backend: GmmBackend, counts_G: torch.Tensor, num_groups: int, device: torch.device
) -> list[int] | torch.Tensor:
    """For an op that issues several grouped matmuls on the same counts on ``backend`` and holds no
    host counts (where it does, every call takes those): the ``(G,)`` tensor on ``device`` for a
    :attr:`~GmmBackend.device_counts` backend (not read), else ``counts_G`` read to the host once and
    validated (every call then gets the list; the rows are the caller's, checked there)."""
    if backend.device_counts:
        return counts_G.to(device=device, dtype=torch.int64)
    values = errors.int_list("grouped_mm(counts)", counts_G)
    counts_list(values, num_groups, sum(values))
    return values
