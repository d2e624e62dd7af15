"""The static transport: fixed-size buffers, no counts exchange, no host read, traced whole.

Each token goes to each rank holding one of its experts at most once, so a rank never sends a peer
more rows than it has tokens: a buffer of ``B >= T`` rows per destination always suffices, and the
exchange is dropless by construction. Every rank sends every rank (itself included) one block of
``B`` rows, the tokens with an expert there in token order, then zero rows (*padding*); the rows'
expert ids, the row count and the step header travel in an int64 block beside it (the *route*), in
the same collective (:func:`epmoe.comm.static.static_exchange_with`), the routing weights beside the
rows (in the wider of the two dtypes, so both arrive exact). ``W = 2``, ``e = 2`` local experts,
``K = 2``, ``B = 3``; rank 0's tokens ``t0 -> e0, e3``, ``t1 -> e1, e0``, ``t2 -> e2, e3``::

    rank 0 sends  block to rank 0               block to rank 1
      rows        [t0  t1  0 ]                  [t0  t2  0 ]            (H + K wide: the row, its weights)
      route       [head n=2 | (0 3)(1 0)(- -)]  [head n=2 | (0 3)(2 3)(- -)]   head = MAGIC layer phase call
                                                                        flag dtype B T (+ guard), ids int64
       --one static exchange (equal blocks, shapes known in advance: no counts, no host read)-->
    rank 1 holds  [from rank 0: t0 t2 pad | from rank 1: ...]   padding rows: expert ids -1
       --pairs on the device: every (row, k), the local ones expert-major, then padding-->
       --epmoe::routed_mlp on device counts (the padding past their sum masked)-->
       --static exchange back, the same blocks-->
    rank 0: out[t0] = y(block 0, row 0) + y(block 1, row 0)     each token's rows summed in rank order

The row order of the real rows and pairs is the all-to-all-v transport's (source rank, then token,
then ``k``), the padding after them, so in float64, where the same kernels run, the two transports
give bitwise the same outputs and gradients.

**What runs where.** Forward: the route with the rows, then the combine (two collectives, no counts
exchange); backward: the combine's and the rows' gradients (two). The
counts of the grouped matmuls stay on the device: the ``torch`` grouped-matmul backend (float32,
bfloat16) takes them there and nothing is read to the host; in float64 the ``loop`` backend runs,
which reads the counts to the host once per forward and once per backward.

**What it costs.** Every rank receives ``W x B`` rows (``B >= T``) where the dynamic path receives
about ``d x T`` (``d`` the mean ranks per token), and the routed MLP's gathers and elementwise
passes run over ``W x B x K`` pairs, the real ones and the padding (the grouped matmuls over the
real ones only). It pays where latency dominates (decode-sized steps: half the collectives, no host
read); at training-sized steps on CPU the padding costs more than that saves
(``benchmarks/static_cpu.md``), which is why ``dispatch="auto"`` takes it at the decode steps of
``generate`` only (:class:`DecodeDispatcher`, :mod:`epmoe.training.generate`).

**The buffer size B.** With ``ExpertParallelConfig(static_tokens=N)``, ``B = N`` and nothing is
agreed. Otherwise each layer's first forward agrees on ``B`` (the largest ``T`` of any rank: one
exchange of route headers alone, ``B = 0``, and one host read), kept on the layer's dispatcher. A later forward
on a rank with more tokens than ``B``:

* with ``check_steps`` on (the default on CPU), every forward reads the route headers (one host read
  per layer): the ranks see the larger ``T`` together, agree on it as the new ``B`` and run the
  exchange again, never dropping a row;
* with ``check_steps`` off (sync-free: the default on accelerators, and what ``torch.compile`` traces
  whole), no rank reads anything: the route header carries the overflow, the rank that overflows
  raises ``ValueError`` and its peers a device-side assertion (``RuntimeError``), each right after
  that exchange, all naming the fix: ``static_tokens`` at least the largest batch.

The same header check turns ranks out of step (another layer, another forward) or in different
dtypes into an error on every rank (read on the host with ``check_steps``, else asserted on the
device, which on an accelerator surfaces as the device's assertion failure). A forward traced by
``torch.compile`` does not count calls (its header's call number is the one at tracing). The step
guard (:mod:`epmoe.ep.guard`, under a data-parallel wrapper) rides in the route header of the first
layer's forward (``link.guard``), read with it and handed to the layer (one host read per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from epmoe.comm.static import static_exchange, static_exchange_with
from epmoe.comm.steps import HEADER, OutOfStepError, check_headers, dtype_code, dtype_name, header_values
from epmoe.ep.counts import GUARD
from epmoe.ep.dispatch.base import Arrived, Dispatcher, Link, RoutedRows
from epmoe.ep.routing import GatherRows, SumRows, TokenRows, pair_rows, static_token_rows

ROUTE_HEAD = HEADER + 4 + GUARD  # step header, dtype code, B, the sender's T, its rows for the peer, guard
# the dtypes' header codes, computed once (torch.compile traces a lookup, not zlib)
_DTYPE_CODES = {dtype: dtype_code(dtype) for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}
FIX = (
    "set ExpertParallelConfig(static_tokens=N) with N at least every rank's largest batch (tokens per forward), "
    "or check_steps=True to let the ranks re-agree on the buffer"
)


@dataclass(frozen=True)
class StaticMeta:
    """One call of :class:`StaticDispatcher`: what :meth:`~StaticDispatcher.combine` reads."""

    arrived: Arrived
    rows: TokenRows | None  # the sender's rows, W blocks of B (None on a single rank: the rows are the tokens)
    group: dist.ProcessGroup | None  # the group the blocks travel on


class StaticDispatcher(Dispatcher):
    """Fixed-size buffers around the routed MLP (see the module docstring). ``block``: the buffer's
    ``B`` (``static_tokens``, else agreed at the first forward and kept). ``read_headers``: read the
    route headers on every forward whatever ``check_steps`` says (one host read per layer), so a
    batch that outgrows ``B`` always re-agrees (what :class:`DecodeDispatcher` runs). ``fit``: after
    a forward whose headers were read, ``B`` becomes the largest batch of that forward, which every
    rank read alike, so a buffer agreed for a prompt shrinks to the decode steps' batch.

    ``leader``: the dispatcher of an earlier layer of the same forwards (the model's first experts
    module), which reads the route headers on every forward: where this one reads nothing (no step
    checks), it takes the leader's ``B`` of the forward, agreed on the same tokens (every layer of a
    forward holds the same batch), so a model's forward costs one host read, not one per layer."""

    name = "static"
    needs_counts = False

    def __init__(
        self,
        static_tokens: int | None = None,
        *,
        read_headers: bool = False,
        fit: bool = False,
        leader: StaticDispatcher | None = None,
    ):
        self.fixed = static_tokens is not None
        self.block: int | None = static_tokens
        self.read_headers, self.fit, self.leader = read_headers, fit and static_tokens is None, leader

    def traced_whole(self, checks: bool) -> bool:
        """Without step checks (``check_steps`` off, or ``"auto"`` on an accelerator) and without
        :attr:`read_headers` (generate's decode steps) the call reads nothing to the host:
        ``torch.compile`` traces it whole."""
        return not (self.read_headers or checks)

    def dispatch(
        self, hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor, link: Link
    ) -> tuple[torch.Tensor, StaticMeta]:
        """``(x_RH, meta)``: the rows this rank's local experts run, ``W`` blocks of ``B`` by source
        rank (the rows of a group of one: the tokens)."""
        shard, channel = link.shard, link.channel
        if channel is None:
            pairs = pair_rows(top_k_index_TK, shard.num_experts)
            return hidden_TH, StaticMeta(Arrived(RoutedRows(top_k_weights_TK, pairs), pairs.counts_e), None, None)
        T, K = top_k_index_TK.shape
        e, W, H = shard.num_local_experts, channel.size, hidden_TH.shape[1]
        read = self.read_headers or link.checks or link.guard is not None
        if self.leader is not None and not read and self.leader.block is not None:
            self.block = self.leader.block  # this forward's, agreed by the leader on the same batches
        # the weights ride beside the rows in the wider dtype of the two: both arrive exact, with autograd
        carried = torch.promote_types(hidden_TH.dtype, top_k_weights_TK.dtype)
        peer_guards = None
        while True:
            B = self.block or 0
            rows, rows_W, sent_RX = _sent_rows(hidden_TH, top_k_index_TK, top_k_weights_TK, carried, e, W, B)
            route_WL = _route(link, hidden_TH.dtype, top_k_index_TK, rows, rows_W, B)
            received_WL, received_RX = static_exchange_with(route_WL, sent_RX, channel.group)
            if not (read or self.block is None):
                _assert_fits_or_raise(link, received_WL, hidden_TH.dtype, rows is None, T, B)
                break
            needed, peer_guards = _read_headers(link, received_WL, hidden_TH.dtype, B)
            if needed <= B:
                if self.fit:  # the next forward's buffer: this one's largest batch, read by every rank
                    self.block = max(needed, 1)
                break
            if self.fixed:
                raise ValueError(
                    f"epmoe: the static exchange's buffer holds static_tokens={B} tokens, an EP rank has {needed} "
                    f"in this forward (this is EP rank {channel.rank}, with {T}); {FIX}"
                )
            self.block = max(needed, 1)  # every rank saw it: agree on the larger buffer
        # each choice's local expert, e where it is another rank's or the row is padding (ids -1)
        expert_RK = received_WL[:, ROUTE_HEAD:].reshape(W * B, K)
        mine_RK = expert_RK.div(e, rounding_mode="floor") == shard.ep_rank
        pairs = pair_rows(torch.where(mine_RK, expert_RK - shard.local_start, e), e, padded=True)
        x_RH, weights_RK = received_RX[:, :H].to(hidden_TH.dtype), received_RX[:, H:].to(top_k_weights_TK.dtype)
        arrived = Arrived(RoutedRows(weights_RK, pairs), pairs.counts_e, peer_guards=peer_guards)
        return x_RH, StaticMeta(arrived, rows, channel.group)

    def combine(self, y_RH: torch.Tensor, meta: StaticMeta) -> torch.Tensor:
        """``(T, H)``: the blocks back to their senders, each token's rows summed in rank order."""
        if meta.rows is None:
            return y_RH
        return SumRows.apply(static_exchange(y_RH, meta.group), *meta.rows)


