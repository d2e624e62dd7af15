"""epmoe as a transformers experts implementation: ``experts_implementation="epmoe"``.

transformers v5 runs every experts class decorated with ``@use_experts_implementation`` through the
function its ``ExpertsInterface`` registry names in ``config._experts_implementation`` (``"eager"``,
``"grouped_mm"``, ``"sonicmoe"``, ...). ``import epmoe`` registers :func:`epmoe_experts_forward` there
as ``"epmoe"`` (:data:`EXPERTS_IMPLEMENTATION`), so on one device, with no other code::

    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="epmoe")
    model = AutoModelForCausalLM.from_config(config, experts_implementation="epmoe")
    model.set_experts_implementation("epmoe")

run every decorated experts module through epmoe's routed MLP (the path ``apply_expert_parallel``
takes at EP 1)::

    hidden_TH, top_k_index_TK, top_k_weights_TK      from the model's own router, as for grouped_mm
      -> pairs      pair_rows: one pair per (token, k), sorted by expert, built on the device
      -> experts    LocalExperts.routed_mlp: epmoe::routed_mlp (gather, up, the module's own gate /
                    act_fn, down, weighted sum per token; keeps the tokens and the up projection's
                    output for backward), or plain autograd for experts with a post-expert norm
    out_TH  in hidden_states' dtype

The contract is grouped_mm's: the same arguments and return, the module's own flags (``has_gate``,
``has_bias``, ``is_transposed``, ``has_post_expert_norm``), gate (``_apply_gate`` / ``act_fn``) and
weights, hidden states cast to the experts' compute dtype (the weights', or the wider one the family's
own forward computes in: :meth:`~epmoe.ep.expert_weights.ExpertWeights.compute_dtype`) and the result cast back. Under transformers' own
expert parallelism (``module._is_expert_parallel``) routing choices ``>= module.num_experts`` name
another rank's experts and contribute nothing (forward or backward). A module whose class departs
from the decorated contract (tensors or flags epmoe does not know) runs only where its own decorated
forward equals epmoe's on a probe (:func:`~epmoe.ep.contract.unfaithful_reason`), else its first
forward raises ``ValueError`` naming the class and what differs. Registration goes through the
registry's public ``register``: models that do not ask for ``"epmoe"`` run as before, and
``apply_expert_parallel`` replaces these modules' forwards as it does any other's. Without
transformers (or with one that has no ``ExpertsInterface``) nothing is registered.
"""

from __future__ import annotations

import torch
from torch import nn

from epmoe.ep.contract import unfaithful_reason
from epmoe.ep.experts import LocalExperts
from epmoe.ep.recognize import is_packed_experts, num_experts_of
from epmoe.ep.routing import RowPairs, pair_rows

try:
    from transformers.integrations.moe import ExpertsInterface
except ImportError:  # transformers is an optional extra; 4.x has no experts registry
    ExpertsInterface = None

EXPERTS_IMPLEMENTATION = "epmoe"  # the name models ask for: experts_implementation="epmoe"
_ATTRIBUTE = "_epmoe_experts_implementation"  # where a module keeps its LocalExperts: read through local_experts


def epmoe_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``(T, H)``: every token's routed experts' outputs, weighted by ``top_k_weights`` and summed,
    in ``hidden_states``' dtype: transformers' experts forward contract.

    ``self``: a ``@use_experts_implementation`` experts module; ``hidden_states``: ``(T, H)`` (any
    leading shape whose rows are the tokens; the result has the same shape); ``top_k_index``,
    ``top_k_weights``: ``(T, K)``, each token's experts and routing weights (the model's router's)."""
    experts = local_experts(self)
    shape = hidden_states.shape
    x_TH = hidden_states.reshape(-1, shape[-1])
    _check_routing(self, x_TH, top_k_index, top_k_weights)
    pairs = _pairs(self, experts, top_k_index.long())  # int32 ids too, as grouped_mm takes them
    out_TH = experts.routed_mlp(x_TH, top_k_weights, pairs)  # cast there to the experts' compute dtype
    return out_TH.to(hidden_states.dtype).view(shape)


