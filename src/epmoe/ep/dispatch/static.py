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
layer's forward and is read there (one host read per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from epmoe.comm.static import static_exchange, static_exchange_with
from epmoe.comm.steps import (
    FORWARD,
    HEADER,
    MAGIC,
    OutOfStepError,
    Position,
    StepChannel,
    checks_on,
    dtype_code,
    dtype_name,
)
from epmoe.ep.config import ExpertParallelConfig
from epmoe.ep.dispatch.base import Dispatcher, SharedExpert
from epmoe.ep.experts import WeightsHook
from epmoe.ep.guard import check as check_guard
from epmoe.ep.recognize import linear_triples, per_expert_post, shared_parameters
from epmoe.ep.routing import GatherRows, RowPairs, SumRows, TokenRows, pair_rows, static_token_rows
from epmoe.ep.state import ExpertParallelState

GUARD = 2  # the step guard's values in each route header (zeros where it does not run)
ROUTE_HEAD = HEADER + 4 + GUARD  # step header, dtype code, B, the sender's T, its rows for the peer, guard
# the dtypes' header codes, computed once (torch.compile traces a lookup, not zlib)
_DTYPE_CODES = {dtype: dtype_code(dtype) for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}
FIX = (
    "set ExpertParallelConfig(static_tokens=N) with N at least every rank's largest batch (tokens per forward), "
    "or check_steps=True to let the ranks re-agree on the buffer"
)


@dataclass(frozen=True)
class StaticMeta:
    """One call of :class:`StaticDispatcher`: what :meth:`~StaticDispatcher.experts` and
    :meth:`~StaticDispatcher.combine` read."""

    rows: TokenRows | None  # the sender's rows, W blocks of B (None on a single rank: the rows are the tokens)
    weights_RK: torch.Tensor  # (R, K) the received rows' routing weights (R = W*B)
    pairs: RowPairs  # the pairs the received rows expand to, expert-major, padded
    group: dist.ProcessGroup | None  # the group the blocks travel on
    weights_hook: WeightsHook | None  # the experts' gradient policy for this call (_link)


@dataclass(frozen=True)
class _Link:
    """What the static exchange needs of the model's EP step machinery and gradient policy (read in
    one place, :func:`_link`)."""

    channel: StepChannel | None  # the model's EP step channel (None on a single rank)
    guard: torch.Tensor | None  # (GUARD,) the step guard's values this forward sends, where it runs
    weights_hook: WeightsHook | None  # the experts' gradient policy (None: nothing to hook)


def _link(state: ExpertParallelState, device: torch.device) -> _Link:
    """The model's EP step channel, the step guard's values where this forward carries them, and the
    experts' gradient policy (``state.sync_weights``), except while ``torch.compile`` traces a model
    that no data-parallel wrapper runs (none seen, no DDP or FSDP2 around it) and whose expert
    gradients epmoe leaves as they are (summed by the exchanges' backward): nothing to hook then
    (:func:`epmoe.apply_expert_parallel` marked the expert parameters), and the policy's Python (a
    walk of the autograd graph, a log line) would break the graph."""
    model, compiling = state.model, torch.compiler.is_compiling()
    policy = model.policy
    guarded = state.layer == 0 and model.guarded and not compiling
    hook = state.sync_weights
    if compiling and not policy.finishes and not model.guarded and not model.wrapped_now():
        hook = None
    return _Link(model.channel, model.guard_payload(device) if guarded else None, hook)