def _route(
    link: Link,
    dtype: torch.dtype,
    top_k_index_TK: torch.Tensor,
    rows: TokenRows | None,
    rows_W: torch.Tensor | None,
    B: int,
) -> torch.Tensor:
    """``(W, L)`` int64: the route block for each peer, ``L = ROUTE_HEAD + B*K``: the step header
    (its flag set where this rank's rows do not fit), the dtype, ``B``, this rank's ``T``, its rows
    for the peer, the guard's values, then each row's ``K`` expert ids (-1: padding)."""
    T, K = top_k_index_TK.shape
    W, device = link.channel.size, top_k_index_TK.device
    head = _device_ints(header_values(link.position, int(rows is None)) + [_DTYPE_CODES.get(dtype, 0), B, T], device)
    guard = link.guard if link.guard is not None else torch.zeros(GUARD, dtype=torch.int64, device=device)
    if rows is None:  # does not fit: the header alone, so every rank learns it
        rows_W = torch.zeros(W, dtype=torch.int64, device=device)
        ids_WL = torch.full((W, B * K), -1, dtype=torch.int64, device=device)
    else:
        padded_TK = torch.cat([top_k_index_TK, top_k_index_TK.new_full((1, K), -1)])
        ids_WL = padded_TK[rows.token_R].reshape(W, B * K)
    return torch.cat([head.expand(W, -1), rows_W.view(W, 1), guard.view(1, GUARD).expand(W, -1), ids_WL], dim=1)


