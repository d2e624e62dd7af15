"""Recognising experts modules: transformers v5 packed experts, ``nn.ModuleList`` experts of Linear
triples, transformers' default gate, what the fused ops can run, and PEFT wrappers around experts.

* Packed experts (classes decorated with transformers' ``@use_experts_implementation``): 3-D
  ``gate_up_proj`` (or ``up_proj`` when ``has_gate`` is false) and ``down_proj``; ``is_transposed``
  says whether they are ``(E, in, out)`` rather than the ``nn.Linear`` layout ``(E, out, in)``;
  ``has_bias`` adds ``*_proj_bias`` ``(E, out)``.
* Packed experts without the decorator (Step3p7's before transformers 5.25): a module with the decorated classes' contract,
  ``forward(hidden_states, top_k_index, top_k_weights)``, and 3-D ``gate_up_proj`` (or ``up_proj``) and
  ``down_proj`` of one leading size ``E``. epmoe infers the layout the decorator would have declared
  (``is_transposed`` from the shapes, ``has_bias`` from ``*_proj_bias``, the class's own ``_apply_gate``
  or transformers' default ``act_fn(gate) * up``) and keeps it only if the module's own forward
  computes exactly that on a probe (:func:`adopt_packed_experts`): then the module is *adopted*, given
  the decorator's flags, and runs as packed experts. Its up (or gate_up) projection may hold ``Z`` more
  experts than its down projection (LongCat-Flash's in transformers 5.24): ids ``[E, E+Z)`` are then *zero-computation
  experts*, kept only where the module's own forward returns the token times its weight for them
  (:func:`zero_experts`); EP routes the ``E`` real experts and adds their term locally
  (:mod:`epmoe.integrations.zero_experts`).
* Experts whose per-expert weights are flattened to 2-D, ``E`` experts' rows stacked (DBRX's
  ``mlp.w1`` / ``mlp.v1`` / ``mlp.w2``, each ``(E*I, H)``), in one child (the *holder*) of a module with
  the experts contract and a ``num_experts``: each tensor is read as ``(E, I, H)`` views (expert ``e``
  = rows ``[e*I, (e+1)*I)``); which is the gate, the up and the down projection, and each one's
  layout, is the one assignment the module's own forward agrees with on a probe
  (:func:`adopt_stacked_experts`). The holder is then the packed experts module EP shards (rows, the
  parameter names and their 2-D layout kept: :func:`expert_rows`) and runs (:func:`as_packed`).
* ``nn.ModuleList`` experts whose every expert holds ``gate_proj`` / ``up_proj`` / ``down_proj`` (or
  Mixtral's ``w1`` / ``w3`` / ``w2``) bias-free ``nn.Linear`` layers and one ``act_fn``, with a forward
  that computes exactly ``down(act_fn(gate(x)) * up(x))`` (checked once per expert): those run
  grouped (:mod:`epmoe.ep.experts`), any other expert on its own rows.

:func:`find_experts_modules` finds these in a model by structure, not by name.
:func:`experts_like_modules` finds every module that holds a layer's experts, whether epmoe runs it
or not; :func:`unsupported_experts` lists those it does not run, each with the reason read from its
structure (experts inside attention, experts as ``nn.Embedding`` rows, no router beside them, a
forward that is not the experts contract, weights without a per-expert layout it knows), so that
``apply_expert_parallel`` refuses them by name before changing anything.

Everything here is read from a module's structure, except where the structure alone cannot tell
(a layout without flags, stacked tensors' roles, zero-computation experts, a Linear triple's
forward): there the module's own forward is asked on a probe (:mod:`epmoe.ep.probe`), against
:func:`packed_mlp_rows` or the triple's gated MLP.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import re
import types

import torch
from torch import nn

from epmoe.ep.probe import computes_triple, forward_agrees, zero_experts_are_identity

_LINEAR_TRIPLES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def is_packed_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers v5 packed experts module (``@use_experts_implementation``),
    or packed experts epmoe adopted (:func:`adopt_packed_experts`)."""
    if not (
        hasattr(module, "has_gate")
        and hasattr(module, "has_bias")
        and (hasattr(module, "is_transposed") or ADOPTED_TRANSPOSED in vars(module))
    ):
        return False
    if stacked_rows(module) is not None:
        return True
    first = "gate_up_proj" if module.has_gate else "up_proj"
    return all(isinstance(getattr(module, name, None), torch.Tensor) for name in (first, "down_proj"))


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


