"""``clip_grad_norm_``: the unsharded model's gradient norm, on an EP model, the same on every rank.

The gradients of one model are spread three ways, and each part is counted exactly once:

    part                               on this rank            reduced over
    replicated (DDP-averaged, plain)   the whole tensor        nothing: every rank holds the same
    expert shards                      this rank's experts     the EP group (the "dp" replicas
                                                               hold the same experts: not summed)
    FSDP2 DTensors                     this rank's shard       each mesh dim the tensor is Shard()ed over

For ``norm_type = p``: ``total = (sum over parts of sum |g|^p) ** (1/p)``; for ``inf``: the max.
Then every gradient is scaled by ``min(1, max_norm / (total + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from epmoe.comm.steps import CLIP, StepChannel
from epmoe.ep.model import expert_owner
from epmoe.ep.params import expert_parameters, is_expert_parameter


def clip_grad_norm_(
    parameters_or_model: nn.Module | Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the gradients in place to a total norm of ``max_norm``; return the total norm before clipping.

    The total norm is that of the unsharded model's gradient (see the module docstring), identical
    on every rank: every rank must call this, with the same parameters. ``parameters_or_model``: a
    model, an iterable of parameters, or one tensor.
    """
    params = _parameters(parameters_or_model)
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(f"clip_grad_norm_(max_norm): expected a number >= 0, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(f"clip_grad_norm_(norm_type): expected a number > 0 or inf, got {norm_type!r}")
    norm_type = float(norm_type)
    parts = _parts(params)
    grads = [g for part in parts.values() for g in part.grads]
    # a rank without gradients still joins its peers' reductions below
    device = grads[0].device if grads else (params[0].device if params else torch.device("cpu"))
    dtype = grads[0].dtype if grads else torch.float32
    total = torch.zeros((), dtype=torch.float64, device=device)
    for part in parts.values():
        total = _combine(total, part.reduce(norm_type, device), norm_type)
    if not math.isinf(norm_type):
        total = total ** (1.0 / norm_type)
    total = total.to(dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite; set "
            f"error_if_nonfinite=False to clip anyway"
        )
    if not grads:
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        local = _local(g)
        by_kind.setdefault((local.device, local.dtype), []).append(local)
    for (grad_device, _), tensors in by_kind.items():
        torch._foreach_mul_(tensors, coef.to(grad_device))
    for owner in {id(m): m for m in map(expert_owner, params) if m is not None}.values():
        owner.guard.bless()  # this change of the expert gradients is the right one (epmoe.ep.guard)
    return total


class _Part:
    """Gradients reduced the same way: the sum (or max) of their norms, all-reduced over ``groups``."""

    def __init__(self, groups: tuple):
        self.groups = groups
        self.grads: list[torch.Tensor] = []

    def reduce(self, norm_type: float, device: torch.device) -> torch.Tensor:
        if self.grads:
            norms = torch.stack(
                [torch.linalg.vector_norm(_local(g), norm_type).to(torch.float64).to(device) for g in self.grads]
            )
            local = norms.max() if math.isinf(norm_type) else (norms**norm_type).sum()
        else:  # this rank holds no gradient of the part, but its peers may: join their reduction
            local = torch.zeros((), dtype=torch.float64, device=device)
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        for group in self.groups:
            if isinstance(group, StepChannel):  # the experts' EP group: a step header first
                group.all_reduce(local, group.next_call(CLIP), op=op)
            else:
                dist.all_reduce(local, op=op, group=group)
        return local


def _combine(total: torch.Tensor, part: torch.Tensor, norm_type: float) -> torch.Tensor:
    return torch.maximum(total, part) if math.isinf(norm_type) else total + part


def _parts(params: list[torch.Tensor]) -> dict[tuple, _Part]:
    """The gradients by how their norm is reduced, in a first-seen order that every rank shares
    (collectives are then issued in the same order everywhere)."""
    parts: dict[tuple, _Part] = {}
    for p in params:
        groups = _reduction_groups(p)
        key = tuple(id(g) for g in groups)
        part = parts.setdefault(key, _Part(groups))
        if p.grad is not None:
            part.grads.append(p.grad)
    return parts


def _reduction_groups(p: torch.Tensor) -> tuple:
    """The process groups (or EP step channel) over which ``p``'s gradient is split into different pieces."""
    if is_expert_parameter(p):
        return (expert_owner(p).channel,)
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(p, dtensor):
        groups = []
        for dim, placement in enumerate(p.placements):
            if placement.is_partial():
                raise ValueError("clip_grad_norm_: a parameter with a Partial() placement has no defined norm")
            if placement.is_shard():
                groups.append(p.device_mesh.get_group(dim))
        return tuple(groups)
    return ()


def _local(g: torch.Tensor) -> torch.Tensor:
    dtensor = _dtensor_type()
    return g._local_tensor if dtensor is not None and isinstance(g, dtensor) else g


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def _parameters(parameters_or_model) -> list[torch.Tensor]:
    if isinstance(parameters_or_model, nn.Module):
        expert_parameters(parameters_or_model)  # marks LoRA factors added since the last forward
        return list(parameters_or_model.parameters())
    if isinstance(parameters_or_model, torch.Tensor):
        return [parameters_or_model]
    try:
        params = list(parameters_or_model)
    except TypeError:
        raise TypeError(
            f"clip_grad_norm_(parameters_or_model): expected a model, parameters or a tensor, got "
            f"{type(parameters_or_model).__name__}"
        ) from None
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"clip_grad_norm_(parameters_or_model): expected tensors, got a {type(p).__name__}")
    return params
