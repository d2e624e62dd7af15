"""``save_pretrained`` on an EP model writes the complete checkpoint, through transformers' own saving.

transformers' ``save_pretrained`` takes ``model.state_dict()``, hands it to the model's
``gather_sharded_state_dict_for_save`` on every rank (the hook its own tensor / FSDP parallelism
uses to assemble full tensors), reverts its weight conversions (packed experts back to the layout
the class's checkpoints use), splits into shards and lets global rank 0 write. On an EP model each
rank's state dict holds only its own experts, so :func:`epmoe.apply_expert_parallel` installs, as
instance attributes of the model (the class is untouched):

* :class:`GatherExperts` as ``gather_sharded_state_dict_for_save``: each experts module's local
  blocks are gathered to the writer (``dist.gather`` over the EP group that holds global rank 0;
  the ``"dp"`` replicas hold the same experts and send nothing), in ``E``-expert tensors, so what
  transformers converts and writes is the unsharded model's state dict;
* :class:`SavePretrained` as ``save_pretrained``: transformers' own, with ``num_parameters``
  counting every expert while it runs (the sharded index's ``total_parameters``), and a barrier at
  the end, so every rank returns once the files are written.

    EP = 2, E = 8           rank 0 state dict           writer's state dict after the gather
    experts.gate_up_proj    (4, 2I, H) experts 0-3   ->  (8, 2I, H) experts 0-7   -> revert, shard, write
    rank 1                  (4, 2I, H) experts 4-7   ->  (sent to rank 0; writes nothing)

Every rank must call ``save_pretrained`` (transformers' convention for distributed models):
:func:`epmoe.prepare_trainer` makes ``Trainer`` save through every rank.

PEFT adapters with LoRA on the packed experts (``target_parameters``) are saved through peft's own
``save_pretrained(state_dict=...)``: :func:`adapter_state_dict` gathers each expert LoRA factor in
peft's layout (``lora_A`` ``(r*E, in)`` expert-major, ``lora_B`` ``(out, r*E)`` expert-minor)::

    peft_model.save_pretrained(path, state_dict=epmoe.adapter_state_dict(peft_model),
                               is_main_process=dist.get_rank() == 0)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from epmoe.checkpoint.guard import own_state_dict
from epmoe.comm.steps import SAVE, OutOfStepError, Position, StepChannel

WRITER = 0  # the global rank transformers writes from


class GatherExperts:
    """``model.gather_sharded_state_dict_for_save`` of an EP model (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, model_to_save: nn.Module, state_dict: dict, distributed_config: Any, *,
                 save_on_this_rank: bool = True) -> dict:
        state_dict = type(self.model).gather_sharded_state_dict_for_save(
            self.model, model_to_save, state_dict, distributed_config, save_on_this_rank=save_on_this_rank)
        return gather_expert_state(model_to_save, state_dict)


class SavePretrained:
    """``model.save_pretrained`` of an EP model: transformers' own, counting every expert."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, save_directory, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        extra = _non_local_expert_numel(model)

        def num_parameters(only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
            local = type(model).num_parameters(model, only_trainable, exclude_embeddings)
            return local + extra["trainable" if only_trainable else "all"]

        model.num_parameters = num_parameters
        try:
            with own_state_dict():
                result = type(model).save_pretrained(model, save_directory, *args, **kwargs)
        finally:
            del model.num_parameters
        dist.barrier()  # the writer has finished: every rank may read the checkpoint now
        return result


def adapter_state_dict(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """``peft_model.state_dict()`` with every LoRA factor on expert-parallel *packed* experts (peft's
    ``target_parameters``) holding all ``E`` experts on the writer (global rank 0), for peft's
    ``save_pretrained(state_dict=...)`` (see the module docstring); other ranks get their own
    factors. LoRA on ``nn.ModuleList`` experts' Linears and LoRA biases are not gathered (they stay
    each rank's). Collective: every rank calls it."""
    from epmoe.training.params import _peft_base

    with own_state_dict():
        out = peft_model.state_dict()
    gathers = _WriterGathers()
    for name, module in peft_model.named_modules():
        state = getattr(_peft_base(module), "_epmoe", None)
        if state is None or not gathers.joins(state.channel):
            continue
        for factor in ("lora_A", "lora_B"):
            for adapter, linear in getattr(module, factor).items():
                parts = gathers.gather(state.channel, linear.weight.detach().contiguous())
                if parts is not None:
                    out[f"{name}.{factor}.{adapter}.weight"] = _cat_lora(factor, parts, module.num_experts)
    return out


def _cat_lora(factor: str, parts: list[torch.Tensor], local_experts: int) -> torch.Tensor:
    """Every rank's ``local_experts`` experts of one LoRA factor, in global expert order."""
    if factor == "lora_A":  # (r*e, in), expert-major: row blocks
        return torch.cat(parts)
    out_features = parts[0].shape[0]  # (out, r*e), expert-minor: viewed (out, r, e)
    blocks = [p.view(out_features, -1, local_experts) for p in parts]
    return torch.cat(blocks, dim=2).reshape(out_features, -1)


def gather_expert_state(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` (of ``model``) with every expert-parallel tensor replaced by all ``E`` experts'
    on the writer (global rank 0); other ranks get theirs back unchanged (they write nothing).
    Collective over every EP group's ranks, in module order; what is gathered follows the model's
    structure, not the state dict's keys (which transformers may build differently per rank)."""
    from epmoe.ep.config import sharded_experts  # epmoe.ep imports this package

    out = dict(state_dict)
    gathers = _WriterGathers()
    for module_name, module, state in sharded_experts(model):
        if not gathers.joins(state.channel):  # a "dp" replica of the writer's EP group: same experts
            continue
        if isinstance(state.local_experts, nn.ModuleList):  # the state is on the block: use the list's name
            _gather_module_list(out, state, f"{state.shard.module_name}.", gathers)
            continue
        prefix = f"{module_name}." if module_name else ""
        for name in state.sharded_names:
            parts = gathers.gather(state.channel, getattr(module, name).detach().contiguous())
            if parts is not None and prefix + name in out:
                out[prefix + name] = torch.cat(parts).to(out[prefix + name].dtype)
    return out


class _WriterGathers:
    """One save's gathers to the writer (global rank 0), each EP group's opened by a step header."""

    def __init__(self):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.started: dict[int, Position] = {}  # channel -> this save's position on it

    def joins(self, channel: StepChannel | None) -> bool:
        """Whether ``channel``'s ranks take part: an EP group holding the writer (its ``"dp"``
        replicas hold the same experts and send nothing)."""
        return channel is not None and WRITER in dist.get_process_group_ranks(channel.group)

    def gather(self, channel: StepChannel, local: torch.Tensor) -> list[torch.Tensor] | None:
        """``local`` of every EP rank, on the writer (``None`` elsewhere)."""
        parts = [torch.empty_like(local) for _ in range(channel.size)] if self.rank == WRITER else None
        return self._run(channel, local.device, lambda: dist.gather(local, parts, dst=WRITER, group=channel.group),
                         parts)

    def gather_object(self, channel: StepChannel, obj, device: torch.device) -> list | None:
        parts = [None] * channel.size if self.rank == WRITER else None
        return self._run(channel, device, lambda: dist.gather_object(obj, parts, dst=WRITER, group=channel.group),
                         parts)

    def _run(self, channel, device, collective, parts):
        if id(channel) not in self.started:
            self.started[id(channel)] = _start_save(channel, device)
        try:
            collective()
        except RuntimeError as exc:
            raise channel.failed(self.started[id(channel)], exc) from exc
        return parts


def _start_save(channel: StepChannel, device: torch.device) -> Position:
    """The step header that opens a save on ``channel``: every EP rank must be saving too."""
    position = channel.next_call(SAVE)
    try:
        channel.check(position, device)
    except OutOfStepError:
        raise
    except RuntimeError as exc:
        raise RuntimeError(
            f"epmoe: save_pretrained on an expert-parallel model must be called on every rank (each holds "
            f"different experts); the other EP ranks did not join EP rank {channel.rank}'s save (it waits at most "
            f"ExpertParallelConfig.timeout = {channel.timeout_s:g} s). With a Trainer, call "
            f"epmoe.prepare_trainer(trainer) so that its saves run on every rank. Cause: {exc.__cause__ or exc}"
        ) from exc
    return position


def _gather_module_list(out: dict, state, prefix: str, gathers: _WriterGathers) -> None:
    """The local experts of a ``ModuleList`` (keys ``{prefix}{index}.*``) sent to the writer, which
    puts every rank's in place of its own, in global expert order."""
    shard = state.shard
    local = {f"{prefix}{shard.local_start + j}.{k}": v.detach()
             for j, expert in enumerate(state.local_experts) for k, v in expert.state_dict().items()}
    device = next(state.local_experts.parameters()).device
    gathered = gathers.gather_object(state.channel, local, device)
    if gathered is None:
        return
    experts = {k: v for part in gathered for k, v in part.items()}
    ordered = sorted(experts, key=lambda k: _expert_index(k, prefix))  # stable: per-expert key order kept
    items, inserted = [], False
    for key, value in out.items():
        if key in local:
            if not inserted:
                items += [(k, experts[k]) for k in ordered]
                inserted = True
        else:
            items.append((key, value))
    out.clear()
    out.update(items)


def _expert_index(key: str, prefix: str) -> int | None:
    if not key.startswith(prefix):
        return None
    head = key[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _non_local_expert_numel(model: nn.Module) -> dict[str, int]:
    """Parameters the other EP ranks hold (``all``, and ``trainable`` ones), as the unsharded model counts them."""
    from epmoe.ep.config import sharded_experts  # epmoe.ep imports this package

    extra = {"all": 0, "trainable": 0}
    for _, module, state in sharded_experts(model):
        others = state.shard.ep_size - 1
        for p in state.sharded_params(module):
            extra["all"] += others * p.numel()
            extra["trainable"] += others * p.numel() if p.requires_grad else 0
    return extra
