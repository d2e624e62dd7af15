"""``save_pretrained`` on an EP model writes the complete checkpoint, through transformers' own saving.

transformers' ``save_pretrained`` takes ``model.state_dict()``, hands it to the model's
``gather_sharded_state_dict_for_save`` on every rank (the hook its own tensor / FSDP parallelism
uses to assemble full tensors), reverts its weight conversions (packed experts back to the layout
the class's checkpoints use) on the whole dict at once, splits it into shards and lets global rank
0 write. On an EP model each rank's state dict holds only its own experts, and the whole model's
experts held at once would not fit the writer, so :func:`epmoe.apply_expert_parallel` installs, as
instance attributes of the model (the class is untouched):

* :class:`SavePretrained` as ``save_pretrained``: transformers' own (config, generation config,
  custom code, removal of stale files; the index's ``total_parameters`` from the model's
  ``num_parameters``, which counts every expert: :class:`epmoe.ep.params.NumParameters`); then
  :class:`StreamedWeights` writes the weights, and a step header on the model's EP and ``"dp"``
  groups (bounded by ``ExpertParallelConfig.timeout``, the model's ranks only) lets every rank
  return once the files are written;
* :class:`GatherExperts` as ``gather_sharded_state_dict_for_save``: it takes the state dict
  transformers prepared (keys to ignore removed) for :class:`StreamedWeights` and hands transformers
  an empty one, so transformers itself writes no weights.

:class:`StreamedWeights` plans the files exactly as transformers would for the unsharded model:
each experts tensor stands in as a meta tensor of all ``E`` experts, transformers'
``revert_weight_conversion`` and the hub's shard splitter run on that dict (a tensor's storage is
the meta tensor it is a view of, as the real one is a view of a real tensor), which gives the same
keys, shapes, dtypes, file names and index. The writer (global rank 0) then writes each file tensor
by tensor, from a header written first. An experts tensor comes from the EP group holding the
writer (its ``"dp"`` replicas hold the same experts and send nothing) one rank's part at a time,
reverted alone and renumbered, where the class's checkpoints name each expert's tensors; whole
(``dist.gather``) where they keep the experts packed::

    EP = 2, E = 8             rank 0: experts.gate_up_proj (4, 2I, H) experts 0-3   rank 1: experts 4-7
    writer, part by part      rank 0's part -> revert -> experts.{0..3}.gate_proj / up_proj -> written, freed
                              rank 1's part --send--> revert -> experts.{0..3} renumbered {4..7} -> written

The writer so holds its own shard, one rank's part of one experts tensor and transformers' reverted
copy of it. Every rank must call ``save_pretrained`` (transformers' convention for distributed
models): :func:`epmoe.prepare_trainer` makes ``Trainer`` save through every rank.

PEFT adapters with LoRA on the packed experts (``target_parameters``) are saved through peft's own
``save_pretrained(state_dict=...)``: :func:`adapter_state_dict` gathers each expert LoRA factor in
peft's layout (``lora_A`` ``(r*E, in)`` expert-major, ``lora_B`` ``(out, r*E)`` expert-minor)::

    peft_model.save_pretrained(path, state_dict=epmoe.adapter_state_dict(peft_model),
                               is_main_process=dist.get_rank() == 0)
"""

from __future__ import annotations

import contextvars
import inspect
import json
import os
import struct
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from epmoe import platform
from epmoe.checkpoint.state_dict_warning import own_state_dict
from epmoe.comm.steps import SAVE, OutOfStepError, Position, StepChannel
from epmoe.ep.model import expert_owner
from epmoe.ep.params import expert_parameters
from epmoe.ep.shard_mark import ShardMark, mark_of
from epmoe.ep.state import ExpertParallelState, sharded_experts
from epmoe.integrations.peft import cat_factor, expert_lora_wrappers, factor_weights

WRITER = 0  # the global rank transformers writes from
_SAVING: contextvars.ContextVar[StreamedWeights | None] = contextvars.ContextVar("epmoe_saving", default=None)


