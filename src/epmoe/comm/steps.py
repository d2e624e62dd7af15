"""Step agreement: EP ranks that fall out of step raise on every rank instead of aborting or hanging.

The ranks of an EP group must issue the same collectives in the same order with the same sizes. A
rank that skipped a backward, a layer or a step meets a different collective on its peers, which
gloo answers by killing a process (``SIGABRT``: the sizes differ) and a peer that raised and stayed
alive by a wait as long as the process group's timeout (30 minutes by default). So every collective
epmoe issues on the groups it creates for a model's EP (and ``"dp"``) traffic is a *header exchange*
or follows one within the same operation (backward and ``"dp"`` headers only where ``check_steps``
is on; checkpoint loading and DCP keep to the user's groups). A header exchange is one
``all_to_all_single`` of one int64 row per peer, the same row size for every header on that group::

    row sent to each peer:  [ MAGIC | layer | phase | call | flag | payload ... padded to width ]
                              \\____ Position ____/

    forward of experts module `layer`   the counts exchange is the header exchange: its payload is
                                        the counts for the peer's experts (free: it runs anyway)
    backward of that layer              an empty header before the layer's first backward exchange
    "dp" expert-gradient reduction      a header (payload: the element count) before each one
    clip_grad_norm_, save_pretrained    a header before their reductions / gathers (save_pretrained:
                                        and one after the writes, on the EP then the "dp" group)
    expert_load (telemetry)             the header exchange carries each rank's expert counts
    agreement (apply_expert_parallel,   each rank shows its peers what must match (named fields)
      the fused ops, loading)           and whether its own input failed: :meth:`StepChannel.agree`

Each rank receives every peer's header, so a mismatch raises :class:`OutOfStepError` on every rank,
naming both positions. ``call`` counts the layer's forwards (a backward carries the count of the
forward it differentiates), so a rank that skipped a whole step is caught at the next one. The
backward and reduction headers cost one small collective and one host read each: on by default
where the tensors are on the CPU, an option on accelerators (``ExpertParallelConfig.check_steps``).

Waiting is bounded by the group epmoe creates for EP at :func:`epmoe.apply_expert_parallel`
(:func:`step_group`): the same ranks and backend as the user's, with ``ExpertParallelConfig.timeout``
(300 s by default, well under the process group's 30 minutes), and nothing but epmoe on it. A
channel over the user's group (the agreements that run before that group exists, or without it)
waits on each header exchange at most the timeout it was given (``StepChannel(timeout_s=...)``).
"""

from __future__ import annotations

import datetime
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epmoe import platform

MAGIC = 0x65706D6F65  # "epmoe": a row that lacks it is not a header (the ranks' collectives differ)
HEADER = 5  # MAGIC, layer, phase, call, flag
DEFAULT_TIMEOUT_S = 300.0

FORWARD, BACKWARD, GRAD_REDUCE, CLIP, SAVE, COUNTS, TELEMETRY, AGREE = 1, 2, 3, 4, 5, 6, 7, 8
PHASES = {
    FORWARD: "forward",
    BACKWARD: "backward",
    GRAD_REDUCE: "expert-gradient reduction",
    CLIP: "clip_grad_norm_",
    SAVE: "save_pretrained",
    COUNTS: "exchange_counts",
    TELEMETRY: "expert_load",
    AGREE: "agreement",
}
MODEL_WIDE = -1  # the layer of a position that concerns the whole model (clip, save)


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype`` as an int a header can carry (:func:`dtype_name` reads it back)."""
    return zlib.crc32(str(dtype).encode())


def dtype_name(code: int) -> str:
    """The name of the dtype :func:`dtype_code` gave ``code``."""
    return _DTYPE_NAMES.get(code, f"dtype #{code}")


def value_code(value: object) -> int:
    """Any value's ``repr`` as an int a header can carry (equal values, equal codes)."""
    return zlib.crc32(repr(value).encode())


class _DtypeCodes(dict):
    """``dtype -> dtype_code(dtype)``, each computed at its first use and kept (read per layer call)."""

    def __missing__(self, dtype: torch.dtype) -> int:
        self[dtype] = code = dtype_code(dtype)
        return code


DTYPE_CODES = _DtypeCodes()
_DTYPE_NAMES = {
    DTYPE_CODES[d]: str(d)
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
}


class OutOfStepError(RuntimeError):
    """EP ranks reached different collectives: raised on every rank of the group, naming both positions."""


