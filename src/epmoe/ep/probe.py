"""Probes: running a module's own forward on a few fixed rows to learn what it computes.

Recognition (:mod:`epmoe.ep.recognize`) reads an experts module's structure; where the structure
alone cannot tell, it asks the module's own forward here, against a reference it gives:

* which layout packed experts without transformers' flags have, and which of stacked-rows experts'
  tensors is the gate, the up and the down projection (:func:`forward_agrees`);
* whether the ids past the experts with weights are zero-computation experts
  (:func:`zero_experts_are_identity`);
* whether an expert of ``nn.Linear`` layers computes the gated MLP and nothing else
  (:func:`computes_triple`, once per expert).

Every probe runs without autograd, in the module's training mode, with the RNG state restored
(:func:`probing`), on fixed rows (:func:`probe_rows`), and compares up to rounding (:func:`close`).
:mod:`epmoe.ep.contract` (whether a decorated class's forward keeps the experts contract, on random
stand-in weights) and :mod:`epmoe.integrations.input_weighted` (a block's forward) run their probes
in :func:`probing` too.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn


@contextlib.contextmanager
def probing(device: torch.device) -> Iterator[None]:
    """A probe's block: no autograd, and the RNG state (the CPU's, and ``device``'s on CUDA) restored
    after it, so that dropout or jitter in the probed forward leaves no trace."""
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield


def probe_rows(rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """``(rows, width)`` evenly spread over ``[-1, 1]``, in ``like``'s dtype and on its device."""
    return torch.linspace(-1.0, 1.0, rows * width, device=like.device).view(rows, width).to(like.dtype)


def top_two(
    first_R: torch.Tensor, second_R: torch.Tensor, weight: float | torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_k_index (R, 2), top_k_weights (R, 2))`` of a probe, weights in ``dtype``: each row's
    ``first_R`` expert with ``weight``, its ``second_R`` with weight 0."""
    weights = torch.zeros(first_R.shape[0], 2, dtype=dtype, device=first_R.device)
    weights[:, :1] = weight
    return torch.stack([first_R, second_R], dim=1), weights


def close(own: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether a probe's ``own`` equals ``expected`` up to rounding, relative to ``expected``'s largest
    magnitude (a probe through small weights has small outputs, which an absolute tolerance for
    16-bit floats would not tell apart)."""
    tolerance = 1e-5 if expected.dtype in (torch.float32, torch.float64) else 2e-2
    scale = expected.abs().max().clamp_min(torch.finfo(expected.dtype).tiny)
    return bool(((own.to(expected.dtype) - expected).abs().max() <= tolerance * scale).item())


def forward_agrees(
    module: nn.Module,
    num: int,
    hidden: int,
    weight: torch.Tensor,
    dense: bool,
    reference: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> bool:
    """Whether ``module``'s own forward equals ``reference(x, index)`` (each row ``x[r]`` through
    expert ``index[r]``), on a probe of two rows per expert (``num`` experts, ``hidden`` wide, in
    ``weight``'s dtype and device): called with the contract (each row's expert with weight 1 and
    another with weight 0: some forwards need ``K > 1``), or, for experts that take every token
    (``dense``), on the rows expert-major. The reference runs after the module's forward, inside the
    probe; a forward or reference that cannot run it does not agree."""
    x = probe_rows(2 * num, hidden, weight)
    index = torch.arange(2 * num, device=weight.device)
    index = index // 2 if dense else index % num
    try:
        with probing(weight.device):
            own = module(x) if dense else module(x, *top_two(index, (index + 1) % num, 1.0, x.dtype))
            expected = reference(x, index)
    except Exception:  # noqa: BLE001 - a forward that cannot run this probe is not this layout
        return False
    return (
        isinstance(own, torch.Tensor)
        and own.numel() == expected.numel()  # (T, 1, H) from DBRX's: reshaped
        and close(own.reshape(expected.shape), expected)
    )


def zero_experts_are_identity(module: nn.Module, num: int, zero: int, hidden: int) -> bool:
    """Whether ``module``'s own forward returns ``w * x`` for tokens (``hidden`` wide) routed to ids
    ``[num, num+zero)`` with weight ``w`` (on a probe of two rows per id, in the module's training
    mode, the RNG state restored)."""
    up = module.down_proj
    x = probe_rows(2 * zero, hidden, up)
    index = num + torch.arange(2 * zero, device=up.device) % zero
    weights = torch.linspace(0.25, 0.75, 2 * zero, device=up.device, dtype=up.dtype).unsqueeze(1)
    try:
        with probing(up.device):
            own = module(x, *top_two(index, num + (index - num + 1) % zero, weights, x.dtype))
    except Exception:  # noqa: BLE001 - a forward that cannot run this probe has no such experts
        return False
    return isinstance(own, torch.Tensor) and own.shape == x.shape and close(own, weights * x)


_TRIPLE_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def computes_triple(expert: nn.Module, gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> bool:
    """Whether the expert's own forward is ``down(act_fn(gate(x)) * up(x))``, and nothing else.

    Having the layers is not enough: a custom expert may scale, add dropout or use other parameters
    in its forward, which running the stacked weights would silently drop. Checked once per expert
    module (cached), on two fixed rows, in the module's training mode and with the RNG state restored.
    """
    verdict = _TRIPLE_VERDICTS.get(expert)
    if verdict is None:
        weight = gate.weight
        x = probe_rows(2, gate.in_features, weight)
        with probing(weight.device):
            own = expert(x)
            expected = down(expert.act_fn(gate(x)) * up(x))
        tolerance = 1e-5 if weight.dtype in (torch.float32, torch.float64) else 2e-2
        verdict = (
            isinstance(own, torch.Tensor)
            and own.shape == expected.shape
            and torch.allclose(own, expected, rtol=tolerance, atol=tolerance)
        )
        _TRIPLE_VERDICTS[expert] = verdict
    return verdict