_EXPERTS_CONTRACT = ("hidden_states", "top_k_index", "top_k_weights")


def experts_like_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module that holds a layer's experts, whether epmoe can run it or
    not, outermost only, in ``named_modules()`` order. Found by structure: packed experts; a module
    with weights named, or of a class named, after experts (not a shared expert, a router or gate,
    nor a single ``torch.nn`` layer such as a projection into the experts); a module with an
    ``nn.Embedding`` of one row per expert (``num_experts`` rows)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer, _ in found) or not _looks_like_experts(name, module):
            continue
        found.append((name, module))
    return found


def _looks_like_experts(name: str, module: nn.Module) -> bool:
    if is_packed_experts(module):
        return True
    if not any(p.dim() >= 2 for p in module.parameters()):  # weights, not only norms or scales
        return False
    leaf, cls = name.rsplit(".", 1)[-1].lower(), type(module).__name__.lower()
    one_layer = type(module).__module__.startswith("torch.nn") and not isinstance(
        module, (nn.ModuleList, nn.ModuleDict)
    )
    if (
        not re.search(r"shared|router|gate|gating", leaf + " " + cls)
        and not one_layer
        and ("expert" in leaf or re.search(r"experts?$", cls))
    ):
        return True
    num = getattr(module, "num_experts", None)
    return isinstance(num, int) and any(
        isinstance(child, nn.Embedding) and child.num_embeddings == num for child in module.children()
    )


def unsupported_experts(
    model: nn.Module, found: list[tuple[str, nn.Module, nn.Module]]
) -> list[tuple[str, nn.Module, str]]:
    """``(name, module, why epmoe cannot run it)`` for every experts-like module
    (:func:`experts_like_modules`) that :func:`find_experts_modules` did not recognise (``found``)."""
    recognised = {name for name, _, _ in found}
    modules = dict(model.named_modules())
    out = []
    for name, module in experts_like_modules(model):
        if name in recognised or any(name.startswith(f"{r}.") or r.startswith(f"{name}.") for r in recognised):
            continue
        out.append((name, module, _why_unsupported(model, modules, name, module)))
    return out


def _why_unsupported(model: nn.Module, modules: dict[str, nn.Module], name: str, module: nn.Module) -> str:
    """Why an experts-like module is not one epmoe runs, read from its structure."""
    parts = name.split(".")
    ancestors = [modules[".".join(parts[:i])] for i in range(len(parts))]
    config = getattr(model, "config", None)
    where = "in an encoder-decoder model, " if getattr(config, "is_encoder_decoder", False) else ""
    if any("attention" in type(a).__name__.lower() for a in ancestors[1:]) or any(
        re.search(r"attn|attention", p) for p in parts[:-1]
    ):
        return (
            f"{where}experts inside attention (a mixture of attention heads): epmoe runs experts that are "
            f"a layer's MLP, called with each token's top-k experts"
        )
    if any(isinstance(child, nn.Embedding) for child in module.children()):
        return (
            f"{where}experts are rows of nn.Embedding tables (one vector per expert, retrieved by product "
            f"keys), not per-expert MLP weights"
        )
    parent = ancestors[-1]
    if not any(re.search(r"gate|gating|router", child_name) for child_name, _ in parent.named_children()):
        return (
            f"{where}no router beside it in {type(parent).__name__} (its forward takes "
            f"{', '.join(_signature(module))}), so there is nothing to route tokens across ranks by"
        )
    params = _signature(module)
    if params != _EXPERTS_CONTRACT:
        return (
            f"{where}its forward takes ({', '.join(params)}), not the experts contract "
            f"({', '.join(_EXPERTS_CONTRACT)}) with top-k expert ids"
        )
    return _why_layout_unsupported(module, where)


