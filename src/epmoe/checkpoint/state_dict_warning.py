"""A warning where a bare ``state_dict()`` of an EP model would lose or swap experts.

``model.state_dict()`` on an EP model holds only this rank's experts, under the names the unsharded
model uses for all of them: ``torch.save`` of it on one rank writes an incomplete model, and
``dcp.save`` of it treats every rank's block as a replica of one tensor (a load then gives every
rank the same experts). Each sharded experts module carries a state-dict post-hook that warns
(:class:`ExpertStateDictWarning`, once per call site) naming what to call instead. Taken by
transformers' ``save_pretrained`` called on the class past the EP model's own, or by peft's
``save_pretrained`` of an adapter with LoRA on the experts, it raises (either would write this rank's
experts only); taken by peft's for an adapter that holds nothing of the experts, it stays silent. epmoe's own
saving paths (``save_pretrained`` of an EP model, :func:`epmoe.get_state_dict`,
:func:`epmoe.set_state_dict`) take the state dict inside :func:`own_state_dict` and do not warn.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import types
import warnings
from collections.abc import Iterator

from torch import nn

from epmoe.ep.state import state_of
from epmoe.integrations.peft import adapter_without_experts, has_expert_lora

_OWN = contextvars.ContextVar("epmoe_own_state_dict", default=False)


class ExpertStateDictWarning(UserWarning):
    """A state dict of an expert-parallel model, taken outside epmoe's checkpoint functions."""


@contextlib.contextmanager
def own_state_dict() -> Iterator[None]:
    """State dicts taken inside are epmoe's own (they are gathered or resharded): no warning."""
    token = _OWN.set(True)
    try:
        yield
    finally:
        _OWN.reset(token)


def warn_on_bare_state_dict(module: nn.Module) -> None:
    """Register the warning hook on one sharded experts module."""
    module.register_state_dict_post_hook(_warn)


def _warn(module, state_dict, prefix, local_metadata) -> None:
    if _OWN.get():
        return
    if _caller_frame(_transformers_save()) is not None:
        raise RuntimeError(
            "epmoe: transformers' save_pretrained was called past the EP model's own (on the class), which would "
            "write this rank's experts only: call model.save_pretrained(path) on every rank"
        )
    peft_save = _caller_frame(_peft_save())
    if peft_save is not None:
        peft_model = peft_save.f_locals.get("self")
        if adapter_without_experts(peft_model):
            return  # peft keeps the adapter's keys of the whole state dict: no expert among them
        if has_expert_lora(peft_model):
            raise RuntimeError(
                "epmoe: peft_model.save_pretrained(path) would write this rank's LoRA factors of the experts only: "
                "save with peft_model.save_pretrained(path, state_dict=epmoe.adapter_state_dict(peft_model), "
                "is_main_process=dist.get_rank() == 0) on every rank"
            )
    shard = state_of(module).shard
    warnings.warn(
        f"epmoe: this state_dict holds only this rank's experts of {prefix.rstrip('.') or 'the model'} "
        f"({shard.num_local_experts} of {shard.num_experts}) under the unsharded names: torch.save or dcp.save "
        f"of it would lose or swap experts. Save with model.save_pretrained(path) on every rank, or "
        f"epmoe.get_state_dict(model, optimizer) for torch.distributed.checkpoint; a PEFT adapter with "
        f"peft_model.save_pretrained(path, state_dict=epmoe.adapter_state_dict(peft_model))",
        ExpertStateDictWarning,
        stacklevel=3,
    )


def _transformers_save():
    modeling = sys.modules.get("transformers.modeling_utils")
    return None if modeling is None else modeling.PreTrainedModel.save_pretrained


def _peft_save():
    peft_model = sys.modules.get("peft.peft_model")
    return None if peft_model is None else peft_model.PeftModel.save_pretrained


def _caller_frame(function) -> types.FrameType | None:
    """The frame of ``function`` on the stack that is taking this state dict, ``None`` where it is not
    there. An EP model's own ``save_pretrained`` takes its state dict inside :func:`own_state_dict`, so
    transformers' found here was called on the class past it (and would write this rank's experts:
    under transformers 5.6 no gather hook stops it); peft's is an adapter save."""
    if function is None:
        return None
    code = function.__code__
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame
