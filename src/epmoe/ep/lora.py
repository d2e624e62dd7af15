"""PEFT LoRA on sharded packed experts starts from the unsharded model's factors, on every peft.

peft's ``ParamWrapper`` (``LoraConfig(target_parameters=[...])``) sizes its factors from the targeted
parameter's shape. peft >= 0.21 reads it as ``getattr(param, "ds_shape", param.shape)``: ``ds_shape``
is DeepSpeed ZeRO-3's "whole shape of a partitioned parameter", and an EP shard is exactly that, a
partition of the ``(E, ...)`` experts tensor. :func:`mark_full_shapes` gives every 3-D packed experts
parameter EP sharded its unsharded shape as ``ds_shape`` (its :class:`~epmoe.ep.shard_mark.ShardMark`'s
``global_shape``: ``(E, ...)``, or ``(E+Z, ...)`` with ``Z`` zero-computation experts' never-read
rows), so ``get_peft_model`` builds and initialises the factors of all ``E`` experts on every rank,
drawing from the RNG exactly what it draws for the unsharded model: with the same seed every rank holds the unsharded model's factors, and every LoRA
factor drawn after them (later layers' experts, anything drawn after ``get_peft_model``) is the
unsharded model's too. Older peft (0.17 - 0.20) reads ``param.shape`` only: inside
:func:`whole_experts_for_peft` each such parameter stands in as a tensor of all ``E`` experts (a
stride-0 view of one element: no memory), so any peft builds the same factors;
:func:`epmoe.prepare_twinkle` adds twinkle's adapters that way. A wrapper that peft sized from a
shard (older peft called outside that context, or an adapter added to a wrapper after it settled)
cannot start from the unsharded model's factors: it is refused by name (:func:`refuse_unsupported`),
never trained from another start.

Each wrapper then keeps only its rank's experts (:func:`settle_expert_lora`: the same
``nn.Parameter`` objects, ``.data`` narrowed, ``num_experts`` set to ``e``)::

    lora_A (r*E, in)  expert-major   rows of experts [start, end)          -> (r*e, in)
    lora_B (out, r*E) expert-minor   viewed (out, r, E), [:, :, start:end]  -> (out, r*e)

peft offers no hook after it initialises a wrapper, so this runs at the first of: a forward of the
block around the experts (a forward pre-hook installed by :func:`install_settle_hook`, before peft's
wrapper registers its parametrization), and every epmoe function that reads expert parameters or
LoRA factors (:func:`epmoe.expert_parameters`, and through it DDP's start-up, ``fully_shard``'s
``ignored_params``, :func:`epmoe.parameter_counts`, :func:`epmoe.prepare_deepspeed`; checkpoints and
``prepare_trainer`` through :func:`epmoe.integrations.peft.expert_lora_wrappers`). Until then the
wrapper holds all ``E`` experts' factors (peft's ``print_trainable_parameters`` counts them). An
adapter loaded with ``PeftModel.from_pretrained`` before that point is the unsharded adapter, read
whole and then narrowed the same way. Each settled factor carries the mark of what it is
(:mod:`epmoe.ep.shard_mark`).

Not covered: LoRA on ``nn.ModuleList`` experts' Linears (only the local experts have Linears to wrap),
and a ``copy.deepcopy`` of an EP model (``nn.Parameter`` copies drop attributes, ``ds_shape`` included).
Refused (:func:`refuse_unsupported`): LoRA on stacked-rows experts, on sharded per-expert tensors that
are not 3-D (biases), on sharded experts beside zero-computation experts, and factors sized from a
shard.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
from collections.abc import Iterator

import torch
from torch import nn

from epmoe.ep.recognize import expert_rows, peft_base, set_parameter, stacked_rows, zero_experts
from epmoe.ep.shard_mark import ShardMark, mark, mark_of
from epmoe.ep.state import ExpertParallelState, sharded_experts, state_of

FULL_SHAPE = "ds_shape"  # the attribute peft >= 0.21 reads for a partitioned parameter's whole shape
SETTLED = "_epmoe_settled"  # on a wrapper: the adapters epmoe narrowed to this rank's experts


def mark_full_shapes(model: nn.Module) -> None:
    """Give every packed experts parameter EP sharded its :class:`~epmoe.ep.shard_mark.ShardMark`,
    read from the experts' row layout: :func:`~epmoe.ep.recognize.expert_rows`' rows per expert, and
    the rows past all experts' that sharding dropped (``ExpertParallelState.unread_rows``:
    zero-computation experts', never read); and every 3-D one its mark's whole shape as ``ds_shape``."""
    for _, module, state in sharded_experts(model, packed_only=True):
        shard, rows = state.shard, dict(expert_rows(module))
        for name in state.sharded_names:
            param, unread = module.get_parameter(name), state.unread_rows.get(name, 0)
            whole = (shard.num_experts * rows[name] + unread, *param.shape[1:])
            shard_mark = ShardMark(
                whole, 0, None, shard.local_start, shard.local_end, shard.num_experts, rows[name], unread
            )
            mark(param, shard_mark)
            if param.dim() == 3:
                setattr(param, FULL_SHAPE, torch.Size(whole))


def clear_full_shapes(model: nn.Module) -> None:
    """Remove the ``ds_shape`` :func:`mark_full_shapes` set (for wrappers that take it for ZeRO-3's)."""
    for _, module, state in sharded_experts(model, packed_only=True):
        for param in state.sharded_params(module):
            if FULL_SHAPE in param.__dict__:
                delattr(param, FULL_SHAPE)


@contextlib.contextmanager
def whole_experts_for_peft(model: nn.Module) -> Iterator[None]:
    """While peft builds LoRA wrappers on ``model`` (``get_peft_model``, ``add_adapter``,
    ``PeftModel.from_pretrained``): every 3-D packed experts parameter EP sharded stands in as the
    unsharded tensor (its mark's global shape; one element expanded: no memory), so peft of any version sizes and
    draws the unsharded model's factors. The parameters are back on exit, with the
    ``requires_grad`` peft gave their stand-ins, and the new wrappers settled. Initialisations that
    read the base weights (PiSSA, OLoRA, CorDA, LoftQ...) would read the stand-in: refused by the caller."""
    swapped, settled = [], []
    for _, module, state in sharded_experts(model, packed_only=True):
        for name in state.sharded_names:  # dotted where a per-expert post module holds it
            param = module.get_parameter(name)
            if param.dim() == 3:
                whole = param.detach().reshape(-1)[:1].expand(mark_of(param).global_shape)
                set_parameter(module, name, nn.Parameter(whole, requires_grad=param.requires_grad))
                swapped.append((module, name, param))
    for wrapper in model.modules():  # a wrapper peft adds an adapter to sizes it from its num_experts
        state = state_of(peft_base(wrapper)) if SETTLED in wrapper.__dict__ else None
        if state is not None:
            wrapper.num_experts = state.shard.num_experts
            settled.append(wrapper)
    try:
        yield
    finally:
        for module, name, param in swapped:
            param.requires_grad_(module.get_parameter(name).requires_grad)
            set_parameter(module, name, param)
        for wrapper in settled:
            if set(wrapper.lora_A) <= wrapper.__dict__[SETTLED]:  # nothing added: back as it was
                wrapper.num_experts = state_of(peft_base(wrapper)).shard.num_local_experts
    settle_expert_lora(model)


def settle_expert_lora(model: nn.Module) -> None:
    """Narrow every PEFT LoRA wrapper of ``model`` that holds factors for all ``E`` experts of sharded
    packed experts to this rank's experts (see the module docstring). Idempotent, local (no collective).
    Raises ``ValueError`` for a wrapper epmoe cannot run (:func:`refuse_unsupported`)."""
    for module in model.modules():
        refuse_unsupported(module)
        state = _unsettled(module)
        if state is not None:
            _narrow(module, state)


def install_settle_hook(block: nn.Module, attribute: str) -> None:
    """Settle the LoRA wrappers around ``block.<attribute>`` (the experts) before each forward of ``block``."""
    block.register_forward_pre_hook(functools.partial(_settle_before_forward, attribute))


def _settle_before_forward(attribute: str, block: nn.Module, args) -> None:
    module = block._modules.get(attribute)
    while module is not None and hasattr(module, "lora_A"):  # peft nests one wrapper per adapted parameter
        refuse_unsupported(module)
        if _unsettled(module) is not None:
            _settle_now(module)
            return
        module = getattr(module, "base_layer", None)


def refuse_unsupported(module: nn.Module) -> None:
    """``ValueError`` if ``module`` is a PEFT LoRA wrapper of experts epmoe cannot give LoRA exactly:
    stacked-rows experts (DBRX's ``w1`` / ``v1`` / ``w2``, each expert's rows in one 2-D tensor: factors
    spanning every expert, which expert parallelism splits, and the module around the holder calls
    epmoe's forward, not the wrapper, whose LoRA would be left out), sharded per-expert tensors that
    are not 3-D (GPT-OSS's ``(E, out)`` biases: peft lays a 2-D tensor's factors out as one matrix's,
    spanning every expert), and sharded experts beside zero-computation experts (LongCat-Flash's in transformers 5.24: peft
    lays the factors out over every row of ``gate_up_proj``, the zero experts' never-read rows
    included, which a shard does not keep: epmoe neither narrows nor saves factors laid out so)."""
    base = peft_base(module)
    state = state_of(base) if base is not None else None
    if state is None:
        return
    layout = stacked_rows(base)
    param = getattr(base, getattr(module, "parameter_name", ""), None)  # the one this wrapper adapts
    if layout is not None:
        what = f"stacked-rows expert weights ({', '.join(layout.names)}: every expert's rows in one 2-D tensor)"
        why = (
            "its factors span every expert, which expert parallelism splits (the family's own forward does "
            "not run such a wrapper either)"
        )
    elif state.shard.ep_size > 1 and isinstance(param, torch.Tensor) and param.dim() != 3:
        what = f"the per-expert {module.parameter_name} ({param.dim()}-D)"
        why = "peft lays its factors out as for one matrix spanning every expert, which expert parallelism splits"
    elif sized_from_shard(module, state):
        raise ValueError(
            f"epmoe: {state.shard.module_name}: peft {_peft_version()} sized the LoRA factors of "
            f"{module.parameter_name} from this rank's shard ({state.shard.num_local_experts} of "
            f"{state.shard.num_experts} experts), so they do not start from the unsharded model's factors. Use peft "
            ">= 0.21 (it reads the whole shape epmoe marks), or add the adapter inside "
            "epmoe.ep.lora.whole_experts_for_peft(model) (epmoe.prepare_twinkle does), before the first forward"
        )
    elif zero_experts(base) and state.shard.ep_size > 1:
        what = "experts beside zero-computation experts"
        why = (
            "peft lays the factors out over the zero experts' never-read rows too, which a shard does not "
            "keep: epmoe neither narrows nor saves factors laid out so"
        )
    else:
        return
    raise ValueError(
        f"epmoe: {state.shard.module_name}: PEFT LoRA on {what} is not supported: {why}. Leave these "
        "weights out of target_parameters (LoRA on attention and other Linears works)"
    )


def sized_from_shard(wrapper: nn.Module, state: ExpertParallelState) -> bool:
    """Whether peft sized one of ``wrapper``'s adapters from the local shard: it says it holds this
    rank's ``e`` experts, but epmoe never narrowed that adapter from all ``E``."""
    if state.shard.ep_size == 1 or isinstance(state.local_experts, nn.ModuleList):
        return False
    if getattr(wrapper, "num_experts", None) != state.shard.num_local_experts:
        return False
    return not set(wrapper.lora_A) <= wrapper.__dict__.get(SETTLED, set())


def _peft_version() -> str:
    return importlib.metadata.version("peft")


@torch.compiler.disable
def _settle_now(wrapper: nn.Module) -> None:
    settle_expert_lora(wrapper)


def _unsettled(module: nn.Module) -> ExpertParallelState | None:
    """The EP state of the experts ``module`` wraps, if ``module`` is a LoRA wrapper still holding
    factors for all ``E`` of their sharded experts."""
    state = state_of(peft_base(module))
    if state is None or state.shard.ep_size == 1 or isinstance(state.local_experts, nn.ModuleList):
        return None
    return state if getattr(module, "num_experts", None) == state.shard.num_experts else None


def _narrow(wrapper: nn.Module, state: ExpertParallelState) -> None:
    """Narrow the adapters of ``wrapper`` not narrowed yet (all ``E`` experts' factors) to this rank's."""
    shard = state.shard
    E, e, start, end = shard.num_experts, shard.num_local_experts, shard.local_start, shard.local_end
    done = wrapper.__dict__.get(SETTLED, set())
    for adapter, linear in wrapper.lora_A.items():  # (r*E, in), expert-major
        if adapter in done:
            continue
        weight = linear.weight
        _check(wrapper, shard, "lora_A", weight.shape[0], weight.shape)
        whole, rows = tuple(weight.shape), weight.shape[0] // E
        _set(weight, lambda t: t.reshape(E, rows, -1)[start:end].reshape(e * rows, -1))
        linear.out_features = e * rows
        mark(weight, ShardMark(whole, 0, None, start, end, E, rows))
    for adapter, linear in wrapper.lora_B.items():  # (out, r*E), expert-minor
        if adapter in done:
            continue
        weight = linear.weight
        _check(wrapper, shard, "lora_B", weight.shape[1], weight.shape)
        whole, out, r = tuple(weight.shape), weight.shape[0], weight.shape[1] // E
        _set(weight, lambda t: t.reshape(out, r, E)[:, :, start:end].reshape(out, r * e))
        linear.in_features = weight.shape[1]
        mark(weight, ShardMark(whole, 2, (out, r, e), start, end, E))
        if linear.bias is not None:
            raise ValueError(f"epmoe: {shard.module_name}: a LoRA bias on sharded experts is not supported")
    wrapper.num_experts = e
    wrapper.__dict__[SETTLED] = set(wrapper.lora_A)


def _check(wrapper, shard, factor: str, width: int, shape) -> None:
    if width % shard.num_experts:
        raise ValueError(
            f"epmoe: {shard.module_name}: the PEFT wrapper of {getattr(wrapper, 'parameter_name', '?')} says it holds "
            f"{shard.num_experts} experts, but its {factor} {tuple(shape)} is not a multiple of them"
        )


def _set(weight: nn.Parameter, narrow) -> None:
    """``weight.data`` (and a gradient, if any) narrowed in place of the object: optimizers and
    wrappers that already hold the parameter keep it."""
    with torch.no_grad():
        weight.data = narrow(weight.data).clone()
        if weight.grad is not None:
            weight.grad = narrow(weight.grad).clone()