class GatherExperts:
    """``model.gather_sharded_state_dict_for_save`` of an EP model (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(
        self, model_to_save: nn.Module, state_dict: dict, distributed_config: Any, *, save_on_this_rank: bool = True
    ) -> dict:
        state_dict = type(self.model).gather_sharded_state_dict_for_save(
            self.model, model_to_save, state_dict, distributed_config, save_on_this_rank=save_on_this_rank
        )
        if getattr(model_to_save, "_hf_peft_config_loaded", False):
            return state_dict  # transformers' own adapters: adapter weights only, written as they are
        save = _SAVING.get()
        if save is None:
            raise RuntimeError(
                f"epmoe: {type(self.model).__name__}.save_pretrained was called on the class, bypassing the EP "
                f"model's save_pretrained: call model.save_pretrained(path) on every rank"
            )
        save.take(model_to_save, state_dict, save_on_this_rank)
        return {}  # transformers writes no weights: StreamedWeights writes them, tensor by tensor


class SavePretrained:
    """``model.save_pretrained`` of an EP model: transformers' own, counting every expert, with the
    weights written by :class:`StreamedWeights`."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, save_directory, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        options = inspect.signature(type(model).save_pretrained).bind(model, save_directory, *args, **kwargs)
        options.apply_defaults()
        if options.arguments.get("push_to_hub"):
            raise ValueError(
                "save_pretrained(push_to_hub=True): an expert-parallel model's weights are written after "
                "transformers' own save, so they would not be uploaded; save, then upload the folder "
                "(huggingface_hub.upload_folder)"
            )
        weights = StreamedWeights(os.fspath(save_directory), options.arguments)
        token = _SAVING.set(weights)
        try:
            with own_state_dict():
                if "gather_sharded_state_dict_for_save" not in vars(model):  # a release without the hook
                    _take_before_saving(weights, model, options.arguments)
                result = type(model).save_pretrained(*options.args, **options.kwargs)
                weights.write()
        finally:
            _SAVING.reset(token)
        _written(model)
        return result


def _take_before_saving(weights: StreamedWeights, model: nn.Module, arguments: dict[str, Any]) -> None:
    """Under a transformers release whose ``save_pretrained`` has no ``gather_sharded_state_dict_for_save``
    hook (5.6: it writes ``model.state_dict()`` from every rank it is called on), hand
    ``weights`` what the hook would receive (the state dict, keys to ignore removed) and transformers
    an empty one (``arguments["state_dict"]``), so that transformers writes no weights and
    :class:`StreamedWeights` writes all of them, as under a release with the hook."""
    if getattr(model, "_hf_peft_config_loaded", False):
        return  # transformers' own adapters: adapter weights only, written as they are
    state_dict = arguments["state_dict"]
    state_dict = dict(model.state_dict() if state_dict is None else state_dict)
    for key in model._keys_to_ignore_on_save or ():
        state_dict.pop(key, None)
    weights.take(model, state_dict, arguments["is_main_process"])
    arguments["state_dict"] = {}


def _written(model: nn.Module) -> None:
    """Return once the writer has finished, on every rank of ``model`` (then any may read the
    checkpoint): a step header on the model's EP group, then on its ``"dp"`` group, each bounded by
    ``ExpertParallelConfig.timeout``. Only the model's ranks take part (not the whole world, where
    other ranks may be running other models): every rank of an EP x DP mesh shares a ``"dp"`` group
    with a rank of the writer's EP group, which passed its header after the writer had finished.

    A model whose ranks do not include the writer (an EP group of other ranks than global rank 0,
    without a ``"dp"`` group reaching it) had nothing written, by transformers or by epmoe: the EP
    header carries whether each rank's groups hold the writer, and every rank raises ``ValueError``."""
    state = next((state for _, _, state in sharded_experts(model)), None)
    if state is None:
        return
    dp_channel = state.model.dp_channel
    channels = [channel for channel in (state.model.channel, dp_channel) if channel is not None]
    holds = any(WRITER in dist.get_process_group_ranks(channel.group) for channel in channels)
    ep, device = state.model.channel, platform.group_device(state.model.channel.group)
    payload_W1 = platform.host_to_device(torch.full((ep.size, 1), int(holds), dtype=torch.int64), device)
    received, _ = ep.exchange(ep.next_call(SAVE), payload_W1)
    if dp_channel is not None:
        dp_channel.check(dp_channel.next_call(SAVE), platform.group_device(dp_channel.group))
    if not any(row[0] for row in received):
        raise ValueError(
            f"save_pretrained: this EP model's ranks {dist.get_process_group_ranks(ep.group)} do not include "
            f"global rank {WRITER}, which writes the checkpoint (transformers' convention): nothing was written. "
            f'Save a model whose EP group (or "dp" group) includes global rank {WRITER}'
        )


