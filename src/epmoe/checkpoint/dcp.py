"""Model and optimizer state for ``torch.distributed.checkpoint``, every expert under its global identity.

A packed experts tensor on EP rank ``r`` of ``W`` holds experts ``[r*e, (r+1)*e)`` under the same
name as on every other rank; handed to DCP as is, the ranks' blocks would look like replicas of one
``(e, ...)`` tensor (and a load would give every rank the same block). :func:`get_state_dict` gives
DCP each of them, and each optimizer moment shaped like them, as what it is: a ``DTensor``
``Shard(0)`` of the ``(E, ...)`` tensor over the EP group::

    EP = 2                  rank 0: experts.gate_up_proj (4, 2I, H)    rank 1: (4, 2I, H)
    get_state_dict          DTensor (8, 2I, H), Shard(0): rows 0-3      rows 4-7
    dcp.save / dcp.load     one (8, 2I, H) tensor in the checkpoint, read back at any EP size

``"dp"`` replicas of an EP group give the same shards (DCP's planner writes one copy). The rest is
``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict`` (FQNs without DDP's
``module.``, FSDP2 DTensors, an optimizer without state initialised first). ``nn.ModuleList``
experts already carry their global index in their names and need nothing.

    state = epmoe.get_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=path)          # or, to resume:
    dcp.load(state, checkpoint_id=path); epmoe.set_state_dict(model, optimizer, state=state)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from epmoe import platform
from epmoe.checkpoint.guard import own_state_dict


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
        optim_state["state"][fqn] = _to_global(moments, {key: sharded[fqn] for key in moments} if fqn in sharded else {})
    return {"model": _to_global(model_state, sharded), "optimizer": optim_state}


def set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, state: dict[str, Any]) -> None:
    """Load ``state`` (from :func:`get_state_dict`, filled by ``dcp.load``) into ``model`` and ``optimizer``."""
    from torch.distributed.checkpoint import state_dict as dcp_state

    _check_model(model, "set_state_dict")
    if not isinstance(state, dict) or "model" not in state or (optimizer is not None and "optimizer" not in state):
        raise ValueError("set_state_dict(state): expected the dict epmoe.get_state_dict returned (with 'model' and, "
                         "given an optimizer, 'optimizer')")
    sharded = _sharded_experts(model)
    model_state = _to_local(state["model"], sharded)
    if optimizer is None:
        with own_state_dict():
            dcp_state.set_model_state_dict(model, model_state)
        return
    optim_state = dict(state["optimizer"])
    optim_state["state"] = {fqn: _to_local(moments, set(moments) if fqn in sharded else set())
                            for fqn, moments in optim_state.get("state", {}).items()}
    with own_state_dict():
        dcp_state.set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def _check_model(model: Any, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}(model): expected an nn.Module, got {type(model).__name__}")


def _sharded_experts(model: nn.Module) -> dict[str, Any]:
    """FQN (as torch's state-dict helpers name it: no ``module.`` of DDP) -> the experts' EP state,
    for every packed experts tensor sharded over an EP group of size > 1."""
    from epmoe.ep.config import sharded_experts  # epmoe.ep imports this package

    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    sharded = {}
    for name, _, state in sharded_experts(inner, packed_only=True):
        prefix = f"{name}." if name else ""
        for param_name in state.sharded_names:
            sharded[prefix + param_name] = state
        wrapper = _lora_on(inner, name)
        if wrapper is not None:
            raise ValueError(
                f"get_state_dict: {wrapper} holds LoRA factors on expert-parallel experts, whose column layout "
                f"per expert DCP cannot shard by rows; save the adapter with peft or at EP size 1"
            )
    return sharded


def _lora_on(model: nn.Module, experts_name: str) -> str | None:
    parent = experts_name.rsplit(".", 1)[0] if "." in experts_name else ""
    module = model.get_submodule(parent) if parent else model
    return parent if hasattr(module, "lora_A") and getattr(module, "base_layer", None) is not None else None


def _to_global(tensors: dict[str, Any], sharded: dict[str, Any]) -> dict[str, Any]:
    """Each ``sharded`` entry as a ``DTensor`` ``Shard(0)`` of all ``E`` experts over its EP group."""
    from torch.distributed.tensor import DTensor

    out, meshes = dict(tensors), {}
    for key, state in sharded.items():
        local = out.get(key)
        if isinstance(local, torch.Tensor) and local.dim() > 0 and not isinstance(local, DTensor):
            out[key] = expert_dtensor(local.contiguous(), state, meshes)
    return out


def expert_dtensor(local: torch.Tensor, state: Any, meshes: dict) -> Any:
    """``local`` (this rank's ``E/W`` experts of a packed tensor, on any device, meta included) as the
    ``DTensor`` ``Shard(0)`` of all ``E`` over the EP group of ``state``; ``meshes`` caches one
    ``DeviceMesh`` per group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    group = state.group if state.group is not None else torch.distributed.group.WORLD
    mesh = meshes.get(id(group))
    if mesh is None:
        device = platform.device_type() if local.device.type == "meta" else platform.device_type(local)
        mesh = meshes[id(group)] = DeviceMesh.from_group(group, device)
    shape = torch.Size((local.shape[0] * state.shard.ep_size, *local.shape[1:]))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _to_local(tensors: dict[str, Any], sharded) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    return {k: v.to_local() if k in sharded and isinstance(v, DTensor) else v for k, v in tensors.items()}
