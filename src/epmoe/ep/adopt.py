"""Finding a model's experts modules, and adopting those without transformers' decorator.

:func:`find_experts_modules` walks a model by structure (:mod:`epmoe.ep.recognize` says what each
kind of experts module is). Packed experts without the decorator are *adopted*
(:func:`adopt_packed_experts`): the layout the decorator would have declared is inferred from the
shapes and kept only where the module's own forward computes it on a probe; stacked-rows experts
(DBRX's) are adopted through their holder (:func:`adopt_stacked_experts`), the one assignment of
their tensors' roles and layouts that the module's own forward agrees with. Either gets the
decorator's flags as instance attributes (:func:`_set_flags`), which its own forward does not read.
"""

from __future__ import annotations

import itertools
import types

import torch
from torch import nn

from epmoe.ep.probe import forward_agrees, zero_experts_are_identity
from epmoe.ep.recognize import (
    ADOPTED_TRANSPOSED,
    EXPERTS_CONTRACT,
    StackedRows,
    forward_signature,
    is_packed_experts,
    packed_mlp_rows,
    stacked_rows,
)


def find_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """``(name, experts module, module whose forward epmoe replaces)``, in ``named_modules()`` order.

    Packed (transformers v5) experts replace their own forward, adopted ones too (this sets their
    flags: :func:`adopt_packed_experts`); stacked-rows experts are their holder, and the module
    around it replaces its forward by the holder's (:func:`adopt_stacked_experts`); an
    ``nn.ModuleList`` named ``experts`` whose parent block has a ``gate`` or ``router`` module
    replaces the parent's.
    """
    modules = dict(model.named_modules())
    found, holders = [], set()
    for name, module in modules.items():
        if id(module) in holders:
            continue
        stacked = None if is_packed_experts(module) else adopt_stacked_experts(module)
        if stacked is not None:
            holder_name, holder = stacked
            found.append((f"{name}.{holder_name}" if name else holder_name, holder, module))
            holders.add(id(holder))
        elif is_packed_experts(module) or adopt_packed_experts(module):
            found.append((name, module, module))
        elif isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "experts" and len(module):
            parent = modules[name.rsplit(".", 1)[0]] if "." in name else model
            if any(isinstance(getattr(parent, attr, None), nn.Module) for attr in ("gate", "router")):
                found.append((name, module, parent))
    return found


_ADOPTED_FLAGS = ("has_gate", "has_bias", ADOPTED_TRANSPOSED, "is_concatenated", "has_post_expert_norm")


def adopt_packed_experts(module: nn.Module) -> bool:
    """Whether ``module`` is packed experts without transformers' decorator whose layout epmoe could
    infer and check (see the module docstring); if so, give it the decorator's flags (instance
    attributes its own forward does not read) and, where its class has none, transformers' default
    gate as ``_apply_gate``. Weights on the meta device cannot be probed: only a layout the shapes
    alone decide is taken then (and no zero-computation experts)."""
    dense = forward_signature(module) == ("hidden_states",)
    if is_packed_experts(module) or (forward_signature(module) != EXPERTS_CONTRACT and not dense):
        return False
    params = dict(module.named_parameters(recurse=False))
    up_name = "gate_up_proj" if "gate_up_proj" in params else "up_proj"
    up, down = params.get(up_name), params.get("down_proj")
    if up is None or down is None or up.dim() != 3 or down.dim() != 3:
        return False
    num, zero = down.shape[0], up.shape[0] - down.shape[0]  # zero > 0: zero-computation experts (LongCat-Flash's, 5.24)
    if zero < 0:
        return False
    has_bias = f"{up_name}_bias" in params and "down_proj_bias" in params
    if set(params) - {up_name, "down_proj"} - ({f"{up_name}_bias", "down_proj_bias"} if has_bias else set()):
        return False  # other weights its forward may use
    layouts = [t for t in (False, True) if _layout_fits(up, down, t, up_name == "gate_up_proj")]
    own_gate = "_apply_gate" in {n for cls in type(module).__mro__ for n in vars(cls)}
    if any(p.is_meta for p in params.values()):
        layouts = layouts if len(layouts) == 1 and not zero else []
    else:
        layouts = [t for t in layouts if _computes_layout(module, up_name, t, has_bias, own_gate, dense, num)]
    if len(layouts) != 1 or (
        zero and (dense or not zero_experts_are_identity(module, num, zero, up.shape[1 if layouts[0] else 2]))
    ):
        return False
    _set_flags(module, up_name == "gate_up_proj", has_bias, layouts[0], own_gate)
    module._epmoe_adopted = "every token" if dense else "contract"  # an attribute: copies keep it
    if zero:
        module._epmoe_zero_experts = zero
    return True


