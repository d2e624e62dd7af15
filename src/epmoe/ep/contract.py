"""Whether epmoe reproduces what a transformers experts module's own forward computes.

epmoe replaces the forward of a ``@use_experts_implementation`` experts module: under expert
parallelism the whole ``forward`` of the module's class (:mod:`epmoe.ep.layer`), as
``experts_implementation="epmoe"`` the decorated class's own, undecorated one (what transformers'
registry replaces; :mod:`epmoe.integrations.transformers_experts`). What epmoe runs instead is the
decorated contract, written once (:func:`contract_rows`)::

    out_TH = sum_k  top_k_weights_TK[t, k] * post(mlp_e(x_TH[t]))      e = top_k_index_TK[t, k]
    mlp_e  = down_e(gate(up_e(x) + up_bias_e)) + down_bias_e           the flags: has_gate, has_bias,
    post   = post_expert_norm(y)          (has_post_expert_norm)        is_transposed
           | <child>(y, e)                (a per-expert post module, under EP only: Ergo's)

A class is *plain*, and trusted without a probe, where nothing in it can do more than that: its
``forward`` is the decorator's (nothing overrides it below the decorated class), the module holds
only the layout's tensors (up or gate_up, down, their biases), parameter-free submodules (its
``act_fn``) and, with ``has_post_expert_norm``, its ``post_expert_norm``, and the decorator set no
flag this module does not know. Anything else is a *departure* (:func:`departures`), and a class with
one runs only where a probe shows its own forward equal to the contract (:func:`unfaithful_reason`):

* the probe's weights: every floating parameter replaced by a random stand-in (``torch.func.
  functional_call``; the module is not changed), so that a parameter at an identity initialisation
  (a scale of ones, a bias of zeros) cannot hide what it does. A per-expert tensor's stand-in is a
  view of one expert's size (expert ``j`` starts ``j * 7`` elements further into one buffer: every
  expert differs, and a 256-expert layer costs one expert's memory), in float32, on the weights'
  device (the CPU for weights on the meta device: ``epmoe.from_pretrained`` probes before loading);
* the probe's tokens: ``2E`` tokens, each routed to ``K`` consecutive experts (every expert gets
  ``2K`` routes; ``K = min(2, E)`` with random weights under EP, ``K = 1`` with unit weights for the
  decorated forward, which transformers calls per route), row magnitudes spread from 1e-2 to 1e2 so
  that thresholds (a clamp) are crossed;
* the verdict: every token's output equal to the contract's to ``1e-4`` of its own largest
  magnitude. The module's own forward runs its ``"eager"`` experts implementation (transformers'
  reference), in its training mode, the RNG state restored.

A probe is evidence on those inputs, not a proof for all of them: a forward that departs only
beyond those magnitudes, or only on some token counts, passes it. It costs two forwards of the
module on ``2E`` tokens per module (milliseconds on the CPU for the tiny families of the tests).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
from collections.abc import Callable

import torch
from torch import nn

from epmoe.ep.probe import probing
from epmoe.ep.recognize import num_experts_of, packed_mlp_rows, packed_names, per_expert_post, weights_transposed

logger = logging.getLogger(__name__)

_KNOWN_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
_STAND_IN_STEP = 7  # elements between consecutive experts' stand-in weights in their shared buffer
_TOLERANCE = 1e-4
_MAGNITUDES = (-2.0, 2.0)  # log10 of the probe rows' smallest and largest scale


def decorated_forward(cls: type) -> Callable | None:
    """The forward ``@use_experts_implementation`` wrapped for ``cls`` or a base of it (the wrapper
    itself, its ``__wrapped__`` the class's own code), or ``None`` for a class it never decorated."""
    for base in cls.__mro__:
        forward = vars(base).get("forward")
        if forward is not None and _is_decorator_wrapper(forward):
            return forward
    return None


def _is_decorator_wrapper(forward: Callable) -> bool:
    code = getattr(forward, "__code__", None)
    return (
        hasattr(forward, "__wrapped__")
        and code is not None
        and code.co_filename.replace("\\", "/").endswith("transformers/integrations/moe.py")
    )


def departures(module: nn.Module, *, whole: bool) -> list[str]:
    """What makes ``module`` (a decorated packed experts module) not plain (see the module
    docstring), as phrases; ``[]`` for a plain one and for any module transformers did not decorate
    (epmoe's own recognition probed those when it adopted them). ``whole``: epmoe replaces the
    class's whole forward (EP), not only the decorated one."""
    decorated = decorated_forward(type(module))
    if decorated is None:
        return []
    out = []
    own = getattr(type(module), "forward", None)
    if whole and own is not decorated:
        where = next(base for base in type(module).__mro__ if "forward" in vars(base))
        out.append(f"its forward is overridden in {where.__name__}, below the decorated class")
    known = set(packed_names(module))
    if getattr(module, "has_post_expert_norm", False):
        known |= {f"post_expert_norm.{n}" for n, _ in module.post_expert_norm.named_parameters()}
    extra = [n for n, _ in module.named_parameters() if n not in known]
    extra += [n for n, _ in module.named_buffers()]
    if extra:
        out.append(f"it holds tensors the decorated layout does not ({', '.join(extra)})")
    flags = _unknown_flags(module)
    if flags:
        out.append(f"the decorator set flags epmoe does not know ({', '.join(flags)})")
    return out


def _unknown_flags(module: nn.Module) -> list[str]:
    """``name=value`` of the installed decorator's flags outside the ones epmoe runs, where this
    module's differs from the decorator's default."""
    try:
        from transformers.integrations.moe import use_experts_implementation
    except ImportError:
        return []
    out = []
    for name, param in inspect.signature(use_experts_implementation).parameters.items():
        if param.kind is param.KEYWORD_ONLY and name not in _KNOWN_FLAGS and name != "experts_interface":
            value = getattr(module, name, param.default)
            if value is not param.default and value != param.default:
                out.append(f"{name}={value!r}")
    return out


def unfaithful_reason(module: nn.Module, *, whole: bool) -> str | None:
    """Why epmoe would not compute what ``module``'s own forward computes, or ``None`` where it does:
    a plain class, or one whose departures (:func:`departures`) a probe shows make no difference (see
    the module docstring). ``whole``: under EP (the class's whole forward replaced); else as
    ``experts_implementation="epmoe"`` (the decorated forward replaced)."""
    found = departures(module, whole=whole)
    if not found:
        return None
    verdict = _probe(module, whole)
    if verdict is None:
        return None
    return f"{'; '.join(found)}, and {verdict}"


def unfaithful_experts(found: list[tuple[str, nn.Module, nn.Module]]) -> list[tuple[str, nn.Module, str]]:
    """``(name, module, why)`` of every packed experts module in ``found`` (``find_experts_modules``'s)
    whose whole forward epmoe, under EP, would not compute as the module does (:func:`unfaithful_reason`);
    a module whose departures the probe shows harmless is logged, with the probe's cost."""
    out = []
    for name, module, owner in found:
        departing = departures(module, whole=True) if owner is module else []
        if not departing:
            continue
        start = time.perf_counter()
        verdict = _probe(module, whole=True)
        if verdict is not None:
            out.append((name, module, f"{'; '.join(departing)}, and {verdict}"))
        else:
            logger.info(
                "epmoe: %s at %s departs from the decorated experts contract (%s); its own forward equals "
                "epmoe's on a probe of every expert (%.1f ms)",
                type(module).__name__,
                name,
                "; ".join(departing),
                1e3 * (time.perf_counter() - start),
            )
    return out


def contract_rows(
    module: nn.Module, x_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor, *, whole: bool
) -> torch.Tensor:
    """``(T, H)``: the decorated contract on ``module``'s weights and flags, one route at a time in
    plain torch (what epmoe runs, written as a reference; see the module docstring). ``whole``: a
    per-expert post module (:func:`~epmoe.ep.recognize.per_expert_post`) runs on each route."""
    tokens, top_k = top_k_index_TK.shape
    index_S = top_k_index_TK.reshape(-1)
    y_SH = packed_mlp_rows(module, x_TH.repeat_interleave(top_k, dim=0), index_S)
    if getattr(module, "has_post_expert_norm", False):
        y_SH = module.post_expert_norm(y_SH)
    post = per_expert_post(module) if whole else None
    if post is not None:
        y_SH = module.get_submodule(post)(y_SH, index_S)
    y_TKH = y_SH.view(tokens, top_k, -1)
    return (y_TKH * top_k_weights_TK.unsqueeze(-1).to(y_TKH.dtype)).sum(dim=1)


def _probe(module: nn.Module, whole: bool) -> str | None:
    """``None`` where the module's own forward equals :func:`contract_rows` on the probe (see the
    module docstring), else what differs."""
    num = num_experts_of(module)
    up = module.get_parameter(packed_names(module)[0])
    hidden = up.shape[1] if weights_transposed(module) else up.shape[2]
    device = torch.device("cpu") if up.is_meta else up.device
    generator = torch.Generator(device="cpu").manual_seed(0)
    stand_ins = {
        name: _stand_in(p, num, generator).to(device) for name, p in module.named_parameters() if p.is_floating_point()
    }
    tokens, top_k = 2 * num, (min(2, num) if whole else 1)
    index_TK = (torch.arange(tokens).unsqueeze(1) + torch.arange(top_k)) % num
    weights_TK = torch.rand(tokens, top_k, generator=generator) + 0.1 if whole else torch.ones(tokens, top_k)
    scale_T = 10 ** torch.linspace(*_MAGNITUDES, tokens)[torch.randperm(tokens, generator=generator)]
    x_TH = torch.randn(tokens, hidden, generator=generator) * scale_T.unsqueeze(1)
    args = tuple(t.to(device) for t in (x_TH, index_TK, weights_TK))
    own = type(module).forward if whole else decorated_forward(type(module)).__wrapped__
    try:
        with probing(device), _eager(module):
            own_TH = torch.func.functional_call(_Call(module, own), _prefixed(stand_ins), args)
            expected_TH = torch.func.functional_call(_Call(module, _contract(whole)), _prefixed(stand_ins), args)
    except Exception as exc:  # noqa: BLE001 - a forward that cannot run the probe is not shown equal
        meta = " (its weights are on the meta device: load them, then apply expert parallelism)" if up.is_meta else ""
        return f"its own forward failed on epmoe's probe{meta}: {type(exc).__name__}: {exc}"
    if not isinstance(own_TH, torch.Tensor) or own_TH.shape != expected_TH.shape:
        shape = tuple(own_TH.shape) if isinstance(own_TH, torch.Tensor) else type(own_TH).__name__
        return f"its own forward returned {shape} on epmoe's probe, not the contract's {tuple(expected_TH.shape)}"
    error_T = (own_TH.double() - expected_TH.double()).abs().amax(dim=1)
    scale_T = expected_TH.double().abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    worst = float((error_T / scale_T).max())
    if worst <= _TOLERANCE:
        return None
    return (
        f"its own forward differs from epmoe's routed MLP on a probe ({tokens} tokens over all {num} experts, "
        f"K={top_k}, random weights: largest relative difference {worst:.2g})"
    )


def _contract(whole: bool) -> Callable:
    def run(module: nn.Module, x_TH, top_k_index_TK, top_k_weights_TK):
        return contract_rows(module, x_TH, top_k_index_TK, top_k_weights_TK, whole=whole)

    return run


def _stand_in(param: torch.Tensor, num: int, generator: torch.Generator) -> torch.Tensor:
    """A random float32 tensor of ``param``'s shape; per-expert (leading ``num``, 2-D or more): expert
    ``j`` a window of one buffer starting ``j * 7`` elements in (see the module docstring)."""
    shape = tuple(param.shape)
    inner = math.prod(shape[1:]) if shape else 1
    std = inner**-0.25 if len(shape) >= 2 else 1.0
    if len(shape) >= 2 and shape[0] == num:
        flat = torch.randn(inner + (num - 1) * _STAND_IN_STEP, generator=generator) * std
        strides = [_STAND_IN_STEP] + [math.prod(shape[i + 1 :]) for i in range(1, len(shape))]
        return flat.as_strided(shape, strides)
    return torch.randn(shape, generator=generator) * std


def _prefixed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"experts.{name}": t for name, t in tensors.items()}


class _Call(nn.Module):
    """``run(experts, *args)`` as a module's forward, so that ``functional_call`` stands tensors in
    for the experts' parameters by name."""

    def __init__(self, experts: nn.Module, run: Callable):
        super().__init__()
        self.experts = experts
        self.run = run

    def forward(self, *args):
        return self.run(self.experts, *args)


class _EagerConfig:
    """A module's config, asking for transformers' ``"eager"`` experts implementation."""

    _experts_implementation = "eager"

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name: str):
        return getattr(self._config, name)


@contextlib.contextmanager
def _eager(module: nn.Module):
    """``module`` runs transformers' ``"eager"`` experts implementation (its config, on the module
    alone) inside the block."""
    config = vars(module).get("config")
    if config is None:
        yield
        return
    module.config = _EagerConfig(config)
    try:
        yield
    finally:
        module.config = config