def _read_headers(
    link: Link, received_WL: torch.Tensor, dtype: torch.dtype, B: int
) -> tuple[int, list[list[int]] | None]:
    """Read the received route headers to the host (one read) and raise on every rank where they
    differ from this rank's position (:func:`~epmoe.comm.steps.check_headers`), ``B`` or dtype;
    return the largest ``T`` of any rank and the peers' step-guard values (where they travel)."""
    channel, position = link.channel, link.position
    rows = received_WL[:, :ROUTE_HEAD].tolist()
    check_headers(rows, position, channel.rank, channel.layer_names)
    for source, row in enumerate(rows):
        if row[HEADER + 1] != B:
            raise OutOfStepError(
                f"epmoe: EP rank {source} sent a static route header of B={row[HEADER + 1]} while this rank (EP "
                f"rank {channel.rank}) runs B={B} at {position.describe(channel.layer_names)}: the ranks run "
                f"different collectives (a rank skipped or added one)"
            )
    dtypes = [row[HEADER] for row in rows]
    if len(set(dtypes)) > 1:
        raise ValueError(
            f"epmoe: the EP ranks run {position.describe(channel.layer_names)} in different dtypes: "
            f"{[dtype_name(d) for d in dtypes]} by rank (this is EP rank {channel.rank}); every rank must hold "
            f"the model in the same dtype (call model.to(dtype) on every rank)"
        )
    guards = [row[ROUTE_HEAD - GUARD :] for row in rows] if link.guard is not None else None
    return max(row[HEADER + 2] for row in rows), guards