def _pairs(module: nn.Module, experts: LocalExperts, top_k_index_TK: torch.Tensor) -> RowPairs:
    """The pairs of the tokens' routing choices (:func:`~epmoe.ep.routing.pair_rows`), built on the
    device: every choice, an id outside ``[0, E)`` raising; under transformers' EP
    (``module._is_expert_parallel``) the choices of ids ``>= module.num_experts`` (other ranks'
    experts) are none: padded pairs for the routed MLP op (nothing read to the host), left out
    (their number read once) for experts run through plain autograd."""
    if not getattr(module, "_is_expert_parallel", False):
        return pair_rows(top_k_index_TK, num_experts_of(module))
    num_experts = module.num_experts
    local_TK = top_k_index_TK.masked_fill(top_k_index_TK >= num_experts, num_experts)
    if experts.lean:
        return pair_rows(local_TK, num_experts, padded=True)
    return pair_rows(local_TK, num_experts, int((local_TK < num_experts).sum()))


def local_experts(module: nn.Module) -> LocalExperts:
    """The :class:`~epmoe.ep.experts.LocalExperts` ``module`` runs through (made at its first forward
    and kept on the module, so its grouped-matmul backend is chosen once per device and dtype;
    ``copy.deepcopy`` of the model makes the copy its own). Made outside any ``torch.compile``
    trace: a compiled model's first forward breaks the graph there once (after one forward, eager
    or compiled, a forward traces whole)."""
    experts = module.__dict__.get(_ATTRIBUTE)
    return _set_up(module) if experts is None else experts


def _make_local_experts(module: nn.Module) -> LocalExperts:
    if not is_packed_experts(module):
        raise ValueError(
            f"experts_implementation={EXPERTS_IMPLEMENTATION!r}: {type(module).__name__} is not packed experts "
            f"(3-D gate_up_proj or up_proj and down_proj, with @use_experts_implementation's flags)"
        )
    reason = unfaithful_reason(module, whole=False)
    if reason is not None:
        raise ValueError(
            f"experts_implementation={EXPERTS_IMPLEMENTATION!r}: {type(module).__name__} cannot run "
            f"through epmoe: {reason}; load it with experts_implementation='eager'"
        )
    experts = LocalExperts(module)
    module.__dict__[_ATTRIBUTE] = experts
    return experts


_set_up = torch.compiler.disable(
    _make_local_experts,
    reason="epmoe's experts implementation sets each experts module up at its first forward: "
    "run one forward before torch.compile(fullgraph=True)",
)


def _check_routing(
    module: nn.Module, x_TH: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> None:
    """``ValueError`` / ``TypeError`` naming the argument for routing that does not fit ``x_TH``."""
    name = type(module).__name__
    if top_k_index.dim() != 2 or top_k_index.shape[0] != x_TH.shape[0]:
        raise ValueError(
            f"{name}: expected top_k_index of shape (T, K) with T={x_TH.shape[0]}, got {tuple(top_k_index.shape)}"
        )
    if top_k_index.dtype.is_floating_point or top_k_index.dtype.is_complex or top_k_index.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer top_k_index, got {top_k_index.dtype}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"{name}: expected top_k_weights of top_k_index's shape {tuple(top_k_index.shape)}, "
            f"got {tuple(top_k_weights.shape)}"
        )


def register() -> bool:
    """Register :func:`epmoe_experts_forward` as ``"epmoe"`` in transformers' ``ExpertsInterface``
    (every instance sees it, models that ask for another name are untouched); ``False`` where
    transformers or its registry is missing. ``import epmoe`` calls it."""
    if ExpertsInterface is None:
        return False
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, epmoe_experts_forward)
    return True
