"""A layer's routing as index tensors built on the device: which rows travel, which pairs run.

The model's router gives each token ``K`` routing choices (``top_k_index_TK``, ``top_k_weights_TK``);
one choice is a *slot* (``S = T * K``, slot ``s = t*K + k``). The all-to-all-v transport
(:mod:`epmoe.ep.dispatch.alltoallv`) moves *rows* and its experts run *pairs*:

* **rows** (``R``): what travels. On one rank the rows are the tokens themselves (``R = T``). Over
  ``W`` ranks each token travels once to each rank holding one of its experts (:class:`TokenRows`):
  one row per (token, destination rank), rank-major then token, so a token whose ``K`` experts live
  on ``d`` ranks is sent ``d`` times, not ``K``. The rows it gets back are summed in rank order.
* **pairs** (``P``): what the experts compute. On the expert's rank each row expands to its local
  experts by index (:class:`RowPairs`): a pair is a (row, k) whose expert is local, ``slot_P = row*K
  + k``, sorted by local expert (stable: source rank, then token, then k, the order capacity keeps).
  Each row's pairs come back weighted and summed in ``k`` order, one row per (token, rank)::

    token t0: experts e0 e3   (e = 2 local experts per rank, W = 2)
    rank 0 sends t0 once to rank 0 (e0) and once to rank 1 (e3): rows [t0 | t0]
    rank 1 expands its row t0 to the pair (t0, k=1) of local expert 1, returns w1 * e3(t0)
    rank 0 sums what came back: out[t0] = w0 * e0(t0) + w1 * e3(t0)

    sender (rank-major rows)        receiver (source-major rows)      pairs (expert-major)
    +-----------+                   +-----------+                     +----------------+
    | ->r0  t0  |  --all-to-all-v-> | s0  t0    |  --expand by k-->   | j0 <- (s0 t0)  |
    | ->r0  t2  |                   | s0  t2    |                     | j0 <- (s1 t1)  |
    | ->r1  t0  |                   | s1  t1    |                     | j1 <- (s0 t2)  |
    +-----------+                   +-----------+                     +----------------+

The counts a layer needs for this (rows per rank, pairs per local expert) come from its counts
exchange (:func:`epmoe.ep.counts.exchange_layer_counts`). The fused transport keeps the
vendor's per-slot layout instead (:mod:`epmoe.ep.dispatch.fused`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from epmoe import platform

# where sums of rows of a dtype accumulate, where not in that dtype itself: float32 for 16-bit floats
# (as torch.sum does); read as ACCUMULATION_DTYPES.get(dtype, dtype)
ACCUMULATION_DTYPES = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


@dataclass(frozen=True)
class RowSources:
    """Where a layer's received rows came from: ``rows_W[s]`` rows from EP rank ``s``, source-major,
    over ``group`` (the all-to-all-v transport's rows)."""

    rows_W: list[int]
    group: dist.ProcessGroup | None


@dataclass
class RowPairs:
    """The pairs of ``R`` rows with ``K`` choices each, expert-major, on the device."""

    slot_P: torch.Tensor  # (P,) int64: row*K + k of each pair, sorted by local expert (stable)
    pair_RK: torch.Tensor  # (R, K) int64: the pair of each (row, k); P where it has none
    counts_e: torch.Tensor  # (e,) int64: pairs per local expert, on the device
    host_counts_e: list[int] | None = None  # the same on the host, where the counts exchange read them
    padded: bool = False  # P = R*K: the pairs past sum(counts_e) are padding (see pair_rows)

    @property
    def counts(self) -> list[int] | torch.Tensor:
        """The counts the grouped matmuls take: the host list where known, else the device tensor."""
        return self.host_counts_e if self.host_counts_e is not None else self.counts_e


def pair_rows(
    local_expert_RK: torch.Tensor,
    num_local: int,
    num_pairs: int | None = None,
    host_counts_e: list[int] | None = None,
    *,
    padded: bool = False,
) -> RowPairs:
    """The pairs of rows whose ``K`` choices go to ``local_expert_RK`` (``num_local`` where the
    expert is not local). ``num_pairs``: how many are local (from the counts exchange; ``None``: all
    ``R * K``, a single rank's case, so nothing is read to the host, and a choice outside
    ``[0, num_local)`` raises in the histogram instead of counting as another rank's).

    ``padded`` (the static transport's: how many are local is known on the device only): every
    ``(row, k)`` is a pair, ``P = R * K``, the local ones first (expert-major, as above), then the
    others, *padding*, which the grouped matmuls leave out (past the counts' sum) and whose
    ``pair_RK`` is ``P`` (no pair), so they contribute nothing forward or backward::

        slot_P  [ j0 pairs | j1 pairs | ... | padding: choices of other ranks' experts, empty rows ]
                 <------- sum(counts_e) ------->"""
    R, K = local_expert_RK.shape
    key_S = local_expert_RK.reshape(-1)
    P = key_S.numel() if num_pairs is None or padded else num_pairs
    slot_P = torch.sort(key_S, stable=True).indices[:P]
    pair_S = torch.full_like(key_S, P).index_copy_(0, slot_P, torch.arange(P, device=key_S.device))
    counts = torch.zeros(num_local + (num_pairs is not None or padded), dtype=torch.int64, device=key_S.device)
    counts.scatter_add_(0, key_S.long(), torch.ones_like(key_S, dtype=torch.int64))
    if padded:
        pair_S = pair_S.masked_fill(key_S >= num_local, P)
    return RowPairs(slot_P, pair_S.view(R, K), counts[:num_local], host_counts_e, padded)


def keep_first(pairs: RowPairs, capacity: int, host_counts_e: list[int]) -> tuple[RowPairs, list[int]]:
    """``(kept pairs, dropped per local expert)``: only the first ``capacity`` pairs of each local
    expert (``host_counts_e``: its pairs, on the host) run; the others' outputs are zero."""
    kept_e = [min(capacity, n) for n in host_counts_e]
    dropped = [n - k for n, k in zip(host_counts_e, kept_e)]
    if not any(dropped):
        return pairs, dropped
    P, device = pairs.slot_P.numel(), pairs.slot_P.device
    starts_e = pairs.counts_e.cumsum(0) - pairs.counts_e
    expert_P = torch.repeat_interleave(torch.arange(len(kept_e), device=device), pairs.counts_e, output_size=P)
    dropped_P = (torch.arange(P, device=device) - starts_e[expert_P]) >= capacity
    slot_P = pairs.slot_P[torch.sort(dropped_P.to(torch.int8), stable=True).indices[: sum(kept_e)]]
    R, K = pairs.pair_RK.shape
    pair_S = torch.full((R * K,), slot_P.numel(), dtype=torch.int64, device=device)
    pair_S.index_copy_(0, slot_P, torch.arange(slot_P.numel(), device=device))
    counts_e = platform.host_to_device(torch.tensor(kept_e, dtype=torch.int64), device)
    return RowPairs(slot_P, pair_S.view(R, K), counts_e, kept_e), dropped


def destinations_TW(top_k_index_TK: torch.Tensor, experts_per_rank: int, ep_size: int) -> torch.Tensor:
    """``(T, W)`` int64 on the device: 1 where token ``t`` has an expert on rank ``w`` (a row goes
    there); summed over tokens, the rows each rank receives from this one."""
    rank_TK = torch.div(top_k_index_TK.long(), experts_per_rank, rounding_mode="floor")
    sends_TW = torch.zeros(top_k_index_TK.shape[0], ep_size, dtype=torch.int64, device=top_k_index_TK.device)
    return sends_TW.scatter_(1, rank_TK, 1)


class TokenRows(NamedTuple):
    """The sender's rows: one per (token, destination rank), rank-major then token, on the device.
    The rows move by it as ``GatherRows.apply(x_TH, *rows)`` and come back as
    ``SumRows.apply(y_RH, *rows)`` (differentiable)."""

    token_R: torch.Tensor  # (R,) int64: each row's token (T: a padding row, where padded)
    row_TD: torch.Tensor  # (T, D) int64: each token's rows in rank order (D = min(K, W)); R where none
    padded: bool = False  # the rows are W blocks of B, each block's rows then zero rows (static_token_rows)


def token_rows(top_k_index_TK: torch.Tensor, experts_per_rank: int, ep_size: int, num_rows: int) -> TokenRows:
    """The rows of tokens routed by ``top_k_index_TK`` (``num_rows``: their number, from the counts
    exchange); built from index arithmetic and one stable sort, no per-rank loop."""
    T, K = top_k_index_TK.shape
    device = top_k_index_TK.device
    sends_WT = destinations_TW(top_k_index_TK, experts_per_rank, ep_size).t().reshape(-1)
    order_R = torch.sort(1 - sends_WT, stable=True).indices[:num_rows]  # rank-major, then token
    row_WT = torch.full((ep_size * T,), num_rows, dtype=torch.int64, device=device)
    row_WT.index_copy_(0, order_R, torch.arange(num_rows, device=device))
    row_TD = torch.sort(row_WT.view(ep_size, T).t(), dim=1).values[:, : min(K, ep_size)]
    return TokenRows(order_R % T, row_TD)


def static_token_rows(
    top_k_index_TK: torch.Tensor, experts_per_rank: int, ep_size: int, block: int
) -> tuple[TokenRows, torch.Tensor]:
    """``(rows, rows_W)``: the static transport's rows, ``W`` blocks of ``block`` (``B >= T``) rows,
    block ``w`` the tokens with an expert on rank ``w`` in token order, then padding rows (token
    ``T``: zero rows); ``rows_W`` (``(W,)`` int64): the real rows of each block. Built on the device
    (a cumulative sum and a scatter), nothing read to the host::

        T = 3, B = 4, t0 -> ranks 0, 1; t1 -> rank 1; t2 -> rank 0
        token_R [t0 t2 -  - | t0 t1 -  - ]    row_TD  t0: [0 4]  t1: [5 8]  t2: [1 8]   (8 = R: none)"""
    T, K = top_k_index_TK.shape
    W, B = ep_size, block
    dest_TW = destinations_TW(top_k_index_TK, experts_per_rank, W)
    start_W = torch.arange(W, device=dest_TW.device) * B
    row_TW = torch.where(dest_TW.bool(), start_W + dest_TW.cumsum(0) - 1, W * B)  # W*B: no row
    token_R = torch.full((W * B + 1,), T, dtype=torch.int64, device=dest_TW.device)
    token_TW = torch.arange(T, device=dest_TW.device).view(T, 1).expand(T, W)
    token_R = token_R.scatter(0, row_TW.reshape(-1), token_TW.reshape(-1))[: W * B]
    row_TD = torch.sort(row_TW, dim=1).values[:, : min(K, W)]
    return TokenRows(token_R, row_TD, padded=True), dest_TW.sum(0)


def route_dtype(hidden_dtype: torch.dtype, weights_dtype: torch.dtype) -> torch.dtype:
    """The float dtype a row's route (its ``K`` expert ids, then its ``K`` routing weights) rides in
    after its hidden state (:class:`GatherRows`): ``float64`` where the hidden states or the weights
    are, else ``float32``. The weights arrive exact; the ids too (integers below ``2**24`` in
    ``float32``: :class:`RouteIds`); and the ids fill whole columns of the row (the route's element
    size a multiple of the hidden dtype's), so a row's own ids can be written over its token's."""
    return torch.float64 if torch.float64 in (hidden_dtype, weights_dtype) else torch.float32


class GatherRows(torch.autograd.Function):
    """``GatherRows.apply(x_TH, route_TC, *rows)`` (``rows``: :class:`TokenRows`): ``(R, H)``, each
    token's hidden state once per destination rank (zero rows for padding); with a ``route_TC``
    (``None`` or ``(T, C)`` float, ``C`` times its itemsize a multiple of ``x_TH``'s), ``(R, H + C')``:
    each row followed by the bytes of its token's route, carried exactly in ``x_TH``'s dtype so one
    exchange moves both (:class:`UnpackRoute` splits them; each reinterpretation reads a fresh copy of
    the route's few columns, which a view to another element size needs from its storage's start).
    Backward: each token's rows' gradients summed in rank order."""

    @staticmethod
    def forward(
        ctx,
        x_TH: torch.Tensor,
        route_TC: torch.Tensor | None,
        token_R: torch.Tensor,
        row_TD: torch.Tensor,
        padded: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(row_TD)
        ctx.hidden, ctx.route_dtype = x_TH.shape[1], None if route_TC is None else route_TC.dtype
        if route_TC is not None:
            x_TH = torch.cat([x_TH, route_TC.clone(memory_format=torch.contiguous_format).view(x_TH.dtype)], dim=1)
        if padded:  # padding rows read an appended zero row (index T)
            x_TH = torch.cat([x_TH, x_TH.new_zeros(1, x_TH.shape[1])])
        return x_TH[token_R]

    @staticmethod
    def backward(ctx, dx_RX):
        (row_TD,) = ctx.saved_tensors
        if ctx.route_dtype is None:
            return _sum_by_token(dx_RX, row_TD), None, None, None, None
        droute_RC = dx_RX[:, ctx.hidden :].clone(memory_format=torch.contiguous_format).view(ctx.route_dtype)
        return _sum_by_token(dx_RX[:, : ctx.hidden], row_TD), _sum_by_token(droute_RC, row_TD), None, None, None


class SumRows(torch.autograd.Function):
    """``SumRows.apply(y_RH, *rows)`` (``rows``: :class:`TokenRows`, ``y_RH`` in their order):
    ``(T, H)``, the rows each token got back, summed in rank order; backward: the token's gradient
    to each of its rows (zero to padding rows)."""

    @staticmethod
    def forward(ctx, y_RH: torch.Tensor, token_R: torch.Tensor, row_TD: torch.Tensor, padded: bool) -> torch.Tensor:
        ctx.save_for_backward(token_R)
        ctx.padded = padded
        return _sum_by_token(y_RH, row_TD)

    @staticmethod
    def backward(ctx, dout_TH):
        (token_R,) = ctx.saved_tensors
        if ctx.padded:  # padding rows read an appended zero row (index T)
            dout_TH = torch.cat([dout_TH, dout_TH.new_zeros(1, dout_TH.shape[1])])
        return dout_TH[token_R], None, None, None


class UnpackRoute(torch.autograd.Function):
    """``UnpackRoute.apply(packed_RX, hidden, route_dtype)``: ``(x_RH, route_RC)`` of a
    :class:`GatherRows` exchanged with a route; backward packs their gradients back (zeros for a
    missing one)."""

    @staticmethod
    def forward(ctx, packed_RX: torch.Tensor, hidden: int, route_dtype: torch.dtype):
        route_RC = packed_RX[:, hidden:].clone(memory_format=torch.contiguous_format).view(route_dtype)
        ctx.rows, ctx.hidden, ctx.route_columns = packed_RX.shape[0], hidden, route_RC.shape[1]
        ctx.dtype, ctx.route_dtype, ctx.device = packed_RX.dtype, route_dtype, packed_RX.device
        return packed_RX[:, :hidden].contiguous(), route_RC  # copies: the packed buffer is not kept

    @staticmethod
    def backward(ctx, dx_RH, droute_RC):
        if dx_RH is None:
            dx_RH = torch.zeros(ctx.rows, ctx.hidden, dtype=ctx.dtype, device=ctx.device)
        if droute_RC is None:
            droute_RC = torch.zeros(ctx.rows, ctx.route_columns, dtype=ctx.route_dtype, device=ctx.device)
        return (
            torch.cat([dx_RH, droute_RC.clone(memory_format=torch.contiguous_format).view(ctx.dtype)], dim=1),
            None,
            None,
        )


def _sum_by_token(y_RH: torch.Tensor, row_TD: torch.Tensor) -> torch.Tensor:
    """``(T, H)``: each token's rows summed in a fixed order (deterministic: no atomics), in float32
    or wider; a token's missing rows (``row_TD == R``) read an appended zero row."""
    R, H = y_RH.shape
    out_TH = y_RH.new_zeros(row_TD.shape[0], H, dtype=ACCUMULATION_DTYPES.get(y_RH.dtype, y_RH.dtype))
    y_RH = torch.cat([y_RH, y_RH.new_zeros(1, H)])
    for column in row_TD.unbind(1):
        out_TH += y_RH[column]
    return out_TH.to(y_RH.dtype)


def redirected_slots(
    top_k_index_TK: torch.Tensor, moves_M5: list[list[int]] | torch.Tensor, ep_size: int, num_redirected: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(moved_TK, slot_X, helper_X, lent_X)`` of the slots expert replicas take from this rank
    (:mod:`epmoe.ep.replicas`); ``moves_M5``: ``(M, 5)`` ints (a host list, or int64 on the device), per
    move touching this rank ``(expert, lo, hi, helper, lent)``
    (:meth:`~epmoe.ep.replicas.ReplicaPlan.moves_from`): its slots of ``expert`` at positions ``[lo, hi)`` among
    this rank's slots of that expert (in slot order ``t*K + k``) go to ``helper``, which runs them as its
    lent expert ``lent``. ``moved_TK``: bool, the slots that go to a helper; ``slot_X``: them, by
    helper, then slot (``num_redirected`` of them, known on the host); ``helper_X``, ``lent_X``:
    each one's helper and ``lent``. Built by one stable sort and a comparison with every move,
    nothing read to the host."""
    expert_S = top_k_index_TK.reshape(-1)
    S, device = expert_S.numel(), expert_S.device
    if len(moves_M5) == 0:  # none of this rank's slots move
        none = torch.zeros(0, dtype=torch.int64, device=device)
        return torch.zeros(top_k_index_TK.shape, dtype=torch.bool, device=device), none, none, none
    if not isinstance(moves_M5, torch.Tensor):
        moves_M5 = platform.host_to_device(torch.tensor(moves_M5, dtype=torch.int64), device)
    order_S = torch.sort(expert_S, stable=True).indices
    counts_E = torch.bincount(expert_S)
    starts_E = counts_E.cumsum(0) - counts_E
    position_S = torch.empty_like(expert_S).index_copy_(
        0, order_S, torch.arange(S, device=device) - starts_E[expert_S[order_S]]
    )
    expert_M, lo_M, hi_M, helper_M, lent_M = moves_M5.unbind(1)
    match_SM = (expert_S[:, None] == expert_M) & (position_S[:, None] >= lo_M) & (position_S[:, None] < hi_M)
    moved_S = match_SM.any(1)
    move_S = match_SM.to(torch.int8).argmax(1)
    helper_S = torch.where(moved_S, helper_M[move_S], ep_size)
    slot_X = torch.sort(helper_S, stable=True).indices[:num_redirected]
    move_X = move_S[slot_X]
    return moved_S.view(top_k_index_TK.shape), slot_X, helper_M[move_X], lent_M[move_X]


@dataclass(frozen=True)
class RouteIds:
    """The ids a row's ``K`` choices carry through the all-to-all-v and the two-level exchange (its
    route's first ``K`` columns, :func:`route_dtype`): one numbering for both, global, so each id says
    the rank its row goes to, which a forwarder of the two-level exchange routes by. ``E`` experts,
    ``e`` per rank; without a replica plan (:mod:`epmoe.ep.replicas`) a row carries the first kind only::

        choice k of a row                                  id              goes to  computed there as
        a slot of global expert g, its owner computes it   g               g // e   local expert g - rank*e
        a slot moved to helper h (its token's row still    g + E           g // e   nothing (left out)
          goes to the owner, for its other choices)
        a moved slot, in its own row: at its k             2E + h*E + i    h        lent expert i of h
                                      at every other k     -1              nowhere  nothing

    (``i``: the helper's replica, in :meth:`~epmoe.ep.replicas.ReplicaPlan.received` order). Every id
    is below ``(W + 2) * E``: exact in ``float32`` while that is at most ``2**24`` (1022 ranks of 16384
    experts)."""

    experts_per_rank: int
    num_experts: int

    def encode(
        self,
        top_k_index_TK: torch.Tensor,
        token_R: torch.Tensor,
        redirected: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """``(R + X, K)`` int64: the ids of the rows of tokens ``token_R`` (a slot that goes to a
        helper ``g + E``), then of one row per slot of ``redirected`` (:func:`redirected_slots`)."""
        E, K = self.num_experts, top_k_index_TK.shape[1]
        moved_TK, slot_X, helper_X, lent_X = redirected
        own_RK = (top_k_index_TK + E * moved_TK.long())[token_R]
        lent_XK = torch.full((slot_X.numel(), K), -1, dtype=torch.int64, device=own_RK.device)
        lent_XK[torch.arange(slot_X.numel(), device=own_RK.device), slot_X % K] = (2 + helper_X) * E + lent_X
        return torch.cat([own_RK, lent_XK])

    def rank_RK(self, ids_RK: torch.Tensor) -> torch.Tensor:
        """``(R, K)`` int64: the rank each choice's row goes to, ``-1`` nowhere."""
        E, e = self.num_experts, self.experts_per_rank
        rank_RK = torch.where(ids_RK >= 2 * E, ids_RK // E - 2, (ids_RK % E) // e)
        return rank_RK.masked_fill(ids_RK < 0, -1)

    def local(self, ids_RK: torch.Tensor, rank: int, num_lent: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(own_RK, lent_RK)``, ``(R, K)`` int64 each, on ``rank``: each choice as its local expert
        (``e``: none of its own) and as its lent expert (``num_lent``: none), as :func:`pair_rows` reads them."""
        E, e = self.num_experts, self.experts_per_rank
        own_RK = ids_RK - rank * e
        own_RK = own_RK.masked_fill((ids_RK >= E) | (own_RK < 0) | (own_RK >= e), e)
        lent_RK = ids_RK - (2 + rank) * E
        return own_RK, lent_RK.masked_fill((lent_RK < 0) | (lent_RK >= E), num_lent)


def replica_rows(
    top_k_index_TK: torch.Tensor,
    rows: TokenRows,
    send_rows_D: list[int],
    redirected: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    dest_X: torch.Tensor,
    ids: RouteIds,
) -> tuple[TokenRows, torch.Tensor]:
    """``(rows, ids_RK)``: the sender's rows under a replica plan (:mod:`epmoe.ep.replicas`): ``rows``
    (each token once per destination holding one of its experts, destination-major, ``send_rows_D[d]``
    to destination ``d``: a rank, or the two-level exchange's node) and one row of its own per
    redirected slot (:func:`redirected_slots`; to destination ``dest_X``), merged destination-major,
    each destination's token rows first; ``ids_RK``: each row's ids (:class:`RouteIds`)::

        W = 2, e = 2 (E = 4): token t0 -> experts 0 and 3, its slot of expert 0 moved to rank 1 (its lent expert 0)
        rows [t0 -> rank 0: (4, 3) | t0 -> rank 1: (4, 3) | t0 -> rank 1: (12, -1)]"""
    T, K = top_k_index_TK.shape
    device = rows.token_R.device
    slot_X = redirected[1]
    R, X = rows.token_R.numel(), slot_X.numel()
    rows_D = platform.host_to_device(torch.tensor(send_rows_D, dtype=torch.int64), device)
    dest_R = torch.repeat_interleave(torch.arange(len(send_rows_D), device=device), rows_D, output_size=R)
    order = torch.sort(torch.cat([dest_R * 2, dest_X * 2 + 1]), stable=True).indices
    token_R = torch.cat([rows.token_R, slot_X // K])[order]
    per_token = min(K, len(send_rows_D)) + min(K, X)  # a token's own rows, then its redirected slots'
    merged = TokenRows(token_R, rows_by_token(token_R, T, per_token))
    return merged, ids.encode(top_k_index_TK, rows.token_R, redirected)[order]


def rows_by_token(token_R: torch.Tensor, num_tokens: int, per_token: int) -> torch.Tensor:
    """``(T, D)`` int64: each token's rows of ``token_R``, in row order (``D = per_token`` at least
    the most rows a token has; ``R`` where it has fewer)."""
    R, device = token_R.numel(), token_R.device
    order = torch.sort(token_R, stable=True).indices
    rows_T = torch.bincount(token_R, minlength=num_tokens)
    starts_T = rows_T.cumsum(0) - rows_T
    token_sorted = token_R[order]
    row_TD = torch.full((num_tokens, per_token), R, dtype=torch.int64, device=device)
    row_TD[token_sorted, torch.arange(R, device=device) - starts_T[token_sorted]] = order
    return row_TD
