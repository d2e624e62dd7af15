"""Routing replay (R3): record which experts each token was routed to, and route a later forward the same way.

RL on an MoE model breaks when the trainer routes a token to other experts than the rollout that
sampled it. :func:`record_routing` records, per experts module in model order, the ``K`` global
expert ids its router selected for every token of every forward in the block (a plain forward, or
``generate``: the prompt, then each KV-cache step); :func:`replay_routing` makes the routers select
those ids again. Only the selection is replayed: the routing weights are the router's own values at
the replayed ids, normalised exactly as the model normalises its top-k, so gradients reach the router.

How: the selection of every transformers MoE router (and of epmoe's routing of ``nn.ModuleList``
blocks) is one ``torch.topk`` over the ``E`` experts with ``k = K``; while the router runs, a
``TorchFunctionMode`` sees that call (``torch.topk`` or ``Tensor.topk`` on a ``(..., E)`` input
with ``k = K``) and records its indices, or answers it with the replayed ids and the input's values
at them. The router runs before the exchange, on this rank's own tokens, so the routes of a token
are the same at every EP size (and without EP): recorded at EP 2, replayed at EP 1 or 2.

Routes, one ``int64`` tensor:

* ``(L, N, K)``: per experts module (model order), per token in call order then token order (a
  forward's tokens flattened ``(batch, sequence)``), as :meth:`RoutingRecord.routes` returns them.
  A replayed forward takes the next tokens' routes, call after call; tokens past the end are routed
  as usual; routes left over when the block ends raise ``ValueError``.
* ``(L, B, S, K)``: per experts module, sequence and position, ``-1`` where a position is not
  covered (routed as usual). Every forward in the block is a whole-sequence forward of ``B``
  sequences: position ``t < S`` of sequence ``b`` takes ``routes[:, b, t]``; positions past ``S``
  are routed as usual; a forward shorter than ``S`` raises ``ValueError``.
  :meth:`RoutingRecord.routes_by_position` (a record of ``generate``: the last generated token was
  never a forward's input, so it is not covered) and :func:`routes_from_vllm` give this layout.

A :class:`RoutingRecord` replays per position when its forwards ran one batch position after position
(``generate``'s shape; a forward shorter than the record then takes its first positions: a synced
``generate`` keeps a finished rank stepping for the others), otherwise in call order.

Ids out of range raise ``ValueError`` before anything runs, and every error of a block is raised on
every rank of the model's EP group when the block ends (one agreement step, also where an exception
leaves the block on some rank: the others raise, that one's exception goes on), never a hang. A model
loaded through transformers' own EP with ``ep_implementation="epmoe"`` is replayed the same way (its
routers are transformers', found by structure; its EP group agrees).

Gradient checkpointing runs the routers again in backward: the backward must then run inside the block
(checked: the replayed weights' gradient hooks must have fired by the block's end), and the routes
must be per position (flat routes would hand the recomputation the next tokens' routes).
Replay runs eagerly (not under ``torch.compile``) and costs no host read per step: the replayed
router's work is one ``gather`` and one ``where`` per experts module.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from epmoe import platform
from epmoe.comm.steps import AGREE, StepChannel
from epmoe.ep.adopt import find_experts_modules
from epmoe.ep.counters import counted_modules
from epmoe.ep.state import ep_model
from epmoe.integrations.blocks import block_router, block_top_k

_TOPK = (torch.topk, torch.Tensor.topk)


class _Router:
    """One experts module's router, where its selection is seen: ``E`` experts, ``K`` per token."""

    def __init__(self, name: str, block: nn.Module, router: nn.Module, num_experts: int, top_k: int):
        self.name, self.block, self.router = name, block, router
        self.num_experts, self.top_k = num_experts, top_k
        self.scope = router if isinstance(getattr(router, "top_k", None), int) else block  # where topk runs


