"""Model and optimizer state for ``torch.distributed.checkpoint``, every expert under its global identity.

A packed experts tensor on EP rank ``r`` of ``W`` holds experts ``[r*e, (r+1)*e)`` under the same
name as on every other rank; handed to DCP as is, the ranks' blocks would look like replicas of one
``(e, ...)`` tensor (and a load would give every rank the same block). :func:`get_state_dict` gives
DCP each of them, and each optimizer moment shaped like them, as what it is: a ``DTensor``
``Shard(0)`` of the ``(E, ...)`` tensor over the EP group::

    EP = 2                  rank 0: experts.gate_up_proj (4, 2I, H)    rank 1: (4, 2I, H)
    get_state_dict          DTensor (8, 2I, H), Shard(0): rows 0-3      rows 4-7
    dcp.save / dcp.load     one (8, 2I, H) tensor in the checkpoint, read back at any EP size

PEFT LoRA factors on packed experts (``target_parameters``) follow their experts: ``lora_A``
``(r*e, in)`` is expert-major (rows ``Shard(0)`` of ``(r*E, in)``); ``lora_B`` ``(out, r*e)`` is
expert-minor, so it goes to DCP viewed ``(out, r, e)``, ``Shard(2)`` of ``(out, r, E)``::

    lora_B (out, r*e) --view--> (out, r, e) --DTensor--> (out, r, E), Shard(2)  (read back at any EP size)

``"dp"`` replicas of an EP group give the same shards (DCP's planner writes one copy). The rest is
``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict`` (FQNs without DDP's
``module.``, FSDP2 DTensors, an optimizer without state initialised first). ``nn.ModuleList``
experts already carry their global index in their names and need nothing.

    state = epmoe.get_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=path)          # or, to resume:
    dcp.load(state, checkpoint_id=path); epmoe.set_state_dict(model, optimizer, state=state)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from epmoe import platform
from epmoe.checkpoint.state_dict_warning import own_state_dict
from epmoe.ep.state import ExpertParallelState, sharded_experts
from epmoe.integrations.peft import expert_lora_wrappers, factor_layout, factor_weights


def get_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` (no ``"optimizer"`` without one) for ``dcp.save`` / ``dcp.load``."""
    from torch.distributed.checkpoint import state_dict as dcp_state

    _check_model(model, "get_state_dict")
    sharded = _sharded_experts(model)
    if optimizer is None:
        with own_state_dict():
            model_state = dcp_state.get_model_state_dict(model)
        return {"model": _to_global(model_state, sharded)}
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"get_state_dict(optimizer): expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    with own_state_dict():
        model_state, optim_state = dcp_state.get_state_dict(model, optimizer)
    for fqn, moments in optim_state.get("state", {}).items():
        optim_state["state"][fqn] = _to_global(
            moments, {key: sharded[fqn] for key in moments} if fqn in sharded else {}
        )
    return {"model": _to_global(model_state, sharded), "optimizer": optim_state}


def set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, state: dict[str, Any]) -> None:
    """Load ``state`` (from :func:`get_state_dict`, filled by ``dcp.load``) into ``model`` and ``optimizer``."""
    from torch.distributed.checkpoint import state_dict as dcp_state

    _check_model(model, "set_state_dict")
    if not isinstance(state, dict) or "model" not in state or (optimizer is not None and "optimizer" not in state):
        raise ValueError(
            "set_state_dict(state): expected the dict epmoe.get_state_dict returned (with 'model' and, "
            "given an optimizer, 'optimizer')"
        )
    sharded = _sharded_experts(model)
    model_state = _to_local(state["model"], sharded)
    if optimizer is None:
        with own_state_dict():
            dcp_state.set_model_state_dict(model, model_state)
        return
    optim_state = dict(state["optimizer"])
    optim_state["state"] = {
        fqn: _to_local(moments, {key: sharded[fqn] for key in moments} if fqn in sharded else {})
        for fqn, moments in optim_state.get("state", {}).items()
    }
    with own_state_dict():
        dcp_state.set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def _check_model(model: Any, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}(model): expected an nn.Module, got {type(model).__name__}")


@dataclass(frozen=True)
class _Sharded:
    """How one local tensor (and each optimizer moment shaped like it) goes to DCP: viewed as
    ``view`` (``None``: as it is), then ``Shard(dim)`` of the tensor of all ``E`` experts."""

    state: ExpertParallelState
    dim: int = 0
    view: tuple[int, ...] | None = None


def _sharded_experts(model: nn.Module) -> dict[str, _Sharded]:
    """FQN (as torch's state-dict helpers name it: no ``module.`` of DDP) -> how it is sharded, for
    every packed experts tensor sharded over an EP group of size > 1 and every LoRA factor on one."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    sharded = {}
    for name, _, state in sharded_experts(inner, packed_only=True):
        prefix = f"{name}." if name else ""
        for param_name in state.sharded_names:
            sharded[prefix + param_name] = _Sharded(state)
    for name, module, state in expert_lora_wrappers(inner):
        if state.shard.ep_size == 1:
            continue
        for factor, adapter, linear in factor_weights(module):
            layout = factor_layout(factor, linear, module.num_experts)
            sharded[f"{name}.{factor}.{adapter}.weight"] = _Sharded(state, layout.dim, layout.view)
    return sharded


def _to_global(tensors: dict[str, Any], sharded: dict[str, _Sharded]) -> dict[str, Any]:
    """Each ``sharded`` entry as a ``DTensor`` of all ``E`` experts over its EP group."""
    from torch.distributed.tensor import DTensor

    out, meshes = dict(tensors), {}
    for key, how in sharded.items():
        local = out.get(key)
        if isinstance(local, torch.Tensor) and local.dim() > 0 and not isinstance(local, DTensor):
            local = local.contiguous() if how.view is None else local.contiguous().view(how.view)
            out[key] = expert_dtensor(local, how.state, meshes, dim=how.dim)
    return out


def expert_dtensor(local: torch.Tensor, state: ExpertParallelState, meshes: dict, dim: int = 0) -> Any:
    """``local`` (this rank's ``E/W`` experts along ``dim`` of a packed tensor, on any device, meta
    included) as the ``DTensor`` ``Shard(dim)`` of all ``E`` over the EP group of ``state``;
    ``meshes`` caches one ``DeviceMesh`` per group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    group = state.model.group if state.model.group is not None else torch.distributed.group.WORLD
    mesh = meshes.get(id(group))
    if mesh is None:
        device = platform.device_type() if local.device.type == "meta" else platform.device_type(local)
        mesh = meshes[id(group)] = DeviceMesh.from_group(group, device)
    shape = list(local.shape)
    shape[dim] *= state.shard.ep_size
    shape = torch.Size(shape)
    return DTensor.from_local(
        local, mesh, [Shard(dim)], run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride()
    )


def _to_local(tensors: dict[str, Any], sharded: dict[str, _Sharded]) -> dict[str, Any]:
    """Each ``sharded`` ``DTensor`` entry as this rank's local tensor, in the parameter's shape."""
    from torch.distributed.tensor import DTensor

    out = dict(tensors)
    for key, how in sharded.items():
        value = out.get(key)
        if isinstance(value, DTensor):
            local = value.to_local()
            out[key] = local if how.view is None else local.reshape(local.shape[0], -1)
    return out
