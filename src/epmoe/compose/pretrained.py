"""``epmoe.from_pretrained``: an EP model from a transformers checkpoint, each rank reading only its experts.

transformers distributes a model before loading in ``_load_pretrained_model``; epmoe loads through a
subclass of the user's class, made for the call, whose ``_load_pretrained_model`` first applies EP
to the meta model, then lets transformers' loader read this rank's experts only, packing the Hub's
per-expert keys with one copy (through a copy of the call's ``load_config``:
:mod:`epmoe.checkpoint.load`). Everything else (buffers such as rotary ``inv_freq``, tied weights,
missing-key initialisation, dtype handling, ``config=`` and every other keyword) is transformers'
own. The result equals ``from_pretrained`` followed by :func:`epmoe.apply_expert_parallel`.

An Auto class (``AutoModelForCausalLM``...) is resolved to the concrete class its config maps to,
as transformers' own ``from_pretrained`` does.

From transformers' own expert parallelism in one change: ``distributed_config=DistributedConfig(
ep_size=N, fsdp_size=M)``, the keyword of transformers' ``from_pretrained``, is taken as it is and
gives the same layout under epmoe: experts sharded over ``N`` consecutive ranks (a ``("dp", "ep")``
mesh where ``N`` is less than the world: transformers' ``"ep"`` groups, the experts replicated over
its expert-FSDP groups, their gradients reduced by epmoe), the rest in FSDP2 over the ``M`` ranks
(:func:`epmoe.training.fsdp.shard_dense`). What it does not map (tensor or pipeline parallelism,
HSDP, custom plans, offload, mixed precision, an ``ep_implementation`` other than transformers' own or
``"epmoe"``) raises naming the field.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from epmoe.checkpoint.load import (
    as_local_parameters,
    as_meta_dtensors,
    load_error,
    one_copy_conversions,
    raise_on_every_rank,
    restore_conversions,
)
from epmoe.checkpoint.state_dict_warning import own_state_dict
from epmoe.compose.apply import apply_expert_parallel
from epmoe.ep.lora import mark_full_shapes
from epmoe.ep.params import expert_parameters
from epmoe.integrations.releases import installed_transformers
from epmoe.integrations.transformers_ep import EP_IMPLEMENTATION
from epmoe.platform import group_device
from epmoe.training.fsdp import shard_dense

HUB_ARGUMENTS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "proxies",
    "revision",
    "subfolder",
    "token",
    "trust_remote_code",
)  # what from_pretrained passes on to its config


def from_pretrained(
    model_class: type, path, ep_group: Any = None, *, ep_config=None, distributed_config=None, **kwargs: Any
):
    """``(model, shards)``: ``model_class.from_pretrained(path, **kwargs)`` made expert-parallel over
    ``ep_group`` (see :func:`epmoe.apply_expert_parallel`) without materialising other ranks' experts.
    ``model_class``: a transformers model class or an Auto class. ``distributed_config``: a
    transformers ``DistributedConfig`` with ``ep_size > 1`` instead of ``ep_group`` (see the module
    docstring): the model comes back in FSDP2 as well."""
    if distributed_config is not None:
        if ep_group is not None:
            raise ValueError("from_pretrained(ep_group, distributed_config): give one, not both")
        ep_group, fsdp_mesh = _meshes_of(distributed_config)
        model, shards = from_pretrained(model_class, path, ep_group, ep_config=ep_config, **kwargs)
        return shard_dense(model, fsdp_mesh), shards
    model_class = _concrete_class(model_class, path, kwargs)
    found: dict[str, Any] = {}

    class ShardedLoad(model_class):
        @staticmethod
        def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, expected_keys=None):
            found["shards"] = apply_expert_parallel(model, ep_group, config=ep_config)
            expert_keys = as_meta_dtensors(model)
            load_config, originals = one_copy_conversions(load_config, expert_keys)
            info = model_class._load_pretrained_model(model, state_dict, checkpoint_files, load_config, expected_keys)
            restore_conversions(model, originals)
            raise_on_every_rank(load_error(info[0], expert_keys), found["shards"], model)
            as_local_parameters(model, expert_keys)
            return info

    ShardedLoad.__name__ = ShardedLoad.__qualname__ = model_class.__name__
    with own_state_dict():  # transformers' loader reads the (sharded) model's state dict keys
        model = ShardedLoad.from_pretrained(path, **kwargs)
    model.__class__ = model_class  # the user's class again (saving writes its name as the architecture)
    expert_parameters(model)  # mark the loaded parameters
    mark_full_shapes(model)  # the loaded ones are new parameter objects (epmoe.ep.lora)
    return model, found["shards"]


def _concrete_class(model_class: Any, path, kwargs: dict[str, Any]) -> type:
    """``model_class`` if it is a transformers model class; for an Auto class, the model class its
    mapping gives the checkpoint's config (``config=`` if given), built on the meta device to ask."""
    if isinstance(model_class, type) and hasattr(model_class, "_load_pretrained_model"):
        return model_class
    if not (
        isinstance(model_class, type)
        and callable(getattr(model_class, "from_config", None))
        and callable(getattr(model_class, "from_pretrained", None))
    ):
        raise TypeError(
            f"from_pretrained(model_class): expected a transformers model class or Auto class "
            f"(AutoModelForCausalLM...), got {model_class!r}"
        )
    from transformers import AutoConfig, PretrainedConfig

    config = kwargs.get("config")
    if not isinstance(config, PretrainedConfig):  # read as transformers reads it: the same hub arguments
        hub = {key: kwargs[key] for key in HUB_ARGUMENTS if key in kwargs}
        config = AutoConfig.from_pretrained(config or path, **hub)
    with torch.device("meta"):
        try:
            resolved = type(model_class.from_config(config, trust_remote_code=kwargs.get("trust_remote_code", False)))
        except ValueError as exc:
            raise TypeError(
                f"from_pretrained(model_class): {model_class.__name__} has no model class for "
                f"{type(config).__name__}: {exc}"
            ) from exc
    return resolved