def _why_layout_unsupported(module: nn.Module, where: str) -> str:
    """Why an experts module that takes the experts contract has weights epmoe cannot lay out."""
    shapes = ", ".join(f"{n} {tuple(p.shape)}" for n, p in module.named_parameters())
    leading = {n: p.shape[0] for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
    # only running its own forward tells these layouts apart, which weights on the meta device cannot
    meta = (
        (
            "{} only its own forward can tell, and its weights are on the meta device (load them, then apply "
            "expert parallelism)"
        )
        if any(p.is_meta for p in module.parameters())
        else ""
    )
    if len(set(leading.values())) > 1:
        return f"{where}its 3-D weights hold different numbers of experts ({shapes})" + (
            meta.format(": whether the ids past the experts with weights are zero-computation experts")
            or (
                ", and its own forward is not a packed MLP on the experts with weights returning the token "
                "times its weight for the ids past them (zero-computation experts)"
            )
        )
    num = getattr(module, "num_experts", None)
    if (
        not leading
        and isinstance(num, int)
        and all(p.dim() == 2 and p.shape[0] % num == 0 for p in module.parameters())
    ):
        return f"{where}expert weights flattened to 2-D, {num} experts' rows stacked ({shapes})" + (
            meta.format(": which is the gate, the up and the down projection")
            or (": no reading of them as one gated MLP's gate, up and down projections agrees with its own forward")
        )
    if leading:
        return (
            f"{where}packed experts without transformers' @use_experts_implementation flags (has_gate, "
            f"is_transposed, has_bias): the layout of {shapes} is not inferred"
        )
    return f"{where}per-expert weights in a layout epmoe does not recognise ({shapes})"


def _signature(module: nn.Module) -> tuple[str, ...]:
    """The names of ``module.forward``'s positional parameters."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


# The decorator's flags an adopted module gets; its layout flag under epmoe's own name, since other
# libraries read ``is_transposed`` where a module has it (peft lays LoRA factors out by it) and must
# see the module as it is without epmoe
ADOPTED_TRANSPOSED = "_epmoe_transposed"
_ADOPTED_FLAGS = ("has_gate", "has_bias", ADOPTED_TRANSPOSED, "is_concatenated", "has_post_expert_norm")


def weights_transposed(module: nn.Module) -> bool:
    """Whether a packed experts module's weights are laid out ``(E, in, out)`` (transformers'
    ``is_transposed``; for adopted experts, :data:`ADOPTED_TRANSPOSED`)."""
    adopted = vars(module).get(ADOPTED_TRANSPOSED)
    return module.is_transposed if adopted is None else adopted


def adopt_packed_experts(module: nn.Module) -> bool:
    """Whether ``module`` is packed experts without transformers' decorator whose layout epmoe could
    infer and check (see the module docstring); if so, give it the decorator's flags (instance
    attributes its own forward does not read) and, where its class has none, transformers' default
    gate as ``_apply_gate``. Weights on the meta device cannot be probed: only a layout the shapes
    alone decide is taken then (and no zero-computation experts)."""
    dense = _signature(module) == ("hidden_states",)
    if is_packed_experts(module) or (_signature(module) != _EXPERTS_CONTRACT and not dense):
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


def zero_experts(module: nn.Module) -> int:
    """How many zero-computation experts adopted packed experts have (ids ``[E, E+Z)`` after their
    ``E`` real ones, each returning the token times its routing weight), ``0`` for others."""
    return getattr(module, "_epmoe_zero_experts", 0)


@dataclasses.dataclass(frozen=True)
class StackedRows:
    """How stacked-rows experts hold their weights (see the module docstring): the holder's
    parameter names of the gate, up and down projections, each one's rows per expert, whether each
    expert's block of rows is ``(in, out)`` (``x @ block``) rather than ``(out, in)`` (``x @
    block.T``), and the holder's child that is the activation."""

    names: tuple[str, str, str]
    rows: tuple[int, int, int]
    transposed: tuple[bool, bool, bool]
    act: str


def stacked_rows(module: nn.Module) -> StackedRows | None:
    """The :class:`StackedRows` of an adopted holder of stacked-rows experts, else ``None``."""
    return getattr(module, "_epmoe_stacked", None)


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
        _signature(module) != _EXPERTS_CONTRACT
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


