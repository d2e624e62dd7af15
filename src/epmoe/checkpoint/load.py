"""``epmoe.from_pretrained``: an EP model from a transformers checkpoint, each rank reading only its experts.

transformers' ``from_pretrained`` builds the model on the meta device, then loads the checkpoint
through its weight conversions (the Hub's per-expert keys merged into packed tensors, renamings...)
and, for a parameter that is a ``DTensor``, reads only that rank's shard from the memory-mapped
safetensors files (per-expert keys of other ranks' experts are skipped, a packed tensor is sliced).
epmoe loads through exactly that path, with one step added where transformers distributes a model
before loading (``_load_pretrained_model``, on a subclass of the user's class made for the call)::

    meta model --apply_expert_parallel--> local experts, meta, (E/W, ...)
               --as DTensors------------> meta DTensor (E, ...), Shard(0) over the EP group
               --transformers' loader---> reads rows [r*E/W, (r+1)*E/W) only, converted as usual
               --to local Parameters----> plain nn.Parameter (E/W, ...), as apply_expert_parallel leaves them

Everything else (buffers such as rotary ``inv_freq``, tied weights, missing-key initialisation,
dtype handling, ``config=`` and every other keyword) is transformers' own. The result equals
``from_pretrained`` followed by :func:`epmoe.apply_expert_parallel`. A checkpoint without some
expert tensor, or with one of the wrong shape, raises ``ValueError`` on every rank of the EP group
(a rank finds only its own experts broken: the ranks compare notes in one ``all_gather_object``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from epmoe.checkpoint.dcp import expert_dtensor
from epmoe.checkpoint.guard import own_state_dict


def from_pretrained(model_class: type, path, ep_group: Any = None, *, ep_config=None, **kwargs: Any):
    """``(model, shards)``: ``model_class.from_pretrained(path, **kwargs)`` made expert-parallel over
    ``ep_group`` (see :func:`epmoe.apply_expert_parallel`) without materialising other ranks' experts."""
    if not isinstance(model_class, type) or not hasattr(model_class, "_load_pretrained_model"):
        raise TypeError(f"from_pretrained(model_class): expected a transformers model class, got {model_class!r}")
    found: dict[str, Any] = {}

    class ShardedLoad(model_class):
        @staticmethod
        def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, expected_keys=None):
            from epmoe.ep.apply import apply_expert_parallel

            found["shards"] = apply_expert_parallel(model, ep_group, config=ep_config)
            expert_keys = _as_meta_dtensors(model)
            info = model_class._load_pretrained_model(model, state_dict, checkpoint_files, load_config,
                                                      expected_keys)
            _raise_on_every_rank(_load_error(info[0], expert_keys), found["shards"], model)
            _as_local_parameters(model)
            return info

    ShardedLoad.__name__ = ShardedLoad.__qualname__ = model_class.__name__
    with own_state_dict():  # transformers' loader reads the (sharded) model's state dict keys
        model = ShardedLoad.from_pretrained(path, **kwargs)
    model.__class__ = model_class  # the user's class again (saving writes its name as the architecture)
    from epmoe.training.params import expert_parameters

    expert_parameters(model)  # mark the loaded parameters
    return model, found["shards"]


def _as_meta_dtensors(model: nn.Module) -> set[str]:
    """Each local expert tensor as a meta ``DTensor`` of all ``E`` experts, ``Shard(0)`` over its EP
    group (transformers' loader then reads this rank's rows only); returns their names."""
    from epmoe.ep.config import sharded_experts  # epmoe.ep imports this package

    keys, meshes = set(), {}
    for name, module, state in sharded_experts(model, packed_only=True):
        for param_name in state.sharded_names:
            local = getattr(module, param_name)
            full = expert_dtensor(torch.empty_like(local, device="meta"), state, meshes)
            setattr(module, param_name, nn.Parameter(full, requires_grad=local.requires_grad))
            keys.add(f"{name}.{param_name}" if name else param_name)
    return keys


def _load_error(info: Any, expert_keys: set[str]) -> str | None:
    """What is wrong with this rank's experts in the checkpoint, or ``None``."""
    missing = sorted(expert_keys & set(getattr(info, "missing_keys", ())))
    mismatched = sorted(key for key, *_ in getattr(info, "mismatched_keys", ()) if key in expert_keys)
    if missing or mismatched:
        return f"missing or incomplete {missing[:4]}, wrong shape {mismatched[:4]}"
    return None


def _raise_on_every_rank(error: str | None, shards: list, model: nn.Module) -> None:
    """Each rank reads only its own experts, so only some may find a broken one: tell the EP group
    (one ``all_gather_object``) and raise ``ValueError`` on all of it."""
    group = next((m._epmoe.group for m in model.modules() if hasattr(m, "_epmoe")), None)
    errors = [error]
    if shards and shards[0].ep_size > 1:
        errors = [None] * shards[0].ep_size
        torch.distributed.all_gather_object(errors, error, group=group)
    bad = [(rank, message) for rank, message in enumerate(errors) if message is not None]
    if bad:
        raise ValueError(
            "epmoe.from_pretrained: the checkpoint does not hold every expert: "
            + "; ".join(f"EP rank {rank}: {message}" for rank, message in bad)
        )


def _as_local_parameters(model: nn.Module) -> None:
    """The loaded ``DTensor`` expert parameters as plain local ``nn.Parameter``s."""
    from epmoe.ep.config import sharded_experts  # epmoe.ep imports this package

    from torch.distributed.tensor import DTensor

    for _, module, state in sharded_experts(model, packed_only=True):
        for param_name in state.sharded_names:
            param = getattr(module, param_name)
            if isinstance(param, DTensor):
                local = nn.Parameter(param.to_local().detach(), requires_grad=param.requires_grad)
                local._is_hf_initialized = True
                setattr(module, param_name, local)
