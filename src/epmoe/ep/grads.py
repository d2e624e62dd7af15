"""How expert gradients are finished: reduced over the ``"dp"`` replicas, then summed or averaged.

After the backward all-to-all-v, an expert's weight gradient on its EP rank is the sum over every
EP rank's tokens routed to it (the unsharded model on the concatenated batch). Two things can
remain, both done inside the backward by :class:`_ExpertGradSync`, once per experts module (one
flat buffer: one collective per module per backward, started as soon as the module's gradients
exist and, for packed experts, waited for only at the end of the backward, so it overlaps with the
backward of the layers below):

    EP x DP mesh ("dp", "ep") = (2, 2)        expert block 0 lives on ranks 0 and 2

               ep rank 0   ep rank 1           after the exchange: rank 0 holds sum over ranks {0, 1}
    dp row 0   rank 0      rank 1              all-reduce over "dp" {0, 2}: sum over all 4 ranks
    dp row 1   rank 2      rank 3              then x 1/4 where expert_grad resolves to "mean"

``expert_grad``:

* ``"sum"``: expert gradients are the unsharded model's on the concatenation of every rank's batch.
* ``"mean"``: divided by the data-parallel size ``D = ep_size * dp_size`` (every rank whose tokens
  reach an expert), which is what DDP and FSDP2 do to every other gradient: the gradient of the
  mean over ranks of each rank's loss.
* ``"auto"``: ``"mean"`` once the model runs under ``DistributedDataParallel``, FSDP2
  (``fully_shard`` on the model or a module around the experts) or a Trainer prepared by
  :func:`epmoe.prepare_trainer`; ``"sum"`` otherwise. Decided at each forward of the model (the
  wrappers are seen by its :class:`~epmoe.ep.model.EPModel`, so a model wrapped after a first
  forward is handled), never back from ``"mean"`` (a recomputed forward under gradient
  checkpointing runs outside DDP's forward), and logged (one INFO line) when it changes.

Every backward reduces its own contribution (also under DDP's ``no_sync``, whose skipped
all-reduce concerns the other parameters), so gradient accumulation needs nothing special. Experts
whose weights are computed (PEFT LoRA on them, a ``ModuleList``'s stacked Linears) are reduced
inside the backward before flowing on (:func:`finish_weights`); experts run by their own forward,
per parameter by a gradient hook (:func:`register_param_hooks`).

A wrapper that reduces expert gradients itself over the ``"dp"`` replicas and divides them by the
data-parallel size (DeepSpeed's expert-data-parallel reduction, :mod:`epmoe.training.deepspeed`)
takes both over (:meth:`ExpertGradPolicy.hand_over`): epmoe then leaves the gradients as the
exchange made them, and the reducer's mean is ``"mean"``.

This module holds the policy only; which wrapper runs the model, and the step guard armed while a
backward finishes expert gradients (``arm`` below), are the model's (:mod:`epmoe.ep.model`).

**Parameters shared by the experts** (inside an experts module but not per expert: a norm after
the down projection such as MuseSpark's ``post_expert_norm``, a scale, a bias;
:func:`~epmoe.ep.recognize.shared_parameters`) are not expert parameters: EP leaves them whole on
every rank, and they get the unsharded model's gradient on the rank's own batch, which data-parallel
wrappers then average like any other. An expert's rank computes them on rows from every rank, so a
forward over more than one rank runs them once per source rank on that rank's rows, each run on its
own view of the parameter (:func:`shared_by_source`); in backward one all-to-all over the EP group
(``W`` x their size, per layer) sends each source rank the gradient its rows gave::

    rank 0 computes rows of ranks 0, 1:  g00 g01      rank 0 gets g00 + g10   (its own batch's)
    rank 1 computes rows of ranks 0, 1:  g10 g11      rank 1 gets g01 + g11
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from epmoe.comm.all_to_all import all_to_all_v
from epmoe.comm.steps import Position, StepChannel, checks_on, world_size
from epmoe.errors import double_backward_error

logger = logging.getLogger(__name__)

Arm = Callable[[], None]  # called in a backward that finishes expert gradients (the model's step guard)


class ExpertGradPolicy:
    """The gradient policy of one model's experts (held by its :class:`~epmoe.ep.model.EPModel`).

    ``mode``: ``ExpertParallelConfig.expert_grad``; ``ep_size``: the EP group's size; ``dp_channel`` /
    ``dp_size``: the step channel of the ``"dp"`` replicas of this rank's experts (``None`` / 1
    without an EP x DP mesh; see :mod:`epmoe.comm.steps`); ``check_steps``:
    ``ExpertParallelConfig.check_steps``, whether each ``"dp"`` reduction starts with a step header.
    """

    def __init__(
        self, mode: str, ep_size: int, dp_channel: StepChannel | None, dp_size: int, check_steps: bool | str = "auto"
    ):
        self.mode = mode
        self.ep_size = ep_size
        self.dp_channel, self.dp_size = dp_channel, dp_size
        self.check_steps = check_steps
        self.wrapper: str | None = None  # what made "auto" resolve to "mean" (sticky)
        self.reducer: str | None = None  # a wrapper that reduces and averages the expert gradients itself
        self._logged: str | None = None
        self._pending: list[tuple] = []  # "dp" all-reduces in flight in this backward
        self._queued = False  # whether this backward's _land is queued
        self._decide()

    def __deepcopy__(self, memo: dict) -> ExpertGradPolicy:
        """The policy of a deep copy of the model: the same mode, channel and wrapper decision, no
        reduction in flight."""
        copied = ExpertGradPolicy(self.mode, self.ep_size, self.dp_channel, self.dp_size, self.check_steps)
        copied.wrapper, copied._logged, copied.reducer = self.wrapper, self._logged, self.reducer
        copied._decide()
        return copied

    @property
    def data_parallel_size(self) -> int:
        """``D``: the ranks whose tokens an expert's gradient sums over once reduced over ``"dp"``."""
        return self.ep_size * self.dp_size

    @property
    def resolved(self) -> str:
        """``"sum"`` or ``"mean"``: what ``mode`` means now."""
        if self.mode != "auto":
            return self.mode
        return "mean" if self.wrapper is not None else "sum"

    @property
    def scale(self) -> float:
        return 1.0 / self.data_parallel_size if self.resolved == "mean" and self.reducer is None else 1.0

    def _decide(self) -> None:
        """What every layer's forward reads, decided again whenever the wrapper or the reducer changes
        (nothing else that it depends on does): ``finishes``, whether epmoe itself has anything to do
        to the gradients after the exchange (sharded experts only: a reduction over ``"dp"``, or the
        division of ``"mean"``, :attr:`scale`); ``guards``, whether the model's step guard may check
        (sharded experts under a data-parallel wrapper whose expert gradients epmoe finishes)."""
        self.finishes = self.ep_size > 1 and self.reducer is None and (self.dp_size > 1 or self.resolved == "mean")
        self.guards = self.ep_size > 1 and self.wrapper is not None and self.reducer is None

    def set_wrapper(self, wrapper: str) -> None:
        """Record a data-parallel wrapper (DDP, FSDP2, Trainer): ``"auto"`` means ``"mean"`` from now on."""
        if self.wrapper is None:
            world = world_size()
            if world != self.data_parallel_size:
                raise ValueError(
                    f"epmoe: {wrapper} runs over {world} ranks but the experts are sharded over {self.ep_size} and "
                    f"reduced over {self.dp_size} replica(s): the other ranks' copies of these experts would "
                    f"never be reduced; pass a ('dp', 'ep') DeviceMesh covering every rank to apply_expert_parallel"
                )
            self.wrapper = wrapper
            self._decide()
            self.log()

    def hand_over(self, reducer: str) -> None:
        """``reducer`` (a wrapper's engine, e.g. DeepSpeed's) all-reduces the expert gradients over the
        ``"dp"`` replicas and divides them by the data-parallel size itself: epmoe leaves them as the
        exchange made them from now on, and the result is ``expert_grad="mean"``."""
        if self.mode == "sum":
            raise ValueError(
                f"epmoe: {reducer} divides every gradient by the data-parallel size, expert gradients included: "
                f"ExpertParallelConfig(expert_grad='sum') cannot be honoured; use 'auto' or 'mean'"
            )
        if self.wrapper is not None and self.wrapper != reducer:
            raise ValueError(
                f"epmoe: the model already runs under {self.wrapper}, which averages the expert "
                f"gradients itself; {reducer} would average them again"
            )
        self.set_wrapper(reducer)
        self.reducer = reducer
        self._decide()

    def log(self) -> None:
        """One INFO line when what ``mode`` resolves to changes (the first time included)."""
        decision = self.resolved
        if decision == self._logged:
            return
        self._logged = decision
        how = (
            f"divided by the {self.data_parallel_size} data-parallel ranks"
            if decision == "mean"
            else "summed over every rank's tokens"
        )
        why = (
            f" ({self.wrapper})"
            if self.mode == "auto" and self.wrapper
            else (" (no data-parallel wrapper seen yet)" if self.mode == "auto" else "")
        )
        logger.info("epmoe: expert_grad=%r -> %r%s: expert gradients are %s", self.mode, decision, why, how)

    def _all_reduce(self, flat: torch.Tensor, position: Position, *, async_op: bool = False):
        """``flat`` summed over ``"dp"``, after a step header at ``position`` where checks are on."""
        return self.dp_channel.all_reduce(
            flat, position, header=checks_on(self.check_steps, flat.device), async_op=async_op
        )

    def finish(self, grads: list[torch.Tensor | None], position: Position, arm: Arm) -> list[torch.Tensor | None]:
        """Reduce ``grads`` over ``"dp"`` (one flat buffer) and apply the scale; ``None`` entries stay.
        ``position``: the layer's, for the step header; ``arm``: called first (the model's step guard)."""
        present = [g for g in grads if g is not None]
        scale = self.scale
        arm()
        if not present or not self.finishes:
            return grads
        flat = torch.cat([g.reshape(-1) for g in present])
        if self.dp_size > 1:
            self._all_reduce(flat, position)
        if scale != 1.0:
            flat.mul_(scale)
        out, offset = [], 0
        for g in grads:
            if g is None:
                out.append(None)
                continue
            out.append(flat[offset : offset + g.numel()].view_as(g).to(g.dtype))
            offset += g.numel()
        return out

    def reduce_later(
        self, params: list[nn.Parameter], grads: list[torch.Tensor | None], position: Position, arm: Arm
    ) -> None:
        """Start the ``"dp"`` all-reduce of ``grads`` (one flat buffer) without waiting; at the end of
        this backward, :meth:`_land` scales the sums and adds them to ``params``' ``.grad``. The rest
        of the backward runs meanwhile (on NCCL / HCCL the collective has its own stream). ``arm`` is
        called after :meth:`_land` is queued (the guard records the gradients it writes)."""
        present = [(p, g) for p, g in zip(params, grads) if g is not None and p.requires_grad]
        if not present:
            return
        flat = torch.cat([g.reshape(-1) for _, g in present])
        work = self._all_reduce(flat, position, async_op=True)
        if not self._queued:  # first of this backward (what a failed backward left is dropped)
            for stale in self._pending:
                stale[0].wait()
            self._pending = []
            torch.autograd.Variable._execution_engine.queue_callback(self._land)
            self._queued = True
        arm()
        self._pending.append((work, flat, [p for p, _ in present], self.scale))

    def _land(self) -> None:
        pending, self._pending, self._queued = self._pending, [], False
        for work, flat, params, scale in pending:
            work.wait()
            if scale != 1.0:
                flat.mul_(scale)
            offset = 0
            for p in params:
                part = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
                offset += p.numel()
                if p.grad is None:
                    p.grad = part
                else:
                    p.grad.add_(part)