def _routers(model: nn.Module, caller: str) -> list[_Router]:
    """The routers of ``model``'s experts modules, in model order (an EP model's, or found by structure)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}(model): expected an nn.Module, got {type(model).__name__}")
    found = ep_model(model)
    if found is not None and found.holding(model):
        named = {id(m): n for n, m in model.named_modules()}
        blocks = [(named.get(id(path[-1]), ""), path[-2] if len(path) > 1 else path[-1]) for path in found.paths]
    else:
        modules = dict(model.named_modules())
        blocks = [
            (name, modules[name.rsplit(".", 1)[0]] if "." in name else model)
            for name, _, _ in find_experts_modules(model)
        ]
    if not blocks:
        raise ValueError(f"{caller}(model): {type(model).__name__} has no experts module")
    return [_router_of(name, block, caller) for name, block in blocks]


def _router_of(name: str, block: nn.Module, caller: str) -> _Router:
    router = block_router(block)
    weight = getattr(router, "weight", None)
    num_experts = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
    num_experts = getattr(router, "num_experts", None) or getattr(router, "n_routed_experts", None) or num_experts
    top_k = getattr(router, "top_k", None)
    top_k = top_k if isinstance(top_k, int) else block_top_k(block)
    if not isinstance(num_experts, int):
        raise ValueError(
            f"{caller}: the router of {name} ({type(router).__name__}) has no expert count "
            f"(num_experts, n_routed_experts or an (E, H) weight)"
        )
    return _Router(name, block, router, num_experts, top_k)


class _Selection(TorchFunctionMode):
    """While one router runs: each ``topk`` over its ``E`` experts with ``k = K`` goes to the sessions
    (replays first, each replacing the selection; then records, each seeing the final one)."""

    def __init__(self, router: _Router, sessions: list[tuple[Any, int]]):
        super().__init__()
        self.router = router
        self.sessions = sorted(sessions, key=lambda entry: entry[0].records)  # (session, its layer index)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _TOPK and self._is_selection(*args, **kwargs):
            for session, layer in self.sessions:
                result = session.select(layer, args[0], result)
        return result

    def _is_selection(self, scores, k, dim=-1, largest=True, sorted=True, **_) -> bool:
        return (
            isinstance(scores, torch.Tensor)
            and scores.dim() >= 1
            and k == self.router.top_k
            and scores.shape[-1] == self.router.num_experts
            and dim in (-1, scores.dim() - 1)
            and largest
        )


class _Hub:
    """The hooks around one router's forward (and its forward hooks registered before, such as a
    :class:`~epmoe.LoadBalancer`'s re-selection) while record and replay sessions use it."""

    def __init__(self, router: _Router):
        self.router, self.sessions, self.modes = router, [], []
        self.handles = [
            router.scope.register_forward_pre_hook(self._enter),
            router.scope.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, _module, _args):
        mode = _Selection(self.router, list(self.sessions))
        mode.__enter__()
        self.modes.append(mode)

    def _exit(self, _module, _args, _output):
        if self.modes:
            mode = self.modes.pop()
            mode.__exit__(None, None, None)
            for session, layer in mode.sessions:
                session.router_done(layer)


_HUBS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # router scope module -> _Hub


def _attach(routers: Sequence[_Router], session: Any) -> None:
    for layer, router in enumerate(routers):
        hub = _HUBS.get(router.scope)
        if hub is None:
            hub = _HUBS[router.scope] = _Hub(router)
        hub.sessions.append((session, layer))


def _detach(routers: Sequence[_Router], session: Any) -> None:
    for router in routers:
        hub = _HUBS[router.scope]
        hub.sessions = [entry for entry in hub.sessions if entry[0] is not session]
        if not hub.sessions:
            for handle in hub.handles:
                handle.remove()
            del _HUBS[router.scope]


