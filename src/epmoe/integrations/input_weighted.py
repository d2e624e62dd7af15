"""Blocks whose experts take every token and whose routing weight scales the experts' input (Llama4).

Such a block calls its experts with every token for every expert, each row already multiplied by its
routing score (zero for the experts a token did not choose), and sums the experts' outputs::

    scores_TE, logits = block.router(x_TH)                     # the block's own router
    out_TH = shared(x_TH) + sum_e experts(x_TH * scores_TE[:, e])[rows of expert e]

Its experts are adopted packed experts that take every token
(:func:`~epmoe.ep.recognize.takes_every_token`). :func:`input_weighted_block_reason` checks, on a
probe and before anything is changed, that the block's own forward computes exactly that with the
router's top-k (the chosen scores are its ``k`` largest); :func:`input_weighted_block_forward` then
replaces the block's forward: each (token, chosen expert) pair becomes one row ``scores * x`` sent to
its expert with weight 1 (the experts module called with the contract: its forward is epmoe's
:func:`~epmoe.ep.layer.expert_parallel_forward`, and a PEFT LoRA wrapper around it runs), the ``K``
outputs of a token summed, the shared expert added as the block adds it::

    x_TH, scores_TE -> top-k -> rows_SH = scores_TK[..., None] * x_TH[:, None]   (S = T*K, token-major)
      -> experts(rows_SH, index_SK = top-k ids, weights_SK = 1) -> (T, K, H) summed over K
"""

from __future__ import annotations

import torch
from torch import nn

from epmoe.ep.probe import probe_rows, probing
from epmoe.ep.recognize import packed_mlp_rows


def _parts(block: nn.Module, experts: nn.Module) -> tuple[nn.Module | None, list[nn.Module]]:
    """``(router, other children)`` of ``block``: its ``router`` / ``gate`` child, and every child that
    is neither it nor the experts (the shared expert)."""
    children = dict(block.named_children())
    router = next((m for n, m in children.items() if n in ("router", "gate")), None)
    return router, [m for m in children.values() if m is not router and m is not experts]


def _route(block: nn.Module, router: nn.Module, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weights_TK, index_TK, logits)`` from the block's own router: the ``k`` largest of its dense scores."""
    scores_TE, logits = router(x_TH)
    k = getattr(router, "top_k", None) or block.top_k
    weights_TK, index_TK = torch.topk(scores_TE, k, dim=1)
    return weights_TK, index_TK, logits


def input_weighted_block_reason(block: nn.Module, experts: nn.Module) -> str | None:
    """Why ``block`` is not an input-weighted block around ``experts`` (see the module docstring), or
    ``None`` where its own forward computes exactly that on a probe (in its training mode, the RNG
    state restored)."""
    router, others = _parts(block, experts)
    if router is None or len(others) > 1 or not isinstance(getattr(router, "weight", None), torch.Tensor):
        return f"{type(block).__name__} has no router child with a weight, or more than one other child"
    weight = router.weight
    if weight.is_meta or any(p.is_meta for p in experts.parameters()):
        return (
            f"{type(block).__name__}'s weights are on the meta device (epmoe.from_pretrained), where its "
            f"forward cannot be checked on a probe: load the model with from_pretrained, then call "
            f"epmoe.apply_expert_parallel"
        )
    x_TH = probe_rows(6, weight.shape[1], weight)
    try:
        with probing(weight.device):
            own = block(x_TH.unsqueeze(0))
            own = own[0] if isinstance(own, tuple) else own
            weights_TK, index_TK, _ = _route(block, router, x_TH)
            rows = (weights_TK.unsqueeze(-1) * x_TH.unsqueeze(1)).reshape(-1, x_TH.shape[1])
            expected = packed_mlp_rows(experts, rows, index_TK.reshape(-1)).view(*index_TK.shape, -1).sum(1)
            for other in others:
                expected = other(x_TH) + expected
    except Exception as exc:  # noqa: BLE001 - any failure of the model's own code, reported by name
        return f"{type(block).__name__}'s forward failed on a probe: {type(exc).__name__}: {exc}"
    tolerance = 1e-5 if weight.dtype in (torch.float32, torch.float64) else 2e-2
    if own.reshape(expected.shape).allclose(expected, rtol=tolerance, atol=tolerance):
        return None
    return (
        f"{type(block).__name__}'s forward is not its shared expert plus the sum of its experts on "
        f"each token scaled by the router's top-k scores"
    )


def input_weighted_block_forward(block: nn.Module, hidden_states: torch.Tensor):
    """Drop-in for the block's ``forward(hidden_states) -> (out (T, H), router_logits)`` (see the
    module docstring); ``block.experts`` is expert-parallel."""
    experts = block.experts
    router, others = _parts(block, experts)
    x_TH = hidden_states.reshape(-1, hidden_states.shape[-1])
    weights_TK, index_TK, logits = _route(block, router, x_TH)
    rows_SH = (weights_TK.unsqueeze(-1) * x_TH.unsqueeze(1)).reshape(-1, x_TH.shape[1])
    ones_S1 = torch.ones(rows_SH.shape[0], 1, dtype=rows_SH.dtype, device=rows_SH.device)
    # through the module (its forward is epmoe's, as the contract's): a PEFT LoRA wrapper around it runs
    out_TH = experts(rows_SH, index_TK.reshape(-1, 1), ones_S1)
    out_TH = out_TH.view(*index_TK.shape, -1).sum(1)
    for other in others:
        out_TH = other(x_TH) + out_TH
    return out_TH, logits