def adopt_stacked_experts(module: nn.Module) -> tuple[str, nn.Module] | None:
    """``(child name, holder)`` where ``module`` (the experts contract, a ``num_experts``, no weights of
    its own) holds stacked-rows experts in its one child with weights, three 2-D tensors of ``E``
    experts' rows, that its own forward computes as a gated MLP under exactly one assignment of the
    tensors' roles and layouts (and of the holder's parameter-free children as the activation), on a
    probe; the holder then gets the decorator's flags (transposed layout: :func:`as_packed`), its
    :class:`StackedRows` and a gate. ``None`` otherwise, and for weights on the meta device."""
    num = getattr(module, "num_experts", None)
    children = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
    if (
        forward_signature(module) != EXPERTS_CONTRACT
        or not isinstance(num, int)
        or num < 1
        or len(children) != 1
        or any(True for _ in module.parameters(recurse=False))
    ):
        return None
    holder_name, holder = children[0]
    if stacked_rows(holder) is not None:  # adopted before (its weights may be sharded since)
        return holder_name, holder
    params = dict(holder.named_parameters())
    if len(params) != 3 or any(p.dim() != 2 or p.shape[0] % num or p.is_meta for p in params.values()):
        return None
    acts = [n for n, c in holder.named_children() if not any(True for _ in c.parameters())]
    fits = [layout for layout in _stacked_layouts(params, num, acts) if _computes_stacked(module, holder, layout, num)]
    if len(fits) != 1:
        return None
    _set_stacked(holder, fits[0])
    holder._epmoe_adopted = "contract"
    return holder_name, holder


def _stacked_layouts(params: dict[str, torch.Tensor], num: int, acts: list[str]) -> list[StackedRows]:
    """Every assignment of ``params`` to gate / up / down, with each one's block layout, whose
    shapes fit a gated MLP: gate and up ``(H, I)``, down ``(I, H)`` read as ``(in, out)``."""
    out = []
    for names in itertools.permutations(params):
        for transposed in itertools.product((False, True), repeat=3):
            blocks = [(params[n].shape[0] // num, params[n].shape[1]) for n in names]
            in_out = [block if t else block[::-1] for block, t in zip(blocks, transposed)]
            if in_out[0] == in_out[1] == in_out[2][::-1]:
                out += [StackedRows(names, tuple(b[0] for b in blocks), transposed, act) for act in acts]
    return out


def _set_stacked(holder: nn.Module, layout: StackedRows) -> None:
    _set_flags(holder, True, False, True, True)
    holder._epmoe_stacked = layout
    holder._apply_gate = types.MethodType(_stacked_gate, holder)


def _stacked_gate(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The stacked-rows experts' gate: their activation of the gate half of ``h`` times the up half."""
    gate, up = h.chunk(2, dim=-1)
    return getattr(module, stacked_rows(module).act)(gate) * up


def _layout_fits(up: torch.Tensor, down: torch.Tensor, transposed: bool, gated: bool) -> bool:
    """Whether ``up`` ``(E, H, n*I)`` / ``down`` ``(E, I, H)`` (transposed) or ``(E, n*I, H)`` /
    ``(E, H, I)`` (the ``nn.Linear`` layout) fit together, ``n`` 2 with a gate."""
    if transposed:
        (hidden, up_out), (inner, out) = up.shape[1:], down.shape[1:]
    else:
        (up_out, hidden), (out, inner) = up.shape[1:], down.shape[1:]
    return out == hidden and up_out == inner * (2 if gated else 1)


def _set_flags(module: nn.Module, has_gate: bool, has_bias: bool, transposed: bool, own_gate: bool) -> None:
    for flag, value in zip(_ADOPTED_FLAGS, (has_gate, has_bias, transposed, True, False)):
        setattr(module, flag, value)
    if has_gate and not own_gate:
        module._apply_gate = types.MethodType(_default_gate, module)


def _default_gate(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """transformers' default gate: ``act_fn`` of the first half of ``h`` times the second."""
    gate, up = h.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def _computes_layout(
    module: nn.Module, up_name: str, transposed: bool, has_bias: bool, own_gate: bool, dense: bool, num: int
) -> bool:
    """Whether ``module``'s own forward equals the packed MLP of that layout (:func:`_agrees`);
    ``num``: the experts with weights."""
    up = getattr(module, up_name)
    return _agrees(
        module,
        module,
        lambda: _set_flags(module, up_name == "gate_up_proj", has_bias, transposed, own_gate),
        num,
        up.shape[1 if transposed else 2],
        up,
        dense,
    )


def _computes_stacked(module: nn.Module, holder: nn.Module, layout: StackedRows, num: int) -> bool:
    """Whether ``module``'s own forward equals the packed MLP of its holder read as ``layout``."""
    gate = holder.get_parameter(layout.names[0])
    hidden = layout.rows[0] if layout.transposed[0] else gate.shape[1]
    return _agrees(module, holder, lambda: _set_stacked(holder, layout), num, hidden, gate, False)


_PROBE_ATTRIBUTES = _ADOPTED_FLAGS + ("_apply_gate", "_epmoe_stacked")


def _agrees(
    module: nn.Module, holder: nn.Module, set_flags, num: int, hidden: int, weight: torch.Tensor, dense: bool
) -> bool:
    """Whether ``module``'s own forward equals the packed MLP (:func:`packed_mlp_rows`) of ``holder``
    with the flags ``set_flags()`` gives it, on a probe (:func:`~epmoe.ep.probe.forward_agrees`:
    ``num`` experts, ``hidden`` wide, in ``weight``'s dtype and device; ``dense``: experts that take
    every token); the flags are removed again."""
    saved = {flag: vars(holder)[flag] for flag in _PROBE_ATTRIBUTES if flag in vars(holder)}

    def expected(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        set_flags()
        return packed_mlp_rows(holder, x, index)

    try:
        return forward_agrees(module, num, hidden, weight, dense, expected)
    finally:
        for flag in _PROBE_ATTRIBUTES:
            vars(holder).pop(flag, None)
        vars(holder).update(saved)