def as_packed(module: nn.Module, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A packed experts module's per-expert tensors (in :func:`packed_names` order) as the packed
    layout its flags declare: themselves (with zero-computation experts, their first ``e`` rows: the
    rows past the experts with weights are never read), or, for stacked-rows experts, ``[gate_up (e,
    H, 2I), down (e, I, H)]`` (transposed layout; ``e`` the experts held now), views of the stacked
    rows (the gate_up a concatenation: a copy)."""
    layout = stacked_rows(module)
    if layout is None:
        num = num_experts_of(module)
        return [t[:num] for t in tensors] if zero_experts(module) else tensors
    blocks = []
    for tensor, rows, transposed in zip(tensors, layout.rows, layout.transposed):
        block = tensor.view(tensor.shape[0] // rows, rows, tensor.shape[1])
        blocks.append(block if transposed else block.transpose(1, 2))
    return [torch.cat(blocks[:2], dim=2), blocks[2]]


def packed_names(module: nn.Module) -> list[str]:
    """The per-expert tensors of a packed experts module: up (or gate_up), down, and their biases;
    stacked-rows experts: their gate, up and down."""
    layout = stacked_rows(module)
    if layout is not None:
        return list(layout.names)
    up_name = "gate_up_proj" if module.has_gate else "up_proj"
    names = [up_name, "down_proj"]
    return names + [f"{name}_bias" for name in names] if module.has_bias else names


def packed_tensors(module: nn.Module) -> list[torch.Tensor]:
    """``[up, down, *biases]`` of a packed experts module in its declared layout (:func:`as_packed`)."""
    return as_packed(module, [getattr(module, name) for name in packed_names(module)])


def expert_rows(module: nn.Module) -> list[tuple[str, int]]:
    """``(name, rows per expert)`` of every per-expert tensor a packed experts module holds itself
    (what EP shards: expert ``j``'s rows ``[j*rows, (j+1)*rows)``): tensors whose leading dim is the
    number of experts (or, with zero-computation experts, that plus their number), one row each;
    stacked-rows experts' three tensors."""
    layout = stacked_rows(module)
    if layout is not None:
        return list(zip(layout.names, layout.rows))
    num, zero = num_experts_of(module), zero_experts(module)
    own = [
        (n, 1) for n, p in module.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] in (num, num + zero)
    ]
    post = per_expert_post(module)
    return own if post is None else own + [(f"{post}.{n}", 1) for n, _ in module.get_submodule(post).named_parameters()]


def per_expert_post(module: nn.Module) -> str | None:
    """The name of packed experts' *per-expert post module*, if they hold one: their one child with
    parameters, all of one row per expert, whose forward takes ``(rows, expert ids)`` (Ergo's
    ``post_expert_norm``, a learned RMSNorm scale per expert, applied to each route's output before the
    weighted sum). EP shards its parameters with the experts and runs it on each route's rows on the
    expert's rank, with local expert ids; whether the module's own forward does exactly that is
    :mod:`epmoe.ep.contract`'s probe."""
    num = num_experts_of(module)
    found = [
        name
        for name, child in module.named_children()
        if (params := list(child.parameters()))
        and all(p.dim() >= 1 and p.shape[0] == num for p in params)
        and len(_signature(child)) == 2
    ]
    return found[0] if len(found) == 1 and not getattr(module, "has_post_expert_norm", False) else None


def set_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """``module``'s parameter ``name`` (dotted: a submodule's) set to ``param``."""
    owner, _, attr = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, attr, param)


def takes_every_token(module: nn.Module) -> bool:
    """Whether adopted experts were written to be called with every token for every expert
    (``forward(hidden_states)`` on ``E * n`` rows, expert-major: Llama4's), so that their block, not
    they, must be given epmoe's forward (:mod:`epmoe.integrations.input_weighted`)."""
    return getattr(module, "_epmoe_adopted", None) == "every token"


def packed_mlp_rows(module: nn.Module, x_RH: torch.Tensor, index_R: torch.Tensor) -> torch.Tensor:
    """``(R, H)``: row ``r`` of ``x_RH`` through expert ``index_R[r]`` of packed experts ``module`` (its
    flags, its gate), one expert at a time in plain torch: the reference recognition probes with."""
    up, down, *biases = packed_tensors(module)
    out = x_RH.new_zeros(x_RH.shape[0], down.shape[2] if weights_transposed(module) else down.shape[1])
    for j in index_R.unique().tolist():
        rows = index_R == j
        w_up, w_down = (up[j], down[j]) if weights_transposed(module) else (up[j].T, down[j].T)
        h = x_RH[rows] @ w_up + (biases[0][j] if module.has_bias else 0)
        a = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        out[rows] = a @ w_down + (biases[1][j] if module.has_bias else 0)
    return out


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


def num_experts_of(module: nn.Module) -> int:
    """Number of experts a packed or ``nn.ModuleList`` experts module holds now."""
    if isinstance(module, nn.ModuleList):
        return len(module)
    layout = stacked_rows(module)
    if layout is not None:
        return module.get_parameter(layout.names[2]).shape[0] // layout.rows[2]
    return module.down_proj.shape[0]


