"""Experts beside zero-computation experts (LongCat-Flash's in transformers 5.24, custom models):
routed ids past the real experts return the token.

The block's router chooses among ``E`` real experts and ``Z`` zero-computation experts (ids ``[E,
E+Z)``: :func:`~epmoe.ep.recognize.zero_experts`), which return the token times its routing weight:
no weights, nothing to compute, nothing to send. :func:`zero_experts_forward` replaces such experts'
forward: only the real choices go through the routed path, one row per (token, real expert), and
the zero experts' term is added where the token is::

    x_TH, index_TK, weights_TK                        (S = T*K slots, token-major)
      real slots s (index < E) -> rows x_TH[s // K], index (S', 1), weights (S', 1)
        -> routed_experts (dispatch, experts, combine)                   -> (S', H)
      out_TH = sum of weights_TK over zero slots * x_TH  +  routed rows summed per token (slot order)
"""

from __future__ import annotations

import torch
from torch import nn

from epmoe.ep.layer import routed_experts
from epmoe.ep.state import state_of


def zero_experts_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Drop-in for the experts' ``forward(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])``
    (see the module docstring); the sum in the wider of the hidden and routing weights' dtypes, cast
    back to the hidden dtype once."""
    state = state_of(module)
    shape = hidden_states.shape
    x_TH = hidden_states.reshape(-1, shape[-1])
    K = top_k_index.shape[-1]
    real_TK = top_k_index < state.shard.num_experts
    slot_S = torch.nonzero(real_TK.reshape(-1)).squeeze(1)
    token_S = torch.div(slot_S, K, rounding_mode="floor")
    routed_SH = routed_experts(
        state,
        x_TH[token_S],
        top_k_index.reshape(-1)[slot_S].unsqueeze(1),
        top_k_weights.reshape(-1)[slot_S].unsqueeze(1),
    )
    zero_TH = top_k_weights.masked_fill(real_TK, 0).sum(1, keepdim=True) * x_TH
    out_TH = zero_TH.index_add(0, token_S, routed_SH.to(zero_TH.dtype))
    return out_TH.to(hidden_states.dtype).view(shape)