class RoutingRecord:
    """What :func:`record_routing` saw: per experts module, the ids of each forward in call order."""

    def __init__(self, routers: Sequence[_Router]):
        self.names = [router.name for router in routers]
        self.top_k = [router.top_k for router in routers]
        self.calls: list[tuple[int, int]] = []  # (batch, sequence) of each forward of the model, in order
        self._ids: list[list[torch.Tensor]] = [[] for _ in routers]  # per module, per forward: (T, K)

    def routes(self) -> torch.Tensor:
        """``(L, N, K)`` int64: per experts module, every recorded token's ``K`` global expert ids (call
        order, then token order)."""
        self._check_complete()
        return (
            torch.stack([torch.cat(ids) for ids in self._ids])
            if self._ids[0]
            else torch.empty(len(self._ids), 0, self.top_k[0], dtype=torch.int64)
        )

    def routes_by_position(self) -> torch.Tensor:
        """``(L, B, S, K)`` int64 of a record whose forwards all ran the same ``B`` sequences one after the
        other (``generate``: the prompt, then one position per step): ``S`` the positions they covered."""
        self._check_complete()
        batches = {batch for batch, _ in self.calls}
        if len(batches) != 1:
            raise ValueError(
                f"RoutingRecord.routes_by_position: the recorded forwards ran batches of {sorted(batches)} "
                f"sequences, not one batch position after position: use routes()"
            )
        batch = batches.pop()
        return torch.stack(
            [torch.cat([ids.view(batch, -1, ids.shape[-1]) for ids in layer], dim=1) for layer in self._ids]
        )

    def _check_complete(self) -> None:
        if len({len(ids) for ids in self._ids}) != 1 or len(self._ids[0]) != len(self.calls):
            raise ValueError(
                "RoutingRecord: some experts modules did not run in every recorded forward (or ran "
                "twice); routes need every module once per forward"
            )
        if len(set(self.top_k)) != 1:
            raise ValueError(
                f"RoutingRecord: the experts modules select different numbers of experts "
                f"{self.top_k}: one tensor cannot hold them"
            )


class record_routing:
    """``with epmoe.record_routing(model) as rec:`` records the routes of every forward of ``model`` in
    the block (see the module docstring); ``rec.routes()`` then holds them."""

    records = True

    def __init__(self, model: nn.Module):
        self._routers = _routers(model, "record_routing")
        self._model = model
        self.record = RoutingRecord(self._routers)
        self._last: list[torch.Tensor | None] = [None] * len(self._routers)  # per router: its forward's last selection
        self._root_hook = None

    def __enter__(self) -> RoutingRecord:
        calls = self.record.calls
        self._root_hook = self._model.register_forward_pre_hook(
            lambda _module, args, kwargs: calls.append(_batch_and_length(args, kwargs)), with_kwargs=True
        )
        _attach(self._routers, self)
        return self.record

    def __exit__(self, *exc) -> None:
        self._root_hook.remove()
        _detach(self._routers, self)

    def select(self, layer: int, _scores: torch.Tensor, result):
        """A selection seen (the last one of a router's forward wins: a balancer's re-selection)."""
        self._last[layer] = result.indices.detach().reshape(-1, self._routers[layer].top_k).to(torch.int64)
        return result

    def router_done(self, layer: int) -> None:
        if self._last[layer] is not None:
            self.record._ids[layer].append(self._last[layer])
            self._last[layer] = None


def _generate_shaped(calls: list[tuple[int, int]]) -> bool:
    """Whether forwards of these ``(batch, sequence)`` shapes ran one batch position after position
    (``generate``: the prompt, then one position per step), so that a record of them replays per
    position; any other record replays in call order."""
    return len({batch for batch, _ in calls}) == 1 and all(length == 1 for _, length in calls[1:])


def _batch_and_length(args: tuple, kwargs: dict[str, Any]) -> tuple[int, int]:
    """``(B, S)`` of a model forward's ``input_ids`` / ``inputs_embeds`` (``(1, T)``-like shapes otherwise)."""
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    return 1, -1