def shared_parameters(experts: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every parameter inside an experts module that is not per expert (a
    norm, scale or bias every expert's rows go through: MuseSpark's ``post_expert_norm.weight``), under
    each name it has (``named_parameters(remove_duplicate=False)``), in that order.

    Packed experts: every parameter except the per-expert tensors EP shards (:func:`expert_rows`).
    ``nn.ModuleList`` experts: the parameters more than one expert holds (look before sharding: a
    rank may keep a single expert). EP never shards these: they are replicated, like the rest of the
    model."""
    if not isinstance(experts, nn.ModuleList) and not is_packed_experts(experts):
        raise TypeError(
            f"shared_parameters(experts): expected packed or nn.ModuleList experts, got {type(experts).__name__}"
        )
    if isinstance(experts, nn.ModuleList):
        holders: dict[int, int] = {}
        for expert in experts:
            for p in {id(p): p for p in expert.parameters()}.values():
                holders[id(p)] = holders.get(id(p), 0) + 1
        return [(n, p) for n, p in experts.named_parameters(remove_duplicate=False) if holders.get(id(p), 0) > 1]
    per_expert = {id(experts.get_parameter(name)) for name, _ in expert_rows(experts)}
    return [(n, p) for n, p in experts.named_parameters(remove_duplicate=False) if id(p) not in per_expert]


def peft_base(module: nn.Module) -> nn.Module | None:
    """The innermost ``base_layer`` of a PEFT LoRA wrapper (peft nests one wrapper per adapted
    parameter), or ``None`` if ``module`` is not one."""
    base = getattr(module, "base_layer", None)
    if not isinstance(base, nn.Module) or not hasattr(module, "lora_A"):
        return None
    while isinstance(getattr(base, "base_layer", None), nn.Module):
        base = base.base_layer
    return base


def is_default_silu_gate(module: nn.Module) -> bool:
    """Whether a packed experts module gates with transformers' default SiLU gate (an NPU runs it as
    ``npu_swiglu``)."""
    gate = getattr(type(module), "_apply_gate", None)
    return (
        getattr(gate, "__name__", "") == "_default_apply_gate"
        and getattr(gate, "__module__", "") == "transformers.integrations.moe"
        and is_silu(getattr(module, "act_fn", None))
    )


def is_silu(act: object) -> bool:
    """Whether ``act`` is SiLU (torch's module or transformers' ``SiLUActivation``)."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _linear_triple(expert: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear] | None:
    """``(gate, up, down)`` if ``expert`` is bias-free Linears computing ``down(act_fn(gate(x)) * up(x))``."""
    for names in _LINEAR_TRIPLES:
        layers = [getattr(expert, name, None) for name in names]
        if all(isinstance(layer, nn.Linear) and layer.bias is None for layer in layers) and hasattr(expert, "act_fn"):
            return tuple(layers) if computes_triple(expert, *layers) else None
    return None


def linear_triples(experts: nn.ModuleList) -> list[tuple[nn.Linear, nn.Linear, nn.Linear]] | None:
    """Every expert's ``(gate, up, down)`` layers if all experts are such triples with one activation
    (then they run grouped, with ``experts[0].act_fn``), else ``None``."""
    triples = [_linear_triple(expert) for expert in experts]
    if not triples or any(t is None for t in triples):
        return None
    act = experts[0].act_fn
    same = (lambda f: type(f) is type(act)) if isinstance(act, nn.Module) else (lambda f: f is act)
    return triples if all(same(expert.act_fn) for expert in experts) else None


def fused_ineligible_reason(experts: nn.Module) -> str | None:
    """Why ``experts`` cannot run through ``alltoallv_gmm`` / ``gmm_alltoallv``, or ``None``."""
    if isinstance(experts, nn.ModuleList):
        return "nn.ModuleList experts have no packed weight for the fused ops"
    if stacked_rows(experts) is not None:
        return "stacked-rows experts have no packed gate_up weight for the fused ops (it is built each forward)"
    if zero_experts(experts):
        return "zero-computation experts: their term is added beside the routed experts, on the all-to-all-v path"
    if experts.has_bias:
        return "the down projection's bias would have to be added between the grouped matmul and the exchange"
    if getattr(experts, "has_post_expert_norm", False) or per_expert_post(experts) is not None:
        return "a post-expert norm would have to run between the grouped matmul and the exchange"
    if shared_parameters(experts):
        return (
            f"its parameters shared by every expert ({shared_parameters(experts)[0][0]}...) get their gradient "
            f"split by source rank on the all-to-all-v path only"
        )
    return None
