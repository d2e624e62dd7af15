"""``apply_expert_parallel``: find a model's experts modules, keep this rank's block, swap the forward.

Rank ``r`` of ``P`` keeps global experts ``[r*E/P, (r+1)*E/P)`` of every experts module::

    E = 8, P = 2          experts 0 1 2 3 | 4 5 6 7
    rank 0 holds           0 1 2 3
    rank 1 holds                            4 5 6 7

The expert weights stay plain ``nn.Parameter``s under their own names, sliced to ``E/P`` experts;
routers, shared experts and everything else are untouched. The module's forward becomes
:func:`epmoe.ep.layer.expert_parallel_forward`, which runs on every rank's own batch.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from epmoe.ep.config import ExpertParallelConfig, ExpertShard
from epmoe.ep.layer import ExpertParallelState, expert_parallel_forward
from epmoe.experts import is_packed_experts, num_experts_of
from epmoe.gmm import select_backend

logger = logging.getLogger(__name__)


def resolve_group(ep_group: Any) -> dist.ProcessGroup | None:
    """A ProcessGroup from a ProcessGroup, a DeviceMesh (1-D, or with an ``"ep"`` dim), or ``None``."""
    if ep_group is None or isinstance(ep_group, dist.ProcessGroup):
        return ep_group
    mesh_type = getattr(getattr(dist, "device_mesh", None), "DeviceMesh", None)
    if mesh_type is not None and isinstance(ep_group, mesh_type):
        if ep_group.ndim == 1:
            return ep_group.get_group()
        names = ep_group.mesh_dim_names or ()
        if "ep" in names:
            return ep_group.get_group("ep")
        raise ValueError(f"ep_group: a {ep_group.ndim}-D DeviceMesh needs a dim named 'ep', has {names}")
    raise TypeError(f"ep_group: expected a ProcessGroup, DeviceMesh or None, got {type(ep_group).__name__}")


def find_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every packed (transformers v5) experts module, in ``named_modules()`` order."""
    return [(name, module) for name, module in model.named_modules() if is_packed_experts(module)]


def apply_expert_parallel(
    model: nn.Module, ep_group: Any = None, *, config: ExpertParallelConfig | dict | None = None
) -> list[ExpertShard]:
    """Turn ``model`` into an expert-parallel model, in place; see ``API.md`` section 1.

    Returns one :class:`ExpertShard` per experts module, in ``model.named_modules()`` order. A second
    call on the same model returns the same shards (with the same group size) and changes nothing.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_expert_parallel(model): expected an nn.Module, got {type(model).__name__}")
    config = ExpertParallelConfig.from_any(config)
    group = resolve_group(ep_group)
    if not dist.is_initialized():
        if group is not None:
            raise ValueError("apply_expert_parallel(ep_group): torch.distributed is not initialized")
        ep_rank, ep_size = 0, 1
    else:
        ep_rank, ep_size = dist.get_rank(group), dist.get_world_size(group)

    found = find_experts_modules(model)
    if not found:
        raise ValueError(f"apply_expert_parallel(model): no experts module found in {type(model).__name__}")
    done = [getattr(module, "_epmoe", None) for _, module in found]
    if all(state is not None for state in done):
        sizes = {state.shard.ep_size for state in done}
        if sizes != {ep_size}:
            raise ValueError(f"apply_expert_parallel(model): already expert-parallel over {sizes.pop()} ranks, not {ep_size}")
        return [state.shard for state in done]
    if any(state is not None for state in done):
        raise ValueError("apply_expert_parallel(model): the model is partly expert-parallel already")

    # Validate everything before changing anything: no half-sharded model after an error.
    shards = []
    for name, module in found:
        num_experts = num_experts_of(module)
        if num_experts % ep_size:
            raise ValueError(
                f"apply_expert_parallel: {name} has E={num_experts} experts, not divisible by the EP size P={ep_size}"
            )
        local = num_experts // ep_size
        shards.append(ExpertShard(name, num_experts, local, ep_rank * local, (ep_rank + 1) * local, ep_rank, ep_size))

    for (name, module), shard in zip(found, shards):
        _shard_parameters(module, shard)
        module._epmoe = ExpertParallelState(shard, config, group)
        module.forward = types.MethodType(expert_parallel_forward, module)
    _log_backend(found[0][1], config, ep_size, len(found))
    return shards


def _shard_parameters(module: nn.Module, shard: ExpertShard) -> None:
    """Keep experts ``[local_start, local_end)`` of every per-expert parameter (weights and biases)."""
    if shard.ep_size == 1:
        return
    for name, param in list(module.named_parameters(recurse=False)):
        if param.dim() >= 1 and param.shape[0] == shard.num_experts:
            local = param.detach()[shard.local_start:shard.local_end].clone()
            setattr(module, name, nn.Parameter(local, requires_grad=param.requires_grad))


def _log_backend(module: nn.Module, config: ExpertParallelConfig, ep_size: int, num_modules: int) -> None:
    weight = module.down_proj
    hidden = weight.shape[1] if not module.is_transposed else weight.shape[2]
    sample = torch.empty(0, hidden, dtype=weight.dtype, device=weight.device)
    backend = select_backend(sample, weight, trans_weight=not module.is_transposed, backend=config.gmm_backend)
    logger.info(
        "epmoe: %d experts modules expert-parallel over %d ranks; grouped matmul backend %r (requested %r)",
        num_modules, ep_size, backend.name, config.gmm_backend,
    )