def _assert_fits_or_raise(
    link: Link, received_WL: torch.Tensor, dtype: torch.dtype, outgrown: bool, T: int, B: int
) -> None:
    """Without a host read: this rank raises where its own batch outgrew ``B``; a device-side
    assertion fires where a peer's route header differs from this rank's position, ``B`` or dtype,
    or the peer's rows did not fit."""
    channel, position = link.channel, link.position
    if outgrown:
        raise ValueError(
            f"epmoe: this EP rank ({channel.rank}) has {T} tokens in this forward, more than the static "
            f"exchange's buffer of B={B} rows; its peers raise too: {FIX}"
        )
    expected = _device_ints(header_values(position) + [_DTYPE_CODES.get(dtype, 0), B], received_WL.device)
    ok = (received_WL[:, : HEADER + 2] == expected).all()  # the flag (0) says the peer's rows fit
    torch._assert_async(
        ok,
        f"epmoe: at {position.describe(channel.layer_names)}, an EP rank's static route header differs from this "
        f"rank's: a peer's batch outgrew the static exchange's buffer of B={B} rows, or the ranks are "
        f"out of step or in different dtypes; {FIX}",
    )


def _device_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``. Off the CPU each is filled in by a kernel (no
    copy from host memory, which a CUDA graph being captured refuses)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.int64)
    out = torch.empty(len(values), dtype=torch.int64, device=device)
    for i, value in enumerate(values):
        out[i].fill_(value)
    return out


class DecodeDispatcher:
    """``dispatch="auto"`` during one ``generate`` call (:meth:`ExpertParallelConfig.decodes_static`,
    installed by :mod:`epmoe.training.generate` for the call): the layer's first forward of the call
    (the prompt) on its own dispatcher ``prompt``, every later one (the decode steps) on ``decode``,
    a static exchange that reads its route headers on every forward (one host read per layer), so
    ``B``, agreed at the first decode step, re-agrees where a batch outgrows it and never raises for
    it. Every rank counts the same forwards (a generate call's ranks run them in lockstep), so every
    rank takes the same transport at the same forward. Not a transport itself: it chooses one per call
    (:meth:`for_call`, what the layer asks its ``transport`` for)."""

    name = "decode"

    def __init__(self, prompt: Dispatcher, decode: StaticDispatcher):
        self.prompt, self.decode = prompt, decode
        self.forwards = 0  # this layer's forwards in the generate call so far

    def for_call(self) -> Dispatcher:
        """The prompt's transport at the call's first forward, the static exchange after it."""
        transport = self.decode if self.forwards else self.prompt
        self.forwards += 1
        return transport.for_call()


def _sent_rows(
    hidden_TH: torch.Tensor,
    top_k_index_TK: torch.Tensor,
    top_k_weights_TK: torch.Tensor,
    carried: torch.dtype,
    e: int,
    W: int,
    B: int,
) -> tuple:
    """``(rows, rows_W, sent_RX)``: the ``W x B`` buffer rows to send, each token's hidden state and
    routing weights in ``carried`` (the wider dtype of the two); where the batch outgrows ``B``,
    ``(None, None, zeros)``: the header alone tells the peers, no row travels."""
    T, K = top_k_index_TK.shape
    if T > B:
        return None, None, hidden_TH.new_zeros(W * B, hidden_TH.shape[1] + K, dtype=carried)
    rows, rows_W = static_token_rows(top_k_index_TK, e, W, B)
    carried_TX = torch.cat([hidden_TH.to(carried), top_k_weights_TK.to(carried)], dim=1)
    return rows, rows_W, GatherRows.apply(carried_TX, None, *rows)