# what a DistributedConfig may hold for epmoe to take it: field -> the value it must have, and why not
UNMAPPED = {
    "tp_size": (1, "epmoe does not tensor-parallelise the dense part; give fsdp_size the ranks instead"),
    "pp_size": (1, "pipeline parallelism is not epmoe's"),
    "dp_replicate_size": (1, "HSDP replicas: use fsdp_size over the whole world"),
    "tp_plan": (None, "tensor parallelism is not epmoe's"),
    "ep_plan": (None, "epmoe finds the experts modules itself"),
    "fsdp_plan": (None, "epmoe shards the model's decoder layers and the root"),
    "fsdp_cpu_offload": (False, "not mapped; shard_dense the model yourself with an offload policy"),
    "fsdp_mixed_precision": (False, "not mapped; shard_dense the model yourself with a mixed-precision policy"),
}


def _meshes_of(config: Any) -> tuple[Any, Any]:
    """``(ep_group, fsdp_mesh)`` for a transformers ``DistributedConfig``: the EP group (the world, or
    the ``"ep"`` dim of a ``("dp", "ep")`` mesh of consecutive ranks) and a 1-D mesh of the world."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        raise ValueError(
            "from_pretrained(distributed_config): needs transformers >= 5.24 "
            "(transformers.distributed.DistributedConfig)"
        ) from None
    if not isinstance(config, DistributedConfig):
        raise TypeError(
            f"from_pretrained(distributed_config): expected a transformers DistributedConfig, "
            f"got {type(config).__name__}"
        )
    if not all(hasattr(config, field) for field in ("ep_size", "fsdp_size", "ep_implementation")):
        raise ValueError(
            f"from_pretrained(distributed_config): needs transformers >= 5.24 (DistributedConfig's ep_size, "
            f"fsdp_size and ep_implementation); this is transformers {installed_transformers()}"
        )
    for field, (wanted, why) in UNMAPPED.items():
        value = getattr(config, field, wanted)
        if bool(value) if wanted is None else value not in (wanted, None):
            raise ValueError(f"from_pretrained(distributed_config): {field}={value!r} is not taken: {why}")
    if config.ep_implementation not in ("auto", "all_to_all", EP_IMPLEMENTATION):
        raise ValueError(
            f"from_pretrained(distributed_config): ep_implementation={config.ep_implementation!r}: "
            f"epmoe replaces transformers' token exchange ('auto' or 'all_to_all'; {EP_IMPLEMENTATION!r}, epmoe's "
            f"inside transformers' EP, is epmoe's already); leave it out"
        )
    if not dist.is_initialized():
        raise ValueError("from_pretrained(distributed_config): torch.distributed is not initialized")
    world, ep_size = dist.get_world_size(), config.ep_size
    if ep_size <= 1 or config.fsdp_size != world:
        raise ValueError(
            f"from_pretrained(distributed_config): expected ep_size > 1 and fsdp_size equal to the "
            f"world ({world}), got ep_size={ep_size}, fsdp_size={config.fsdp_size}"
        )
    from torch.distributed.device_mesh import init_device_mesh

    device = group_device().type
    fsdp_mesh = init_device_mesh(device, (world,))
    if ep_size == world:
        return None, fsdp_mesh
    return init_device_mesh(device, (world // ep_size, ep_size), mesh_dim_names=("dp", "ep")), fsdp_mesh