class StreamedWeights:
    """The weights of one ``save_pretrained`` of an EP model, written tensor by tensor (see the module
    docstring). Every rank takes part in :meth:`write`; the writer writes."""

    def __init__(self, save_directory: str, options: dict[str, Any]):
        self.directory = save_directory
        self.options = options
        self.model: nn.Module | None = None
        self.state_dict: dict[str, torch.Tensor] | None = None
        self.on_this_rank = False
        self.sharded: dict[int, tuple[torch.Tensor, DTensor]] = {}  # id(meta stand-in) -> (it, its DTensor)

    def take(self, model: nn.Module, state_dict: dict[str, torch.Tensor], save_on_this_rank: bool) -> None:
        if getattr(model, "hf_quantizer", None) is not None:
            raise NotImplementedError("epmoe: save_pretrained of a quantized expert-parallel model is not supported")
        self.model, self.state_dict = model, state_dict
        self.on_this_rank = save_on_this_rank and (dist.get_rank() if dist.is_initialized() else 0) == WRITER

    def write(self) -> None:
        """Plan the files on every rank (the same plan everywhere: it decides the gathers' order),
        then gather and write them."""
        if self.state_dict is None:  # transformers returned before taking the state dict
            return
        from huggingface_hub import split_state_dict_into_shards_factory
        from transformers.modeling_utils import _add_variant, remove_tied_weights_from_state_dict
        from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

        model, variant = self.model, self.options.get("variant")
        state_dict = remove_tied_weights_from_state_dict(self.state_dict, model)
        self.state_dict = None
        state_dict = {key: self._stand_in(tensor) for key, tensor in state_dict.items()}
        gathers = _WriterGathers()
        full, units = _with_full_experts(model, state_dict, gathers)
        if not units and not self.sharded and not self.on_this_rank:  # nothing to send, nothing to write
            return
        planned = self._revert(full)
        unwritable = sorted(key for key, tensor in planned.items() if tensor.dtype not in _SAFETENSORS_DTYPES)
        if unwritable:  # found by every rank that plans, before any transfer
            raise TypeError(
                f"epmoe: save_pretrained cannot write {unwritable[:4]} (dtype "
                f"{planned[unwritable[0]].dtype}) to safetensors"
            )
        owner = _owners(planned, units, self._revert, set(self.sharded))
        del full
        weights_name = _add_variant(SAFE_WEIGHTS_NAME, variant)
        split = split_state_dict_into_shards_factory(
            planned,
            get_storage_id=_storage_id,
            get_storage_size=_storage_size,
            max_shard_size=self.options.get("max_shard_size", "50GB"),
            filename_pattern=weights_name.replace(".safetensors", "{suffix}.safetensors"),
        )
        for filename, keys in split.filename_to_tensors.items():
            self._write_file(filename, keys, planned, owner, units)
        if self.on_this_rank and split.is_sharded:
            index = {
                "metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                "weight_map": split.tensor_to_filename,
            }
            with open(
                os.path.join(self.directory, _add_variant(SAFE_WEIGHTS_INDEX_NAME, variant)), "w", encoding="utf-8"
            ) as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")

    def _stand_in(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, or for a ``DTensor`` (a weight FSDP2 shards) a meta tensor of its full shape,
        planned like the experts' and gathered (:meth:`_full`) only when its file is written."""
        if not isinstance(tensor, DTensor):
            return tensor
        stand_in = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        self.sharded[id(stand_in)] = (stand_in, tensor)
        return stand_in

    def _full(self, planned: torch.Tensor) -> torch.Tensor:
        """The tensor to write for ``planned``: itself, or the full tensor its DTensor stands for (a
        collective over the DTensor's mesh, run by every rank in the same order), viewed as planned."""
        entry = self.sharded.get(id(_root(planned)))
        if entry is None:
            return planned
        stand_in, dtensor = entry
        full = dtensor.full_tensor()
        return (
            full if planned is stand_in else full.as_strided(planned.shape, planned.stride(), planned.storage_offset())
        )

    def _revert(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' own conversion back to the class's checkpoint layout (unless
        ``save_original_format=False``)."""
        if not self.options.get("save_original_format", True):
            return state_dict
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(_SavedAs(self.model, state_dict), state_dict)

    def _write_file(
        self,
        filename: str,
        keys: list[str],
        planned: dict,
        owner: dict[str, int],
        units: list[_PackedUnit | _ModuleListUnit],
    ) -> None:
        """One safetensors file: the header from the plan, then its tensors, each unit's as its pieces
        arrive (the header lists them in that order)."""
        in_file = set(keys)
        sources: dict[int | None, list[str]] = {}  # None: the tensors every rank holds (not experts)
        for key in keys:
            sources.setdefault(owner.get(key), []).append(key)
        order = [
            key
            for source, own in sources.items()
            for key in (own if source is None else [k for k in units[source].keys if k in in_file])
        ]
        writer = (
            _SafetensorsWriter(os.path.join(self.directory, filename), order, planned) if self.on_this_rank else None
        )
        try:
            for source, own in sources.items():
                if source is None:  # every rank holds these; FSDP2's shards are gathered by every rank
                    for key in own:
                        if writer is not None or id(_root(planned[key])) in self.sharded:
                            tensor = self._full(planned[key])
                            if writer is not None:
                                writer.write(key, tensor)
                    continue
                for piece in units[source].pieces(self._revert):
                    if writer is not None and piece is not None:
                        writer.write_from(piece, in_file)
                    del piece  # before the next piece arrives: no name holds it (or a view of it)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        if writer is not None:
            writer.close()


def _with_full_experts(
    model: nn.Module, state_dict: dict[str, torch.Tensor], gathers: _WriterGathers
) -> tuple[dict[str, torch.Tensor], list[_PackedUnit | _ModuleListUnit]]:
    """``state_dict`` with every expert-parallel tensor replaced by its meta tensor of all ``E``
    experts, and the units that gather them, in the model's module order. A unit exists for each
    experts tensor the state dict holds: transformers builds it the same way on every rank (a
    ``state_dict=`` passed to ``save_pretrained`` must hold the same keys on every rank)."""
    full, units = dict(state_dict), []
    for module_name, module, state in sharded_experts(model):
        if not gathers.joins(state.model.channel):  # a "dp" replica of the writer's EP group: same experts
            continue
        if isinstance(state.local_experts, nn.ModuleList):  # the state is on the block: use the list's name
            unit = _ModuleListUnit(state, f"{state.shard.module_name}.", gathers)
            if any(key in full for key in unit.local):
                full = unit.placed_in(full)
                units.append(unit)
            continue
        prefix = f"{module_name}." if module_name else ""
        for name in state.sharded_names:
            if prefix + name in full:
                unit = _PackedUnit(
                    prefix + name, module.get_parameter(name).detach(), full[prefix + name].dtype, state, gathers
                )
                full.update(unit.full)
                units.append(unit)
    return full, units


class _SavedAs:
    """``model`` as transformers' reverse conversions see it while saving ``state_dict``: each
    parameter is the tensor saved for it (an expert-parallel one: all ``E`` experts, not this rank's
    shard). A conversion that compares a tensor with its parameter's shape before acting
    (``Transpose(check_dims=True)``, Qwen3-VL-MoE's experts) then acts as in a save without EP;
    against the shard it transposed the whole tensor, which a square one (``2I == H``) never undoes
    when loaded. Everything else is the model's."""

    def __init__(self, model: nn.Module, state_dict: dict[str, torch.Tensor]):
        self._model, self._state_dict = model, state_dict

    def get_parameter(self, target: str) -> torch.Tensor:
        saved = self._state_dict.get(target)
        return saved if saved is not None else self._model.get_parameter(target)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


class _PackedUnit:
    """One packed experts tensor ``(E/W, ...)`` per rank (``(E/W * rows, ...)`` of stacked-rows
    experts). Where the class's conversion names each expert's tensors (one dot-separated number in
    the key, as the Hub's ``experts.{e}.gate_proj``), the writer receives and reverts one rank's part
    at a time and renumbers its keys; otherwise (a checkpoint layout that keeps the experts packed,
    or a tensor whose unsharded rows go past all experts': zero-computation experts' rows, never
    read, not kept by EP, written as zeros) it gathers all ``E`` experts at once."""

    def __init__(
        self, key: str, local: torch.Tensor, dtype: torch.dtype, state: ExpertParallelState, gathers: _WriterGathers
    ):
        self.key, self.local, self.dtype, self.gathers = key, local.contiguous(), dtype, gathers
        self.channel, self.parts = state.model.channel, state.shard.ep_size
        self.local_experts = state.shard.num_local_experts
        # rows past all experts' that EP did not keep (zero-computation experts': never read), written as zeros
        self.unread = state.unread_rows.get(key.rsplit(".", 1)[-1], 0)
        # all E experts' rows (E of them, or E times the rows per expert of stacked-rows experts)
        rows = local.shape[0] * self.parts + self.unread
        self.full = {key: torch.empty((rows, *local.shape[1:]), dtype=dtype, device="meta")}
        self.keys: list[str] = []  # the planned keys, in the order pieces() gives them
        self.renumber: Callable[[int, str], str] | None = None

    def plan(self, revert: Callable[[dict], dict]) -> dict[str, torch.Tensor]:
        whole = revert(dict(self.full))
        part = revert({self.key: torch.empty_like(self.local, dtype=self.dtype, device="meta")})
        self.renumber = None if self.unread else _renumbering(whole, part, self.parts, self.local_experts)
        if self.renumber is None:
            self.keys = list(whole)
            return whole
        self.keys = [self.renumber(rank, key) for rank in range(self.parts) for key in part]
        return {self.renumber(rank, key): tensor for rank in range(self.parts) for key, tensor in part.items()}

    def pieces(self, revert: Callable[[dict], dict]) -> Iterator[dict[str, torch.Tensor] | None]:
        """The unit's tensors, named as planned, on the writer (``None`` elsewhere): one rank's part
        at a time, or all at once."""
        if self.renumber is None:
            yield self._whole(revert)
            return
        for rank in range(self.parts):
            yield self._part(rank, revert)  # no name holds a part across the yield: one at a time

    def _part(self, rank: int, revert: Callable[[dict], dict]) -> dict[str, torch.Tensor] | None:
        part = self.gathers.part(self.channel, self.local, rank)
        if part is None:
            return None
        return {self.renumber(rank, key): tensor for key, tensor in revert({self.key: part.to(self.dtype)}).items()}

    def _whole(self, revert: Callable[[dict], dict]) -> dict[str, torch.Tensor] | None:
        gathered = self.gathers.gather_rows(self.channel, self.local)
        if gathered is None:
            return None
        gathered = torch.cat([gathered, gathered.new_zeros(self.unread, *gathered.shape[1:])])
        return revert({self.key: gathered.to(self.dtype)})


def _renumbering(whole: dict, part: dict, parts: int, local_experts: int) -> Callable[[int, str], str] | None:
    """``(rank, key) -> key``: the name in ``whole`` (the reverted tensor of all experts) of ``key``
    of ``part`` (the reverted tensor of one rank's experts, numbered from 0) when rank ``rank``'s
    experts are reverted; ``None`` unless exactly one dot-separated number in the keys counts the
    experts and renumbering every rank's part gives exactly ``whole`` (same shapes)."""
    split = [key.split(".") for key in whole]
    if len(part) * parts != len(whole) or len({len(segments) for segments in split}) != 1:
        return None
    counting = [
        i for i in range(len(split[0])) if len({s[i] for s in split}) > 1 and all(s[i].isdigit() for s in split)
    ]
    if len(counting) != 1:
        return None
    at = counting[0]

    def renumber(rank: int, key: str) -> str:
        segments = key.split(".")
        segments[at] = str(int(segments[at]) + rank * local_experts)
        return ".".join(segments)

    named = {renumber(rank, key): tensor.shape for rank in range(parts) for key, tensor in part.items()}
    return renumber if named == {key: tensor.shape for key, tensor in whole.items()} else None


class _ModuleListUnit:
    """The experts of a ``ModuleList`` (keys ``{prefix}{index}.*``), gathered to the writer with
    ``gather_object``; all ``E`` planned in global expert order in place of the local ones (experts
    of one list have the same structure)."""

    def __init__(self, state: ExpertParallelState, prefix: str, gathers: _WriterGathers):
        shard = state.shard
        self.channel, self.gathers = state.model.channel, gathers
        self.local = {
            f"{prefix}{shard.local_start + j}.{k}": v.detach()
            for j, expert in enumerate(state.local_experts)
            for k, v in expert.state_dict().items()
        }
        first = state.local_experts[0].state_dict()
        self.full = {
            f"{prefix}{e}.{k}": torch.empty_like(v, device="meta")
            for e in range(shard.num_experts)
            for k, v in first.items()
        }
        self.device = next(state.local_experts.parameters()).device
        self.keys: list[str] = []

    def placed_in(self, state_dict: dict) -> dict:
        """``state_dict`` with this list's local experts replaced by all ``E``, where the first was."""
        items, inserted = [], False
        for key, value in state_dict.items():
            if key not in self.local:
                items.append((key, value))
            elif not inserted:
                items += list(self.full.items())
                inserted = True
        return dict(items)

    def plan(self, revert: Callable[[dict], dict]) -> dict[str, torch.Tensor]:
        whole = revert(dict(self.full))
        self.keys = list(whole)
        return whole

    def pieces(self, revert: Callable[[dict], dict]) -> Iterator[dict[str, torch.Tensor] | None]:
        parts = self.gathers.gather_object(self.channel, self.local, self.device)
        yield None if parts is None else revert({k: v for part in parts for k, v in part.items()})


def _owners(
    planned: dict[str, torch.Tensor],
    units: list[_PackedUnit | _ModuleListUnit],
    revert: Callable[[dict], dict],
    stand_ins: set[int],
) -> dict[str, int]:
    """Which unit each planned key comes from. Each unit is reverted alone when written, so its keys
    there must be exactly the ones the whole dict's conversion gives it; a conversion that mixes
    several units (or experts with other weights) cannot be written unit by unit and raises, before
    anything is written. ``stand_ins``: ids of the meta tensors standing for FSDP2's DTensors."""
    owner: dict[str, int] = {}
    for index, unit in enumerate(units):
        try:
            unit_planned = unit.plan(revert)
        except ValueError as error:  # the conversion needs other tensors beside this unit's (Ernie-4.5-VL's
            # text and vision experts into one checkpoint list)
            raise NotImplementedError(
                f"epmoe: save_pretrained cannot write the experts one tensor at a time (the class's weight "
                f"conversion combines them with other tensors: {error}); save with save_original_format=False"
            ) from error
        for key, tensor in unit_planned.items():
            if key in owner or key not in planned or planned[key].shape != tensor.shape:
                raise NotImplementedError(
                    f"epmoe: save_pretrained cannot write {key!r} one experts tensor at a time (the class's weight "
                    f"conversion combines several tensors into it); save with save_original_format=False"
                )
            owner[key] = index
    stray = [
        key
        for key, tensor in planned.items()
        if tensor.device.type == "meta" and key not in owner and id(_root(tensor)) not in stand_ins
    ]
    if stray:
        raise NotImplementedError(
            f"epmoe: save_pretrained cannot attribute {stray[:4]} to one experts tensor; "
            f"save with save_original_format=False"
        )
    return owner


def _storage_id(tensor: torch.Tensor):
    """The hub's storage identity, for the planned meta tensors too: views of one meta tensor (one
    reverted experts tensor) share a storage, as their real counterparts will."""
    from huggingface_hub import get_torch_storage_id

    if tensor.device.type == "meta":
        return "meta", id(_root(tensor))
    return get_torch_storage_id(tensor)


def _storage_size(tensor: torch.Tensor) -> int:
    from huggingface_hub import get_torch_storage_size

    if tensor.device.type == "meta":
        root = _root(tensor)
        return root.numel() * root.element_size()
    return get_torch_storage_size(tensor)


def _root(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor._base is None else tensor._base


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


class _SafetensorsWriter:
    """A safetensors file written tensor by tensor: the header (every tensor's dtype, shape and byte
    range, in ``keys`` order, ``{"format": "pt"}`` metadata as transformers writes) first, then each
    tensor's bytes as it arrives, so the file never needs all its tensors in memory at once
    (``safetensors.torch.save_file`` does). Written to ``path + ".tmp"``, renamed when complete."""

    def __init__(self, path: str, keys: list[str], planned: dict[str, torch.Tensor]):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self.expected: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for key in keys:
            tensor = planned[key]
            size = tensor.numel() * tensor.element_size()
            header[key] = {
                "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + size],
            }
            self.expected.append((key, tensor.dtype, tuple(tensor.shape)))
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self.path, self.next = path, 0
        self.file = open(path + ".tmp", "wb")
        self.file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        expected_key, dtype, shape = self.expected[self.next]
        if key != expected_key or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(
                f"epmoe: {key!r} {tuple(tensor.shape)} {tensor.dtype} written where the plan has "
                f"{expected_key!r} {shape} {dtype}"
            )
        self.next += 1
        if tensor.numel():
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            self.file.write(memoryview(data.numpy()))  # numpy comes with transformers

    def write_from(self, tensors: dict[str, torch.Tensor], keys: set[str]) -> None:
        """:meth:`write` each of ``tensors`` whose key is in ``keys``, in ``tensors``' order."""
        for key, tensor in tensors.items():
            if key in keys:
                self.write(key, tensor)

    def close(self) -> None:
        if self.next != len(self.expected):
            self.abort()
            raise RuntimeError(f"epmoe: {self.path} got {self.next} of its {len(self.expected)} tensors")
        self.file.close()
        os.replace(self.path + ".tmp", self.path)

    def abort(self) -> None:
        self.file.close()
        os.remove(self.path + ".tmp")


def adapter_state_dict(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """``peft_model.state_dict()`` with every LoRA factor on expert-parallel *packed* experts (peft's
    ``target_parameters``) holding all ``E`` experts on the writer (global rank 0), for peft's
    ``save_pretrained(state_dict=...)`` (see the module docstring); other ranks get their own
    factors. LoRA on ``nn.ModuleList`` experts' Linears and LoRA biases are not gathered (they stay
    each rank's). Collective: every rank calls it."""
    with own_state_dict():
        out = peft_model.state_dict()
    out = {
        key: value.full_tensor() if isinstance(value, DTensor) else value  # FSDP2 shards, in key order
        for key, value in out.items()
    }
    gathers = _WriterGathers()
    for name, module, state in expert_lora_wrappers(peft_model):
        if not gathers.joins(state.model.channel):
            continue
        for factor, adapter, linear in factor_weights(module):
            parts = gathers.gather(state.model.channel, linear.weight.detach().contiguous())
            if parts is not None:
                out[f"{name}.{factor}.{adapter}.weight"] = cat_factor(factor, parts, module.num_experts)
    return out


def whole_state_dict(model: nn.Module, keep: Callable[[str], bool] = lambda key: True) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` (the keys ``keep`` keeps) as the unsharded model's, on the writer (global
    rank 0): FSDP2's DTensors whole, and every expert-sharded tensor, base experts and the LoRA
    factors on them, joined from every EP rank by its :class:`~epmoe.ep.shard_mark.ShardMark` (the
    rows no expert reads, zero-computation experts', as zeros, as ``save_pretrained`` writes them;
    ``ValueError`` on the writer where a join is not of the mark's shape). Other ranks get their own
    tensors. For a framework's save that writes a state dict itself (twinkle's adapter saves).
    Collective: every rank calls it, with the same ``keep``."""
    expert_parameters(model)  # settles LoRA factors and marks every expert parameter's owner
    with own_state_dict():
        local = model.state_dict(keep_vars=True)
    gathers, out = _WriterGathers(), {}
    for key, tensor in local.items():
        if not keep(key):
            continue
        value, shard_mark = tensor.detach(), mark_of(tensor)
        if isinstance(value, DTensor):
            out[key] = value.full_tensor()
            continue
        channel = expert_owner(tensor).channel if shard_mark is not None else None
        parts = gathers.gather(channel, value.contiguous()) if gathers.joins(channel) else None
        out[key] = value if parts is None else _joined(key, shard_mark, parts)
    return out


def _joined(key: str, shard_mark: ShardMark, parts: list[torch.Tensor]) -> torch.Tensor:
    """``shard_mark.join(parts)``; ``ValueError`` naming ``key`` and both shapes unless it is of the
    mark's ``global_shape`` (never a tensor of another shape in the state dict)."""
    whole = shard_mark.join(parts)
    if tuple(whole.shape) != tuple(shard_mark.global_shape):
        raise ValueError(
            f"whole_state_dict(model): {key} joined from every EP rank is {tuple(whole.shape)}, its ShardMark "
            f"says the unsharded tensor is {tuple(shard_mark.global_shape)}"
        )
    return whole


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
        return self._run(
            channel, local.device, lambda: dist.gather(local, parts, dst=WRITER, group=channel.group), parts
        )

    def gather_rows(self, channel: StepChannel, local: torch.Tensor) -> torch.Tensor | None:
        """Every EP rank's ``local`` rows in rank order, as one tensor on the writer (received in
        place: no second copy), ``None`` elsewhere."""
        full = None
        if self.rank == WRITER:
            full = local.new_empty((channel.size * local.shape[0], *local.shape[1:]))
        parts = list(full.chunk(channel.size)) if full is not None else None
        self._run(channel, local.device, lambda: dist.gather(local, parts, dst=WRITER, group=channel.group), parts)
        return full

    def part(self, channel: StepChannel, local: torch.Tensor, ep_rank: int) -> torch.Tensor | None:
        """EP rank ``ep_rank``'s ``local`` on the writer (``None`` elsewhere): the writer holds one
        rank's part at a time. Every EP rank calls it for each ``ep_rank`` in turn."""
        self._start(channel, local.device)
        source = dist.get_process_group_ranks(channel.group)[ep_rank]
        if self.rank == WRITER:
            if source == WRITER:
                return local
            part = torch.empty_like(local)
            self._run(channel, local.device, lambda: dist.recv(part, src=source, group=channel.group), None)
            return part
        if source == self.rank:
            self._run(channel, local.device, lambda: dist.send(local, dst=WRITER, group=channel.group), None)
        return None

    def gather_object(self, channel: StepChannel, obj, device: torch.device) -> list | None:
        parts = [None] * channel.size if self.rank == WRITER else None
        return self._run(
            channel, device, lambda: dist.gather_object(obj, parts, dst=WRITER, group=channel.group), parts
        )

    def _start(self, channel: StepChannel, device: torch.device) -> None:
        """The step header opening this save on ``channel``, once, before its first transfer."""
        if id(channel) not in self.started:
            self.started[id(channel)] = _start_save(channel, device)

    def _run(self, channel, device, collective, parts):
        self._start(channel, device)
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