class StaticDispatcher(Dispatcher):
    """Fixed-size buffers around ``epmoe::routed_mlp`` (see the module docstring). ``block``: the
    buffer's ``B`` (``static_tokens``, else agreed at the first forward and kept). ``read_headers``:
    read the route headers on every forward whatever ``check_steps`` says (one host read per layer),
    so a batch that outgrows ``B`` always re-agrees (what :class:`DecodeDispatcher` runs)."""

    name = "static"

    def __init__(self, experts: nn.Module, config: ExpertParallelConfig, *, read_headers: bool = False):
        self.fixed = config.static_tokens is not None
        self.block: int | None = config.static_tokens
        self.read_headers = read_headers

    @staticmethod
    def ineligible_reason(experts: nn.Module) -> str | None:
        """Why the static transport cannot run ``experts`` (``None``: it can): it needs the routed MLP
        op, whose grouped matmuls take device counts (packed experts without a norm after the down
        projection, or ``nn.ModuleList`` experts of Linear triples)."""
        if isinstance(experts, nn.ModuleList):
            if linear_triples(experts) is None:
                return "its experts run their own forwards, which slice their rows by counts read to the host"
            return None
        if getattr(experts, "has_post_expert_norm", False) or per_expert_post(experts) is not None:
            return "a norm after the down projection runs outside the routed MLP op"
        if shared_parameters(experts):
            return "parameters shared by every expert run outside the routed MLP op"
        return None

    def traced_whole(self, state: ExpertParallelState) -> bool:
        """Without step checks (``check_steps`` off, or ``"auto"`` on an accelerator) and without
        :attr:`read_headers` (generate's decode steps) the call reads nothing to the host:
        ``torch.compile`` traces it whole."""
        device = next(state.local_experts.parameters()).device
        return not (self.read_headers or checks_on(state.model.config.check_steps, device))

    def dispatch(
        self,
        state: ExpertParallelState,
        hidden_TH: torch.Tensor,
        top_k_index_TK: torch.Tensor,
        top_k_weights_TK: torch.Tensor,
        shared: SharedExpert | None = None,
    ) -> tuple[torch.Tensor, StaticMeta]:
        """``(x_RH, meta)``: the rows this rank's local experts run, ``W`` blocks of ``B`` by source
        rank (the rows of a group of one: the tokens)."""
        shard = state.shard
        link = _link(state, hidden_TH.device)
        if link.channel is None:
            pairs = pair_rows(top_k_index_TK, shard.num_experts)
            state.count_load(pairs.counts_e)
            return hidden_TH, StaticMeta(None, top_k_weights_TK, pairs, None, link.weights_hook)
        if not torch.compiler.is_compiling():
            state.calls += 1
        position = state.position(FORWARD)
        T, K = top_k_index_TK.shape
        e, W = shard.num_local_experts, link.channel.size
        read = (
            self.read_headers or checks_on(state.model.config.check_steps, hidden_TH.device) or link.guard is not None
        )
        # the weights ride beside the rows in the wider dtype of the two: both arrive exact, with autograd
        carried = torch.promote_types(hidden_TH.dtype, top_k_weights_TK.dtype)
        H = hidden_TH.shape[1]
        while True:
            B = self.block or 0
            rows, rows_W, sent_RX = _sent_rows(hidden_TH, top_k_index_TK, top_k_weights_TK, carried, e, W, B)
            route_WL = self._route(link, position, hidden_TH.dtype, top_k_index_TK, rows, rows_W, B)
            received_WL, received_RX = static_exchange_with(route_WL, sent_RX, link.channel.group)
            if read or self.block is None:
                needed = self._read_headers(link, position, received_WL, hidden_TH.dtype, B)
                if needed > B and not self.fixed:  # every rank saw it: agree on the larger buffer
                    self.block = max(needed, 1)
                    continue
                if needed > B:
                    raise ValueError(
                        f"epmoe: the static exchange's buffer holds static_tokens={B} tokens, an EP rank "
                        f"has {needed} in this forward (this is EP rank {link.channel.rank}, with {T}); "
                        f"{FIX}"
                    )
            else:
                if rows is None:  # the batch outgrew the buffer
                    raise ValueError(
                        f"epmoe: this EP rank ({link.channel.rank}) has {T} tokens in this forward, more "
                        f"than the static exchange's buffer of B={B} rows; its peers raise too: {FIX}"
                    )
                self._assert_headers(link, position, received_WL, hidden_TH.dtype, B)
            break
        # each choice's local expert, e where it is another rank's or the row is padding (ids -1)
        expert_RK = received_WL[:, ROUTE_HEAD:].reshape(W * B, K)
        mine_RK = expert_RK.div(e, rounding_mode="floor") == shard.ep_rank
        local_RK = torch.where(mine_RK, expert_RK - shard.local_start, e)
        pairs = pair_rows(local_RK, e, padded=True)
        state.count_load(pairs.counts_e)
        x_RH, weights_RK = received_RX[:, :H].to(hidden_TH.dtype), received_RX[:, H:].to(top_k_weights_TK.dtype)
        return x_RH, StaticMeta(rows, weights_RK, pairs, link.channel.group, link.weights_hook)

    def experts(self, state: ExpertParallelState, x_RH: torch.Tensor, meta: StaticMeta) -> torch.Tensor:
        """``(R, H)``: the local experts on the rows' pairs, weighted and summed per row (zero rows for
        padding)."""
        return state.experts.routed_mlp(x_RH, meta.weights_RK, meta.pairs, sync_weights=meta.weights_hook)

    def combine(self, state: ExpertParallelState, y_RH: torch.Tensor, meta: StaticMeta) -> torch.Tensor:
        """``(T, H)``: the blocks back to their senders, each token's rows summed in rank order; its
        backward checked to start at this layer's position where ``check_steps`` says so."""
        if meta.rows is None:
            return state.backward_header(y_RH)
        return state.backward_header(SumRows.apply(static_exchange(y_RH, meta.group), *meta.rows))

    @staticmethod
    def _route(
        link: _Link,
        position: Position,
        dtype: torch.dtype,
        top_k_index_TK: torch.Tensor,
        rows: TokenRows | None,
        rows_W: torch.Tensor | None,
        B: int,
    ) -> torch.Tensor:
        """``(W, L)`` int64: the route block for each peer, ``L = ROUTE_HEAD + B*K``: the step header
        (its flag set where this rank's rows do not fit), the dtype, ``B``, this rank's ``T``, its
        rows for the peer, the guard's values, then each row's ``K`` expert ids (-1: padding)."""
        T, K = top_k_index_TK.shape
        W, device = link.channel.size, top_k_index_TK.device
        head = _device_ints(
            [MAGIC, position.layer, position.phase, position.call, int(rows is None), _DTYPE_CODES.get(dtype, 0), B, T],
            device,
        )
        guard = link.guard if link.guard is not None else torch.zeros(GUARD, dtype=torch.int64, device=device)
        if rows is None:  # does not fit: the header alone, so every rank learns it
            rows_W, ids_WL = (
                torch.zeros(W, dtype=torch.int64, device=device),
                torch.full((W, B * K), -1, dtype=torch.int64, device=device),
            )
        else:
            padded_TK = torch.cat([top_k_index_TK.long(), top_k_index_TK.new_full((1, K), -1, dtype=torch.int64)])
            ids_WL = padded_TK[rows.token_R].reshape(W, B * K)
        return torch.cat([head.expand(W, -1), rows_W.view(W, 1), guard.view(1, GUARD).expand(W, -1), ids_WL], dim=1)

    @staticmethod
    def _read_headers(link: _Link, position: Position, received_WL: torch.Tensor, dtype: torch.dtype, B: int) -> int:
        """Read the received route headers to the host (one read) and raise on every rank where they
        differ from this rank's position, ``B`` or dtype, or the step guard fires; return the largest
        ``T`` of any rank."""
        channel = link.channel
        rows = received_WL[:, :ROUTE_HEAD].tolist()
        for source, row in enumerate(rows):
            if row[0] != MAGIC or row[6] != B:
                raise OutOfStepError(
                    f"epmoe: EP rank {source} sent something other than a static route header of B={B} while this "
                    f"rank (EP rank {channel.rank}) is at {position.describe(channel.layer_names)}: the ranks run "
                    f"different collectives (a rank skipped or added one)"
                )
            theirs = Position(*row[1 : HEADER - 1])
            if theirs != position:
                raise OutOfStepError(
                    f"epmoe: EP ranks are out of step: this rank (EP rank {channel.rank}) is at "
                    f"{position.describe(channel.layer_names)}, EP rank {source} is at "
                    f"{theirs.describe(channel.layer_names)}. Every rank of the group must run the same forwards and "
                    f"backwards of the model, in the same order (no rank may skip a backward, a layer or a step)"
                )
        dtypes = [row[HEADER] for row in rows]
        if len(set(dtypes)) > 1:
            raise ValueError(
                f"epmoe: the EP ranks run {position.describe(channel.layer_names)} in different dtypes: "
                f"{[dtype_name(d) for d in dtypes]} by rank (this is EP rank {channel.rank}); every rank must hold "
                f"the model in the same dtype (call model.to(dtype) on every rank)"
            )
        if link.guard is not None:
            check_guard([row[ROUTE_HEAD - GUARD :] for row in rows], position.describe(channel.layer_names))
        return max(row[HEADER + 2] for row in rows)

    @staticmethod
    def _assert_headers(link: _Link, position: Position, received_WL: torch.Tensor, dtype: torch.dtype, B: int) -> None:
        """The same checks on the device, no host read: a device-side assertion where a peer's route
        header differs from this rank's position, ``B`` or dtype, or its rows did not fit."""
        expected = _device_ints(
            [MAGIC, position.layer, position.phase, position.call, 0, _DTYPE_CODES.get(dtype, 0), B], received_WL.device
        )
        ok = (received_WL[:, : HEADER + 2] == expected).all()  # the flag (0) says the peer's rows fit
        where = position.describe(link.channel.layer_names)
        torch._assert_async(
            ok,
            f"epmoe: at {where}, an EP rank's static route header differs from this rank's: "
            f"a peer's batch outgrew the static exchange's buffer of B={B} rows, or the ranks are "
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


class DecodeDispatcher(Dispatcher):
    """``dispatch="auto"`` during one ``generate`` call (:meth:`ExpertParallelConfig.decodes_static`,
    installed by :mod:`epmoe.training.generate` for the call): the layer's first forward of the call
    (the prompt) on its own dispatcher ``prompt``, every later one (the decode steps) on ``decode``,
    a static exchange that reads its route headers on every forward (one host read per layer), so
    ``B``, agreed at the first decode step, re-agrees where a batch outgrows it and never raises for
    it. Every rank counts the same forwards (a generate call's ranks run them in lockstep), so every
    rank takes the same transport at the same forward."""

    name = "decode"

    def __init__(self, prompt: Dispatcher, decode: StaticDispatcher):
        self.prompt, self.decode = prompt, decode
        self.forwards = 0  # this layer's forwards in the generate call so far

    def dispatch(
        self,
        state: ExpertParallelState,
        hidden_TH: torch.Tensor,
        top_k_index_TK: torch.Tensor,
        top_k_weights_TK: torch.Tensor,
        shared: SharedExpert | None = None,
    ) -> tuple[torch.Tensor, object]:
        """The prompt's transport at the call's first forward, the static exchange after it."""
        transport = self.decode if self.forwards else self.prompt
        self.forwards += 1
        return transport.dispatch(state, hidden_TH, top_k_index_TK, top_k_weights_TK, shared)

    def experts(self, state: ExpertParallelState, rows: torch.Tensor, meta: object) -> torch.Tensor:
        return self._of(meta).experts(state, rows, meta)

    def combine(self, state: ExpertParallelState, out_rows: torch.Tensor, meta: object) -> torch.Tensor:
        return self._of(meta).combine(state, out_rows, meta)

    def _of(self, meta: object) -> Dispatcher:
        """The transport whose :meth:`dispatch` made ``meta``."""
        return self.decode if isinstance(meta, StaticMeta) else self.prompt


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