@dataclass(frozen=True)
class Position:
    """Where a rank is: experts module ``layer`` (its index in the model), ``phase``, and ``call``
    (the layer's forward count, or the count of a model-wide step)."""

    layer: int
    phase: int
    call: int

    def describe(self, layer_names: tuple[str, ...]) -> str:
        phase = PHASES.get(self.phase, f"phase {self.phase}")
        if self.layer == MODEL_WIDE:
            return f"{phase} #{self.call}"
        name = layer_names[self.layer] if 0 <= self.layer < len(layer_names) else f"layer {self.layer}"
        return f"{phase} of {name} (experts module {self.layer}), forward call #{self.call}"


def header_values(position: Position, flag: int = 0) -> list[int]:
    """The step header a rank at ``position`` sends: ``[MAGIC, layer, phase, call, flag]``."""
    return [MAGIC, position.layer, position.phase, position.call, flag]


def check_headers(
    rows: Sequence[Sequence[int]], position: Position, rank: int, layer_names: tuple[str, ...], what: str = "EP"
) -> None:
    """Raise :class:`OutOfStepError` (on every rank: each reads every peer's header) where a received
    row, by source rank, is not a step header or names another position than this rank's
    ``position`` (``rank``: this rank's, in the group of ``what``)."""
    for source, row in enumerate(rows):
        if row[0] != MAGIC:
            raise OutOfStepError(
                f"epmoe: {what} rank {source} sent something other than a step header while this rank "
                f"({what} rank {rank}) is at {position.describe(layer_names)}: the ranks run "
                f"different collectives (a rank skipped or added one)"
            )
        theirs = Position(*row[1 : HEADER - 1])
        if theirs != position:
            raise OutOfStepError(
                f"epmoe: {what} ranks are out of step: this rank ({what} rank {rank}) is at "
                f"{position.describe(layer_names)}, {what} rank {source} is at "
                f"{theirs.describe(layer_names)}. Every rank of the group must run the same forwards and "
                f"backwards of the model, in the same order (no rank may skip a backward, a layer or a step)"
            )


def world_size(group: dist.ProcessGroup | None = None, caller: str | None = None) -> int:
    """Ranks in ``group`` (the default group for ``None``); 1 without ``torch.distributed``, where a
    given ``group`` is an error naming ``caller(group)``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    if group is not None and caller is not None:
        raise ValueError(f"{caller}(group): a process group was given but torch.distributed is not initialised")
    return 1


def group_timeout_s(group: dist.ProcessGroup | None) -> float | None:
    """The timeout ``group``'s collectives wait (``None`` where the backend does not say)."""
    group = group if group is not None else dist.group.WORLD
    try:
        backend = group._get_backend(platform.group_device(group))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError):  # a backend without options (e.g. a custom one)
        return None


def step_timeout_s(configured: float | None, group: dist.ProcessGroup | None) -> float:
    """How long an EP collective waits: ``configured`` (``ExpertParallelConfig.timeout``), else
    :data:`DEFAULT_TIMEOUT_S` or ``group``'s own timeout, whichever is shorter (a user who shortened
    the process group's timeout gets no longer waits from epmoe)."""
    if configured is not None:
        return float(configured)
    own = group_timeout_s(group)
    return min(DEFAULT_TIMEOUT_S, own) if own else DEFAULT_TIMEOUT_S