class _ExpertGradSync(torch.autograd.Function):
    """Identity in forward. In backward, the tensors' gradients at once (one flat buffer): where they
    are all parameters and there are ``"dp"`` replicas, reduced asynchronously and added to ``.grad``
    at the end of the backward (:meth:`ExpertGradPolicy.reduce_later`, overlapped with the rest of
    it); otherwise reduced in place (:meth:`ExpertGradPolicy.finish`) and passed on to whatever
    computed them."""

    @staticmethod
    def forward(ctx, policy, arm, position, *weights):
        ctx.policy, ctx.arm, ctx.position = policy, arm, position
        ctx.params = [w for w in weights if isinstance(w, nn.Parameter)]
        ctx.all_params = len(ctx.params) == len(weights)
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise double_backward_error("expert-gradient reduction")
        policy = ctx.policy
        if ctx.all_params and policy.dp_size > 1 and policy.finishes:
            policy.reduce_later(ctx.params, list(grads), ctx.position, ctx.arm)
            return (None,) * (3 + len(grads))
        return (None, None, None, *policy.finish(list(grads), ctx.position, ctx.arm))


def finish_weights(
    policy: ExpertGradPolicy, weights: Sequence[torch.Tensor], position: Position, arm: Arm
) -> list[torch.Tensor]:
    """``weights`` (an experts module's, as its forward uses them) with their gradients finished by
    ``policy`` in the backward, before they flow into their leaves: weights reached through a wrapper
    (PEFT's LoRA parametrization ``W + B @ A``, the stack of a ``ModuleList``'s Linear weights) are
    covered with the factors they come from. ``position``: the layer's, for the step header of its
    reduction; ``arm``: called in that backward (the model's step guard)."""
    return list(_ExpertGradSync.apply(policy, arm, position, *weights))