class replay_routing:
    """``with epmoe.replay_routing(model, routes):`` routes every forward of ``model`` in the block by
    ``routes`` (a tensor, or a :class:`RoutingRecord`; see the module docstring)."""

    records = False

    def __init__(self, model: nn.Module, routes: torch.Tensor | RoutingRecord):
        self._routers = _routers(model, "replay_routing")
        self._channel, self._device = _agreement_channel(model)
        self._by_record = isinstance(routes, RoutingRecord)
        if self._by_record:  # the routers' own selections: nothing to validate
            routes = routes.routes_by_position() if _generate_shaped(routes.calls) else routes.routes()
        else:
            error = _routes_error(routes, self._routers)
            self._agree(error, "were given routes they cannot replay")
            if error is not None:
                raise ValueError(f"replay_routing(routes): {error}")
        weight = next(self._routers[0].router.parameters(), None)
        self.routes = routes.to(device=None if weight is None else weight.device, dtype=torch.int64)
        self.used = [0] * len(self._routers)  # flat routes: tokens taken, per experts module
        self.errors: list[str] = []
        self._checkpointed = any(
            getattr(m, "gradient_checkpointing", False) is True and m.training for m in model.modules()
        )
        self._selections_with_grad = self._backwards = 0  # under gradient checkpointing

    def __enter__(self) -> replay_routing:
        _attach(self._routers, self)
        return self

    def __exit__(self, exc_type, *_) -> None:
        _detach(self._routers, self)
        if exc_type is not None:  # the peers still agree (they may be waiting in it); the exception goes on
            self._agree(f"{exc_type.__name__} raised inside the block", "raised inside their replay_routing block")
            return
        if self.routes.dim() == 3:
            left = [
                (r.name, self.routes.shape[1] - used)
                for r, used in zip(self._routers, self.used)
                if used < self.routes.shape[1]
            ]
            if left:
                self.errors.append(
                    f"routes for {left[0][1]} token(s) of {left[0][0]} were left over: the "
                    f"routes cover more tokens than the block's forwards"
                )
        if self._selections_with_grad and not self._backwards:
            self.errors.append(
                "gradient checkpointing recomputes the routers in backward: run the backward inside "
                "the replay_routing block (the recomputation must see the same routes)"
            )
        error = self.errors[0] if self.errors else None
        self._agree(error, "could not replay their routes")
        if error is not None:
            raise ValueError(f"replay_routing: {error}")

    def _agree(self, error: str | None, what_failed: str) -> None:
        """Raise on every rank of the EP group if any rank found ``error`` (one agreement step)."""
        channel = self._channel
        if channel is not None:
            channel.agree(
                channel.next_call(AGREE),
                self._device,
                [],
                failed=error is not None,
                caller="epmoe.replay_routing",
                what_failed=what_failed,
            )

    def select(self, layer: int, scores: torch.Tensor, result):
        """The selection with this layer's replayed ids, weighted by the router's own ``scores`` there."""
        live_TK = result.indices.reshape(-1, self._routers[layer].top_k)
        routes_TK = self._routes_for(layer, live_TK.shape[0])
        if routes_TK is None:
            return result
        ids_TK = torch.where(routes_TK >= 0, routes_TK, live_TK).view_as(result.indices)
        values = scores.gather(-1, ids_TK)
        if self._checkpointed and values.requires_grad:
            self._selections_with_grad += 1
            values.register_hook(self._backward_seen)
        return torch.return_types.topk((values, ids_TK))

    def router_done(self, layer: int) -> None:
        pass

    def _backward_seen(self, _grad) -> None:
        self._backwards += 1

    def _routes_for(self, layer: int, tokens: int) -> torch.Tensor | None:
        """``(T, K)`` replayed ids (``-1``: routed as usual) for the next forward's ``tokens`` tokens."""
        routes = self.routes[layer]
        if routes.dim() == 2:  # (N, K): the next tokens in call order
            if self._checkpointed and torch.is_grad_enabled():
                self.errors.append(
                    "flat (L, N, K) routes under gradient checkpointing: the recomputation in backward "
                    "would take the next tokens' routes; give per-position (L, B, S, K) routes"
                )
                return None
            start = self.used[layer]
            self.used[layer] = start + tokens
            taken = routes[start : start + tokens]
            return torch.cat([taken, taken.new_full((tokens - taken.shape[0], routes.shape[-1]), -1)])
        batch, length, k = routes.shape  # (B, S, K): this forward's B sequences, from position 0
        if tokens % batch:
            self.errors.append(f"a forward of {tokens} tokens is not one of {batch} sequences, as the routes are")
            return None
        if tokens // batch < length:
            if not self._by_record:
                self.errors.append(f"a forward of {tokens // batch} positions is shorter than the routes' {length}")
                return None
            routes = routes[:, : tokens // batch]  # a synced generate's steps past this rank's sequences
        return torch.cat([routes, routes.new_full((batch, tokens // batch - routes.shape[1], k), -1)], 1).view(-1, k)


def _agreement_channel(model: nn.Module) -> tuple[StepChannel | None, torch.device | None]:
    """``(channel, device)`` the block's agreement step runs on: the EP group's of an EP model, or of
    the first experts module epmoe runs inside transformers' EP; ``(None, None)`` where there is no
    EP group epmoe knows of (a plain model)."""
    ep = ep_model(model)
    if ep is not None:
        return ep.channel, platform.group_device(ep.group)
    layer = next((layer for _, layer in counted_modules(model)), None)
    return (layer.channel, layer.device) if layer is not None else (None, None)


def _routes_error(routes: Any, routers: Sequence[_Router]) -> str | None:
    """What is wrong with ``routes`` for these routers (one host read, on the routes' device), or ``None``."""
    if (
        not isinstance(routes, torch.Tensor)
        or routes.dtype.is_floating_point
        or routes.dtype.is_complex
        or routes.dtype == torch.bool
    ):
        return f"expected an integer tensor or a RoutingRecord, got {type(routes).__name__}"
    top_k = {router.top_k for router in routers}
    if (
        routes.dim() not in (3, 4)
        or routes.shape[0] != len(routers)
        or len(top_k) != 1
        or routes.shape[-1] != top_k.pop()
    ):
        return (
            f"expected (L, N, K) or (L, B, S, K) routes with L={len(routers)} experts modules and K = "
            f"{sorted({r.top_k for r in routers})}, got shape {tuple(routes.shape)}"
        )
    if routes.numel() == 0:
        return None
    uncovered = routes < 0
    high = torch.tensor([r.num_experts for r in routers], device=routes.device).view(-1, *[1] * (routes.dim() - 1))
    sorted_ids = routes.sort(dim=-1).values
    bad = torch.stack(
        [
            (routes < -1).any(),
            (routes >= high).any(),
            (uncovered.any(-1) != uncovered.all(-1)).any(),
            ((sorted_ids[..., 1:] == sorted_ids[..., :-1]) & (sorted_ids[..., 1:] >= 0)).any(),
        ]
    ).tolist()
    reasons = [
        "an id below -1",
        f"an id not below the experts' count {sorted({r.num_experts for r in routers})}",
        "a token with some of its K ids -1 (not covered) and others not",
        "a token routed twice to one expert",
    ]
    return next((f"routes hold {reason}" for reason, b in zip(reasons, bad) if b), None)


def routes_from_vllm(routed_experts: Any, *, length: int | None = None, padding_side: str = "right") -> torch.Tensor:
    """``(L, B, S, K)`` int64 routes (``-1``: not covered) from vLLM's routed experts.

    ``routed_experts``: one sequence's ``(tokens, L, K)`` expert ids (vLLM's per-token layout; for a
    prompt and its completion, ``np.concatenate([prompt_routed_experts, routed_experts])``), or a list
    of them, one per sequence of the batch the training forward runs; row ``i`` is position ``i`` of its
    sequence. ``length``: the positions ``S`` of that forward (default: the longest sequence);
    ``padding_side="left"`` places each sequence's rows at the end of its positions, as a left-padded
    batch does.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"routes_from_vllm(padding_side): expected 'left' or 'right', got {padding_side!r}")
    single = isinstance(routed_experts, torch.Tensor) or hasattr(routed_experts, "__array__")
    sequences = [routed_experts] if single else list(routed_experts)
    if not sequences:
        raise ValueError("routes_from_vllm(routed_experts): expected at least one sequence")
    tensors = [torch.as_tensor(seq).to(torch.int64) for seq in sequences]
    shapes = {tuple(t.shape[1:]) for t in tensors}
    if any(t.dim() != 3 for t in tensors) or len(shapes) != 1:
        raise ValueError(
            f"routes_from_vllm(routed_experts): expected (tokens, layers, K) ids with the same layers "
            f"and K, got shapes {[tuple(t.shape) for t in tensors]}"
        )
    longest = max(t.shape[0] for t in tensors)
    length = longest if length is None else length
    if isinstance(length, bool) or not isinstance(length, int) or length < longest:
        raise ValueError(
            f"routes_from_vllm(length): expected an int of at least the longest sequence's "
            f"{longest} positions, got {length!r}"
        )
    layers, top_k = shapes.pop()
    routes = torch.full((layers, len(tensors), length, top_k), -1, dtype=torch.int64)
    for b, ids in enumerate(tensors):
        start = length - ids.shape[0] if padding_side == "left" else 0
        routes[:, b, start : start + ids.shape[0]] = ids.transpose(0, 1)
    return routes