def step_group(group: dist.ProcessGroup | None, timeout_s: float) -> dist.ProcessGroup:
    """A new process group over ``group``'s ranks, with ``group``'s backend and a ``timeout_s``
    timeout, created by those ranks alone (every EP group of a mesh creates its own).

    torch names a group its ranks create alone from the ranks and from how many groups the process
    knows; ranks with different histories (a pair that made its own EP model before) would compute
    different names and wait for each other until the timeout. So the ranks first agree on the
    largest such number (one agreement step on ``group``) and the others catch up with groups of
    one rank (local, nothing exchanged): the name then depends on the ranks alone."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    known = len(dist.distributed_c10d._world.pg_names)  # what torch hashes into a local group's name
    channel = StepChannel(group, 1, timeout_s=timeout_s)
    rows = channel.agree(Position(MODEL_WIDE, AGREE, 0), platform.group_device(group), [], [known])
    for _ in range(max(row[0] for row in rows) - known):
        dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
    return dist.new_group(
        ranks,
        timeout=datetime.timedelta(seconds=timeout_s),
        backend=dist.get_backend(group),
        use_local_synchronization=True,
    )


def step_subgroups(
    group: dist.ProcessGroup | None, parts: list[list[int]], timeout_s: float
) -> list[dist.ProcessGroup]:
    """New process groups over ``parts`` (lists of ``group``'s group ranks, each holding this rank),
    with ``group``'s backend and a ``timeout_s`` timeout, each created by its ranks alone, in order:
    every rank of ``group`` must call it with as many parts (one agreement step on ``group`` first, as
    :func:`step_group`, so that the groups' names depend on their ranks alone)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    known = len(dist.distributed_c10d._world.pg_names)
    channel = StepChannel(group, 1, timeout_s=timeout_s)
    rows = channel.agree(Position(MODEL_WIDE, AGREE, 0), platform.group_device(group), [], [known])
    for _ in range(max(row[0] for row in rows) - known):
        dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
    return [
        dist.new_group(
            [ranks[r] for r in part],
            timeout=datetime.timedelta(seconds=timeout_s),
            backend=dist.get_backend(group),
            use_local_synchronization=True,
        )
        for part in parts
    ]


class StepChannel:
    """One group's header exchanges (see the module docstring). ``width``: payload values per row,
    fixed for the group; ``layer_names``: the model's experts modules, for error messages;
    ``timeout_s``: the longest an exchange may wait (``None``: the group's own timeout), by the
    group's own timeout where that is not longer (:func:`step_group`'s), else by waiting on the
    collective at most that long (a channel over the user's group)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        width: int,
        layer_names: tuple[str, ...] = (),
        timeout_s: float | None = None,
        what: str = "EP",
    ):
        self.group, self.width, self.layer_names, self.timeout_s, self.what = group, width, layer_names, timeout_s, what
        own = group_timeout_s(group) if timeout_s is not None else None
        # a group whose own timeout is longer (the user's): each exchange waits at most timeout_s itself
        self.wait_s = timeout_s if timeout_s is not None and (own is None or own > timeout_s + 1e-3) else None
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.calls: dict[int, int] = {}  # model-wide phase -> how many have run

    def __deepcopy__(self, memo: dict) -> StepChannel:
        """A deep copy of a model shares its channels: a process group is one per set of ranks, and
        the copy's collectives are the same ranks' (every rank copies alike)."""
        return self

    def next_call(self, phase: int) -> Position:
        """The position of this rank's next model-wide ``phase`` (clip, save)."""
        self.calls[phase] = self.calls.get(phase, 0) + 1
        return Position(MODEL_WIDE, phase, self.calls[phase])

    def exchange(
        self, position: Position, payload_Wn: torch.Tensor, flag: torch.Tensor | None = None, *, echo: bool = False
    ) -> tuple[list[list[int]], ...]:
        """Send ``payload_Wn[r]`` (``(W, n)`` int64, ``n <= width``, on the group's device) to rank
        ``r`` with this rank's header; return ``(payloads received per source, flags per source)``
        once every header matched. ``flag``: a 0-d integer tensor on the same device (no host read).
        With ``echo``, ``payload_Wn`` comes back on the host too, as a third item, read with the
        received rows (one host read in all)."""
        W, n = payload_Wn.shape
        device = payload_Wn.device
        head = torch.tensor(header_values(position), dtype=torch.int64)
        rows = torch.cat(
            [
                platform.host_to_device(head, device).expand(W, HEADER),
                payload_Wn.to(torch.int64),
                payload_Wn.new_zeros(W, self.width - n, dtype=torch.int64),
            ],
            dim=1,
        )
        if flag is not None:
            rows[:, HEADER - 1] = flag
        received = torch.empty_like(rows)
        try:
            if self.wait_s is None:  # the group's own timeout bounds the wait (epmoe's step groups)
                dist.all_to_all_single(received.view(-1), rows.view(-1), group=self.group)
            else:
                work = dist.all_to_all_single(received.view(-1), rows.view(-1), group=self.group, async_op=True)
                work.wait(datetime.timedelta(seconds=self.wait_s))
            platform.synchronize(device)  # the collective may run on its own stream (HCCL)
        except RuntimeError as exc:
            raise self.failed(position, exc) from exc
        got = torch.cat([received, rows]).tolist() if echo else received.tolist()
        got, sent = got[:W], got[W:]
        check_headers(got, position, self.rank, self.layer_names, self.what)
        payloads, flags = [row[HEADER : HEADER + n] for row in got], [row[HEADER - 1] for row in got]
        return (payloads, flags, [row[HEADER : HEADER + n] for row in sent]) if echo else (payloads, flags)

    def check(self, position: Position, device: torch.device, payload: list[int] = ()) -> None:
        """A header exchange carrying the same ``payload`` to every peer, which must send the same."""
        payload = list(payload)
        rows = torch.tensor([payload] * self.size, dtype=torch.int64).reshape(self.size, len(payload))
        rows = platform.host_to_device(rows, device)
        received, _ = self.exchange(position, rows)
        for source, theirs in enumerate(received):
            if theirs != payload:
                raise OutOfStepError(
                    f"epmoe: at {position.describe(self.layer_names)}, {self.what} rank {source} has {theirs} "
                    f"where this rank ({self.what} rank {self.rank}) has {payload}: the ranks differ in what they "
                    f"reduce (e.g. parameters frozen on some ranks only)"
                )

    def agree(
        self,
        position: Position,
        device: torch.device,
        fields: Sequence[tuple[str, int]],
        extra: Sequence[int] = (),
        *,
        failed: bool = False,
        caller: str = "epmoe",
        show: Callable[[str, int], object] | None = None,
        what_failed: str = "rejected their input",
    ) -> list[list[int]]:
        """The agreement step: validate, then agree, then change anything.

        One header exchange in which every rank shows every peer the same row: its ``fields``
        (``(name, value)``; the names and their number the same on every rank), then ``extra``
        values (the same number on every rank, not compared), its flag set where ``failed`` (this
        rank rejected its own input: it should raise its own error once this returns). Raises
        ``ValueError`` on every other rank naming the ranks that failed (``what_failed``: what they
        found), else on every rank naming
        the first field whose values differ (``show(name, value)`` renders a value, ``None`` for a
        value that means nothing to a reader, such as a hash: the message then names the field
        only). Returns every rank's ``fields`` values and ``extra``, by rank.
        """
        row = [value for _, value in fields] + list(extra)
        payload = platform.host_to_device(torch.tensor(row, dtype=torch.int64).expand(self.size, len(row)), device)
        flag = platform.host_to_device(torch.tensor(int(failed), dtype=torch.int64), device)
        received, flags = self.exchange(position, payload, flag)
        if failed:
            return received
        bad = [rank for rank, theirs in enumerate(flags) if theirs]
        if bad:
            raise ValueError(
                f"{caller}: {self.what} rank(s) {bad} {what_failed} (see their error); no rank "
                f"goes on (this is {self.what} rank {self.rank})"
            )
        for index, (name, _) in enumerate(fields):
            values = [theirs[index] for theirs in received]
            if len(set(values)) > 1:
                shown = [show(name, v) for v in values] if show is not None else values
                by_rank = f": {shown} by rank" if None not in shown else ""
                raise ValueError(
                    f"{caller}: the {self.what} ranks disagree on the {name}{by_rank} (this is "
                    f"{self.what} rank {self.rank})"
                )
        return received

    def all_reduce(
        self,
        tensor: torch.Tensor,
        position: Position,
        *,
        op=dist.ReduceOp.SUM,
        header: bool = True,
        async_op: bool = False,
    ):
        """``tensor`` reduced in place over the group, after a header at ``position`` carrying its
        element count (unless ``header`` is off); a failure or timeout raises :meth:`failed`'s error."""
        if header:
            self.check(position, tensor.device, [tensor.numel()])
        try:
            return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)
        except RuntimeError as exc:
            raise self.failed(position, exc) from exc

    def failed(self, position: Position, exc: BaseException) -> RuntimeError:
        """The error a failed or timed-out collective of this group becomes."""
        bound = (
            "the process group's timeout bounds the wait"
            if self.timeout_s is None
            else f"epmoe waits at most ExpertParallelConfig.timeout = {self.timeout_s:g} s"
        )
        return RuntimeError(
            f"epmoe: {self.what} rank {self.rank}: a collective of the {self.what} group failed at "
            f"{position.describe(self.layer_names)}: another rank died, raised, or is out of step ({bound}): {exc}"
        )


class BackwardHeader(torch.autograd.Function):
    """``BackwardHeader.apply(x, channel, position)``: ``x`` unchanged; the backward through it starts
    with a header exchange at ``position`` (put it on the output of a layer's last exchange: it then
    runs before the layer's backward exchanges; only where ``x`` requires a gradient)."""

    @staticmethod
    def forward(ctx, x, channel, position):
        ctx.channel, ctx.position = channel, position
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        ctx.channel.check(ctx.position, dx.device)
        return dx, None, None


def checks_on(setting: bool | str, device: torch.device | str) -> bool:
    """Whether the optional header exchanges run for tensors on ``device`` (a device or its type;
    ``setting``: ``check_steps``)."""
    return setting if isinstance(setting, bool) else (device if isinstance(device, str) else device.type) == "cpu"


class StepChecks(dict):
    """``device type -> checks_on(setting, it)`` (what a layer's forward reads): decided when made for
    the usual device types, so that a forward ``torch.compile`` traces only reads it, and at first
    use for any other."""

    def __init__(self, setting: bool | str):
        super().__init__((kind, checks_on(setting, kind)) for kind in ("cpu", "cuda", "npu", "xpu", "mps"))
        self.setting = setting

    def __missing__(self, kind: str) -> bool:
        self[kind] = on = checks_on(self.setting, kind)
        return on
