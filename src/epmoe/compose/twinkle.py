"""``prepare_twinkle``: a twinkle ``TransformersModel`` trained with epmoe's expert parallelism, exact.

twinkle (``twinkle-kit``, ModelScope's training framework) builds the model, the device mesh, the
FSDP2 wrap (its native strategy) or accelerate's (its accelerate strategy), the loss normalisation,
the clip, LoRA and the saves. Its own expert parallelism (``fsdp_config={"expert_parallel": ...}``)
sums expert gradients over the EP group without averaging them and joins LoRA shards in its own
layout; :func:`prepare_twinkle` takes a ``TransformersModel`` built without it and makes the same
twinkle steps (``forward_backward``, ``clip_grad_and_step``, ``add_adapter_to_model``, ``save``)
give the unsharded model's numbers:

* EP over the mesh twinkle built: every rank (the cookbook's layout), or ``ep_size`` ranks of it
  where the mesh says so (the EP groups strided as twinkle's own: ranks ``d, d + W/ep, ...``);
* twinkle's FSDP2 wrap leaves epmoe's experts out (``ignored_params``), accelerate's through
  :func:`epmoe.prepare_accelerator`;
* its normalisation (every gradient divided by the global token count: the same factor on every
  rank, which the step guard lets pass) then :func:`epmoe.clip_grad_norm_` (every expert once);
* LoRA through ``add_adapter_to_model`` sized and drawn as the unsharded model's on twinkle's peft
  (:func:`epmoe.ep.lora.whole_experts_for_peft`);
* checkpoint saves whole (the EP model's own ``save_pretrained``, which twinkle's ``save`` calls) and
  adapter saves whole (:func:`epmoe.checkpoint.save.whole_state_dict`), and the trainable-parameter
  count every expert once.

twinkle has no hook for any of these, so each is a method or attribute of *this* model or strategy,
listed in :data:`TOUCH_POINTS` with the signature it was checked against and why; a twinkle version
not in :data:`MADE_FOR`, or one whose methods changed, is refused by name before anything changes.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from epmoe.checkpoint.save import whole_state_dict
from epmoe.compose.apply import apply_expert_parallel
from epmoe.ep.config import ExpertParallelConfig
from epmoe.ep.lora import whole_experts_for_peft
from epmoe.ep.params import expert_parameters, parameter_counts
from epmoe.ep.state import sharded_experts
from epmoe.gmm import grouped_mm
from epmoe.training.accelerate import prepare_accelerator
from epmoe.training.clip import clip_grad_norm_
from epmoe.training.launchers import (
    CALLED,
    READ,
    REPLACED,
    Entry,
    is_instance_of,
    remember,
    remembered,
    replace,
    signature_text,
)

MADE_FOR = ("0.5.1",)  # the twinkle-kit versions whose internals TOUCH_POINTS were checked against
PREPARED = "prepare_twinkle"
_MODEL = "twinkle.model.transformers.TransformersModel"
_NATIVE = "twinkle.model.transformers.strategy.native_fsdp.NativeFSDPStrategy"
_ACCELERATE = "twinkle.model.transformers.strategy.accelerate.AccelerateStrategy"

TOUCH_POINTS = (
    Entry(
        "twinkle",
        _MODEL,
        "clip_grad_norm",
        "(self, max_grad_norm=1.0, norm_type=2, **kwargs)",
        REPLACED,
        "twinkle's own runs with max_grad_norm=inf (its unscale and its division by the global token count, "
        "one factor on every rank), then epmoe.clip_grad_norm_ (its norm sees each rank's experts only); the "
        "adapter from its _get_default_group, the norm reported in its OptimizerGroup._last_grad_norm",
    ),
    Entry(
        "twinkle",
        _MODEL,
        "_patch_adapter",
        "(self, adapter_name, config_or_dir, **kwargs)",
        REPLACED,
        "what add_adapter_to_model runs: twinkle's own inside whole_experts_for_peft, so peft <= 0.20 (twinkle "
        "caps peft at 0.19) sizes and draws the expert factors as the unsharded model's",
    ),
    Entry(
        "twinkle",
        _MODEL,
        "_get_nb_trainable_parameters",
        "(self, adapter_name, model)",
        REPLACED,
        "twinkle multiplies by its own EP size only: epmoe.parameter_counts counts every expert once",
    ),
    Entry(
        "twinkle",
        _MODEL,
        "_get_trainable_parameters",
        "(self, adapter_name='')",
        CALLED,
        "the parameters twinkle's clip and optimizer take, clipped by epmoe the same",
    ),
    Entry(
        "twinkle",
        _NATIVE,
        "get_adapter_state_dict",
        "(self, model, adapter_name)",
        REPLACED,
        "twinkle's own writes rank 0's slice of the expert LoRA factors: whole_state_dict of its LoRA keys",
    ),
    Entry(
        "twinkle",
        _NATIVE,
        "wrap_model",
        "(self, model, optimizer=None)",
        READ,
        "its fully_shard passes ignored_params (the parameters of each block marked _ep_patched, under its "
        "'experts') only where enable_ep is set: both set by prepare_twinkle, so FSDP2 leaves epmoe's experts out",
    ),
    Entry(
        "twinkle",
        "twinkle.kernel.ops.ep",
        "_get_impls",
        "()",
        CALLED,
        "its registry of EP experts backends (a list, tried in order): register_grouped_mm puts epmoe's first",
    ),
    Entry(
        "twinkle",
        _ACCELERATE,
        "get_adapter_state_dict",
        "(self, model, adapter_name)",
        REPLACED,
        "as the native strategy's",
    ),
)


def prepare_twinkle(model: Any, config: ExpertParallelConfig | dict | None = None) -> Any:
    """Make the twinkle ``TransformersModel`` ``model`` train with epmoe's EP, exactly; returns it.

    Call on every rank, after building the model (without twinkle's own ``expert_parallel``) and
    before its first forward; ``config``: the :class:`ExpertParallelConfig`. Idempotent. Raises
    ``TypeError`` for anything but a ``TransformersModel`` and ``ValueError`` naming what it cannot
    serve: a twinkle version it was not made for, twinkle's own EP, a model already wrapped,
    ``memory_efficient_init`` (its rank-0 broadcast sends whole experts tensors), a mesh that does
    not cover every rank or that ``ep_size`` does not divide."""
    _check_twinkle(model)
    if remembered(model, PREPARED):
        return model
    _check_servable(model)
    strategy = model.strategy
    hf_model = strategy.unwrap_model(model.model)
    apply_expert_parallel(hf_model, _ep_group(model.device_mesh), config=config)
    if is_instance_of(strategy, _NATIVE):
        _leave_experts_out_of_fsdp(strategy, hf_model)
    else:
        prepare_accelerator(strategy.accelerator)
    replace(model, "clip_grad_norm", _clip(model), TOUCH_POINTS)
    replace(model, "_patch_adapter", _patch_adapter(model, hf_model), TOUCH_POINTS)
    counts = lambda adapter_name, module: parameter_counts(module)  # noqa: E731 - twinkle's signature
    replace(model, "_get_nb_trainable_parameters", counts, TOUCH_POINTS)
    replace(strategy, "get_adapter_state_dict", _adapter_state_dict(strategy), TOUCH_POINTS)
    remember(model, PREPARED)
    return model


def register_grouped_mm() -> None:
    """Make epmoe's grouped matmul (:func:`epmoe.grouped_mm`, every platform's backend) the compute of
    twinkle's *own* expert parallelism, ahead of its NPU-only grouped matmul and its per-expert loop:
    the same numbers as its loop, in two grouped matmuls per layer. For users who keep twinkle's EP;
    its gradients stay twinkle's (expert gradients summed over the EP group, not averaged as the
    rest: 2x the unsharded model's at EP 2 over 2 ranks). Idempotent; ``ValueError`` on a twinkle
    version it was not made for."""
    _check_twinkle_version()
    from twinkle.kernel.ops.ep import _get_impls

    backends = _get_impls()
    if not any(isinstance(backend, _twinkle_backend_class()) for backend in backends):
        backends.insert(0, _twinkle_backend_class()())


@functools.cache
def _twinkle_backend_class() -> type:
    """epmoe's grouped matmul as a twinkle ``EpExpertsGmm`` backend (its class defined once twinkle is there)."""
    from twinkle.kernel.ops.ep import EpExpertsGmm

    class EpmoeExpertsGmm(EpExpertsGmm):
        name = "epmoe grouped_mm"

        def ineligible_reason(self, experts_mod: nn.Module) -> str | None:
            weights = [getattr(experts_mod, name, None) for name in ("gate_up_proj", "down_proj")]
            if not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
                return "not packed gate_up_proj / down_proj experts"
            if getattr(experts_mod, "is_transposed", False) or getattr(experts_mod, "has_bias", False):
                return "transposed or biased experts"
            return None

        def forward(self, experts_mod, permuted_tokens, num_global_sum_tokens_per_local_expert, experts_per_rank):
            counts = num_global_sum_tokens_per_local_expert
            rows = permuted_tokens.to(experts_mod.gate_up_proj.dtype)
            gate_up = grouped_mm(rows, experts_mod.gate_up_proj, counts, trans_weight=True)
            if hasattr(experts_mod, "_apply_gate"):
                hidden = experts_mod._apply_gate(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                hidden = experts_mod.act_fn(gate) * up
            out = grouped_mm(hidden, experts_mod.down_proj, counts, trans_weight=True)
            return out.to(permuted_tokens.dtype)

    return EpmoeExpertsGmm


# ---- what is checked before anything changes


def _check_twinkle(model: Any) -> None:
    try:
        from twinkle.model import TransformersModel
    except ImportError as exc:
        raise TypeError("prepare_twinkle(model): twinkle (pip install epmoe[twinkle]) is not installed") from exc
    if not isinstance(model, TransformersModel):
        raise TypeError(f"prepare_twinkle(model): expected a twinkle TransformersModel, got {type(model).__name__}")
    _check_twinkle_version()


def _check_twinkle_version() -> None:
    version = importlib.metadata.version("twinkle-kit")
    if version not in MADE_FOR:
        raise ValueError(
            f"epmoe: twinkle-kit {version} is installed; prepare_twinkle was made for "
            f"{', '.join(MADE_FOR)} (it replaces methods twinkle offers no hook for: epmoe.compose.twinkle."
            f"TOUCH_POINTS). Install twinkle-kit=={MADE_FOR[-1]}"
        )
    changed = [f"{entry.owner}.{entry.method}" for entry in TOUCH_POINTS if _signature(entry) != entry.signature]
    if changed:
        raise ValueError(
            f"epmoe: the installed twinkle-kit {version} differs from the one prepare_twinkle "
            f"was checked against in {changed}"
        )


def _check_servable(model: Any) -> None:
    if getattr(model, "_enable_expert_parallel", False):
        raise ValueError(
            "prepare_twinkle(model): the model was built with twinkle's own expert parallelism "
            "(fsdp_config['expert_parallel']); build it without, epmoe takes its place"
        )
    if getattr(model, "_model_wrapped", False):
        raise ValueError("prepare_twinkle(model): the model has run a forward already; call it right after building")
    if getattr(model.strategy, "_memory_efficient_init", False):
        raise ValueError(
            "prepare_twinkle(model): memory_efficient_init=True broadcasts whole tensors from rank 0 into the "
            "FSDP2 wrap, expert slices included; build the model with memory_efficient_init=False"
        )
    if not (is_instance_of(model.strategy, _NATIVE) or is_instance_of(model.strategy, _ACCELERATE)):
        raise ValueError(
            f"prepare_twinkle(model): twinkle's {type(model.strategy).__name__} strategy is not served "
            f"(native_fsdp and accelerate are)"
        )
    if model.device_mesh is None or not dist.is_initialized():
        raise ValueError("prepare_twinkle(model): the model has no device mesh; build it with twinkle's DeviceMesh")


def _ep_group(mesh: Any) -> Any:
    """The EP group over twinkle's mesh: ``None`` (every rank) or a ``("dp", "ep")`` DeviceMesh whose
    EP groups are strided as twinkle's own (``ep`` rows of ``arange(W).reshape(ep, W // ep)``)."""
    world = dist.get_world_size()
    if sorted(torch.as_tensor(mesh.mesh).flatten().tolist()) != list(range(world)):
        raise ValueError(f"prepare_twinkle(model): the device mesh {mesh.mesh.tolist()} does not cover every rank")
    ep_size = mesh.ep_size or world
    if world % ep_size:
        raise ValueError(f"prepare_twinkle(model): the mesh's ep_size {ep_size} does not divide {world} ranks")
    if ep_size == world:
        return None
    ranks_dp_ep = torch.arange(world).reshape(ep_size, world // ep_size).T
    return DeviceMesh(mesh.device_type or "cpu", ranks_dp_ep, mesh_dim_names=("dp", "ep"))


# ---- the touch points


def _leave_experts_out_of_fsdp(strategy: Any, hf_model: nn.Module) -> None:
    """twinkle's FSDP2 wrap ignores the parameters under ``block.experts`` of every block marked
    ``_ep_patched`` once ``enable_ep`` is set (its own EP mesh stays unbuilt: twinkle's EP stays off)."""
    experts = {id(module) for _, module, _ in sharded_experts(hf_model, packed_only=True)}
    blocks = [block for block in hf_model.modules() if id(block._modules.get("experts")) in experts]
    if len(blocks) != len(experts):
        raise ValueError(
            "prepare_twinkle(model): twinkle's FSDP2 wrap finds experts only as a block's 'experts' attribute; "
            "this model keeps some elsewhere"
        )
    strategy.enable_ep = True
    for block in blocks:
        block._ep_patched = True


def _clip(model: Any) -> Callable:
    own = model.clip_grad_norm

    def clip_grad_norm(max_grad_norm: float = 1.0, norm_type: float = 2, **kwargs: Any) -> float | None:
        adapter_name = kwargs.get("adapter_name", model._get_default_group())
        if own(math.inf, norm_type, **kwargs) is None:  # not a step that syncs: twinkle did nothing
            return None
        parameters = list(model._get_trainable_parameters(adapter_name).values())
        norm = float(clip_grad_norm_(parameters, max_grad_norm, norm_type))
        model.optimizer_group[adapter_name]._last_grad_norm = norm  # what twinkle's metrics report
        return norm

    return clip_grad_norm


def _patch_adapter(model: Any, hf_model: nn.Module) -> Callable:
    own = model._patch_adapter

    def patch_adapter(adapter_name: str, config_or_dir: Any, **kwargs: Any) -> None:
        init = getattr(config_or_dir, "init_lora_weights", True)
        if isinstance(init, str) and init != "gaussian" and getattr(config_or_dir, "target_parameters", None):
            raise ValueError(
                f"add_adapter_to_model: init_lora_weights={init!r} reads the base weights, which expert "
                f"parallelism splits; use True or 'gaussian' with target_parameters"
            )
        with whole_experts_for_peft(hf_model):
            own(adapter_name, config_or_dir, **kwargs)
        expert_parameters(hf_model)  # marks the new factors as expert parameters (twinkle's FSDP2 leaves them out)

    return patch_adapter


def _adapter_state_dict(strategy: Any) -> Callable:
    def get_adapter_state_dict(model: nn.Module, adapter_name: str) -> dict:
        suffix = f".{adapter_name}."

        def keep(key: str) -> bool:
            return suffix in key and any(f in key for f in ("lora_A", "lora_B", "lora_embedding"))

        return {key: value.cpu() for key, value in whole_state_dict(strategy.unwrap_model(model), keep).items()}

    return get_adapter_state_dict


def _signature(entry: Entry) -> str | None:
    try:
        return signature_text(entry.resolve())
    except (ImportError, AttributeError):
        return None