def register_param_hooks(
    policy: ExpertGradPolicy, params: Sequence[nn.Parameter], position: Callable[[], Position], arm: Arm
) -> None:
    """For experts run by their own forward (no weight tensor to intercept): a gradient hook per
    parameter that finishes its incoming gradient (one collective per parameter over ``"dp"``);
    ``position()`` gives the layer's position when the hook runs; ``arm`` as for :func:`finish_weights`."""
    for p in params:
        if getattr(p, "_epmoe_grad_hook", None) is policy or not p.requires_grad:
            continue
        p.register_hook(lambda g, policy=policy: policy.finish([g], position(), arm)[0])
        p._epmoe_grad_hook = policy


class _SharedBySource(torch.autograd.Function):
    """Forward: ``x`` as it is, then ``W`` views of the parameters (source-major: ``W`` groups of
    ``len(params)``). Backward: the views' gradients as a ``(W, N)`` buffer (row ``s``: what source
    rank ``s``'s rows gave), row ``s`` sent to rank ``s`` (one all-to-all over ``group``), and each
    parameter's gradient the sum of the rows received, in rank order. Its backward runs when ``x``'s
    gradient is ready too, just before the dispatch's backward exchange: at the same point on every
    rank."""

    @staticmethod
    def forward(ctx, group, W, x, *params):
        ctx.group, ctx.W, ctx.params = group, W, len(params)
        ctx.dtype = functools.reduce(torch.promote_types, [p.dtype for p in params])
        ctx.meta = [(p.shape, p.dtype) for p in params]
        return (x.view_as(x), *(p.view_as(p) for _ in range(W) for p in params))

    @staticmethod
    def backward(ctx, dx, *d_views):
        if torch.is_grad_enabled():
            raise double_backward_error("shared-parameter gradients by source rank")
        W, n = ctx.W, ctx.params
        sent_WN = torch.stack(
            [torch.cat([d.reshape(-1).to(ctx.dtype) for d in d_views[s * n : (s + 1) * n]]) for s in range(W)]
        )
        received_WN = all_to_all_v(sent_WN, [1] * W, [1] * W, ctx.group)
        total_N = received_WN[0].clone()
        for row in received_WN[1:]:
            total_N += row
        grads, offset = [], 0
        for shape, dtype in ctx.meta:
            size = math.prod(shape)
            grads.append(total_N[offset : offset + size].view(shape).to(dtype))
            offset += size
        return (None, None, dx, *grads)


def shared_by_source(
    x: torch.Tensor, params: Sequence[torch.Tensor], group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """``(x, views)``: ``x`` (the rows an experts module runs: gradients pass through), and per source
    rank ``s`` of ``group`` the views ``views[s]`` of ``params`` (parameters shared by the experts)
    that the rows of rank ``s`` run with. In backward, each rank's parameters get the gradient its
    own rows gave on every rank (see the module docstring); every rank of ``group`` must call it at
    the same point of its forward (the layer's experts step)."""
    if not params:
        raise ValueError("shared_by_source(params): no parameter to split")
    W = world_size(group, "shared_by_source")
    out = _SharedBySource.apply(group, W, x, *params)
    n = len(params)
    return out[0], [list(out[1 + s * n : 1 + (s + 1) * n]) for s in range(W)]
