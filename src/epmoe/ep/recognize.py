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
  computes exactly that on a probe (:func:`epmoe.ep.adopt.adopt_packed_experts`): then the module is *adopted*, given
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
  (:func:`epmoe.ep.adopt.adopt_stacked_experts`). The holder is then the packed experts module EP shards (rows, the
  parameter names and their 2-D layout kept: :func:`expert_rows`) and runs (:func:`as_packed`).
* ``nn.ModuleList`` experts whose every expert holds ``gate_proj`` / ``up_proj`` / ``down_proj`` (or
  Mixtral's ``w1`` / ``w3`` / ``w2``) bias-free ``nn.Linear`` layers and one ``act_fn``, with a forward
  that computes exactly ``down(act_fn(gate(x)) * up(x))`` (checked once per expert): those run
  grouped (:mod:`epmoe.ep.experts`), any other expert on its own rows.

:func:`epmoe.ep.adopt.find_experts_modules` finds these in a model by structure, not by name.
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
import re

import torch
from torch import nn

from epmoe.ep.probe import computes_triple

_LINEAR_TRIPLES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def is_packed_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers v5 packed experts module (``@use_experts_implementation``),
    or packed experts epmoe adopted (:func:`epmoe.ep.adopt.adopt_packed_experts`)."""
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


EXPERTS_CONTRACT = ("hidden_states", "top_k_index", "top_k_weights")


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
            f"{', '.join(forward_signature(module))}), so there is nothing to route tokens across ranks by"
        )
    params = forward_signature(module)
    if params != EXPERTS_CONTRACT:
        return (
            f"{where}its forward takes ({', '.join(params)}), not the experts contract "
            f"({', '.join(EXPERTS_CONTRACT)}) with top-k expert ids"
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


def forward_signature(module: nn.Module) -> tuple[str, ...]:
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


def weights_transposed(module: nn.Module) -> bool:
    """Whether a packed experts module's weights are laid out ``(E, in, out)`` (transformers'
    ``is_transposed``; for adopted experts, :data:`ADOPTED_TRANSPOSED`)."""
    adopted = vars(module).get(ADOPTED_TRANSPOSED)
    return module.is_transposed if adopted is None else adopted


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
        and len(forward_signature(child)) == 2
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
