"""``ExpertParallelConfig`` (how the experts run) and ``ExpertShard`` (what a rank holds)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from epmoe.gmm import gmm_backends

DISPATCH_MODES = ("auto", "alltoallv", "fused", "static", "nodes")
EXPERT_GRAD_MODES = ("auto", "sum", "mean")
TELEMETRY_COUNTER = "telemetry"  # ExpertParallelState.loads key of the routed slots epmoe.expert_load reports
DROPPED_COUNTER = "dropped"  # ExpertParallelState.loads key of the slots capacity dropped


@dataclass
class ExpertParallelConfig:
    """How :func:`epmoe.apply_expert_parallel` runs the experts. Must be the same on every rank.

    Attributes:
        gmm_backend: ``"auto"`` or a registered grouped-matmul backend name (see ``epmoe.gmm_backends``).
        dispatch: ``"alltoallv"`` (each token once per rank holding its experts, then grouped
            matmul), ``"fused"`` (``alltoallv_gmm`` / ``gmm_alltoallv`` in the vendor's per-slot
            layout, overlapping rounds of communication with compute and the shared expert),
            ``"static"`` (fixed-size buffers of ``B`` rows per rank pair, ``B`` at least every rank's
            tokens: no counts exchange, no host read, traced whole by ``torch.compile``; see
            :mod:`epmoe.ep.dispatch.static`), ``"nodes"`` (two levels: each token once to each node
            holding one of its experts, then inside the node to the ranks holding them:
            :mod:`epmoe.ep.dispatch.nodes`), or ``"auto"`` (``"nodes"`` where the EP group spans
            more than one node with more than one of its ranks on each, else ``"alltoallv"``, and the
            static exchange at the decode steps of epmoe's ``generate``: :meth:`decodes_static`).
        num_chunks: pipelining rounds of the fused path (int >= 1, or ``"auto"``).
        expert_grad: what expert gradients are once backward ends: ``"sum"`` over every rank's
            tokens (the unsharded model on the concatenated batch), ``"mean"`` (divided by the
            data-parallel size, as DDP / FSDP2 do to the other gradients), or ``"auto"`` (``"mean"``
            under DDP, FSDP2 or a prepared Trainer, ``"sum"`` otherwise); see :mod:`epmoe.ep.grads`.
        timeout: seconds an EP collective may wait for its peers before every waiting rank raises
            (``None``: 300 s, or the process group's own timeout where that is shorter). epmoe's
            collectives run on a group created for EP with this timeout, so a rank that died, hung
            or raised ends the others' wait; see :mod:`epmoe.comm.steps`.
        check_steps: whether each layer's backward and each expert-gradient reduction start with a
            step-header exchange (one small collective and one host read each) that turns ranks out
            of step into an error on every rank: ``True``, ``False``, or ``"auto"`` (on for tensors on
            the CPU, off on accelerators, where the host synchronisation would cost more). The
            forward's check rides in the counts exchange and is always on. ``False`` also turns off
            the step guard's check of expert gradients changed in place after backward
            (:mod:`epmoe.ep.guard`: a clip that sees only each rank's experts; a scale by the same
            factor on every rank passes either way).
        capacity_factor: ``None`` (dropless, the default) or a float > 0: each expert then keeps at
            most ``ceil(capacity_factor * T_global * K / E)`` slots of a forward (``T_global * K``: the
            slots of every rank of the EP group), the first in the global order (source rank, then
            token, then k: the ranks' batches concatenated in rank order), so EP size 1 on that
            concatenation drops the same slots as any EP size. A dropped slot contributes zero (its
            expert output and routing-weight gradient are zero) and is counted
            (``epmoe.expert_load(model, dropped=True)``). Runs the all-to-all-v dispatch.
        static_tokens: ``dispatch="static"`` only: ``None`` (the ranks agree on the buffer's ``B``
            at each layer's first forward, one host read, and again where a batch outgrows it while
            ``check_steps`` is on) or an int >= 1, ``B`` itself: no agreement at all (sync-free from
            the first step); a forward with more tokens on any rank raises on every rank.
        replicas: an int >= 0, the experts it does not own a rank may compute rows of in one layer
            call (default 0: none). Hot experts' slots then move to ranks below the mean load, the
            weights travelling for the call (:mod:`epmoe.ep.replicas`): the same outputs and
            gradients, fewer rows on the most loaded rank. Runs the all-to-all-v or the two-level
            dispatch (the static exchange at ``generate``'s decode steps runs without replicas).
        ranks_per_node: ``None`` (the launcher says which EP ranks share a node: torchrun's
            ``LOCAL_WORLD_SIZE`` and node rank; none: one node) or an int >= 1, the EP ranks per
            node, consecutive (to override the launcher, or to emulate nodes on one machine):
            :mod:`epmoe.ep.topology`. Read by ``dispatch="nodes"`` and ``"auto"``, and by expert
            replicas' link costs (a link inside a node or between nodes).
        flops_per_link_byte: what a byte on a link costs expert replicas' plan, in matmul flops
            (:mod:`epmoe.ep.links`): ``None`` (measured when EP is applied with replicas on: a timed
            matmul and one short timed exchange per link class, agreed across ranks), a number >= 0
            for every link, or ``{"inside": x, "between": y}`` for links inside a node and between
            nodes (``float("inf")``: never move an expert over that link).
    """

    gmm_backend: str = "auto"
    dispatch: str = "auto"
    num_chunks: int | str = "auto"
    expert_grad: str = "auto"
    timeout: float | None = None
    check_steps: bool | str = "auto"
    capacity_factor: float | None = None
    static_tokens: int | None = None
    replicas: int = 0
    ranks_per_node: int | None = None
    flops_per_link_byte: float | dict[str, float] | None = None

    def __post_init__(self) -> None:
        names = ["auto"] + [status.name for status in gmm_backends()]
        if not isinstance(self.gmm_backend, str) or self.gmm_backend not in names:
            raise ValueError(f"ExpertParallelConfig(gmm_backend): {self.gmm_backend!r} is not one of {names}")
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"ExpertParallelConfig(dispatch): {self.dispatch!r} is not one of {list(DISPATCH_MODES)}")
        chunks = self.num_chunks
        if not (chunks == "auto" or (isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1)):
            raise ValueError(f"ExpertParallelConfig(num_chunks): expected an int >= 1 or 'auto', got {chunks!r}")
        if self.expert_grad not in EXPERT_GRAD_MODES:
            raise ValueError(
                f"ExpertParallelConfig(expert_grad): {self.expert_grad!r} is not one of {list(EXPERT_GRAD_MODES)}"
            )

        timeout = self.timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf")
        ):
            raise ValueError(
                f"ExpertParallelConfig(timeout): expected a positive number of seconds or None, got {timeout!r}"
            )
        if not (isinstance(self.check_steps, bool) or self.check_steps == "auto"):
            raise ValueError(
                f"ExpertParallelConfig(check_steps): expected True, False or 'auto', got {self.check_steps!r}"
            )

        factor = self.capacity_factor
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf")
        ):
            raise ValueError(f"ExpertParallelConfig(capacity_factor): expected None or a number > 0, got {factor!r}")
        if factor is not None and self.dispatch == "fused":
            raise ValueError(
                "ExpertParallelConfig(capacity_factor): drops slots between the exchange and the grouped "
                "matmul, which the fused ops do not expose; use dispatch='alltoallv' or 'auto'"
            )
        self._check_static()
        self._check_replicas()
        self._check_nodes()
        self._check_links()

    def _check_links(self) -> None:
        """``flops_per_link_byte``: ``None``, a number >= 0, or one per link class (:mod:`epmoe.ep.links`)."""
        given = self.flops_per_link_byte
        if given is None:
            return
        classes = ("inside", "between")
        costs = given if isinstance(given, dict) else dict.fromkeys(classes, given)
        if isinstance(given, dict) and sorted(given) != sorted(classes):
            raise ValueError(
                f"ExpertParallelConfig(flops_per_link_byte): a dict needs exactly the keys {list(classes)}, "
                f"got {sorted(given)}"
            )
        for value in costs.values():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(
                    f"ExpertParallelConfig(flops_per_link_byte): expected None, a number >= 0 or "
                    f"{{'inside': x, 'between': y}} of such numbers, got {given!r}"
                )
        if isinstance(given, dict):  # one order, so that equal configs have equal codes on every rank
            self.flops_per_link_byte = {name: given[name] for name in classes}

    def _check_nodes(self) -> None:
        """What the two-level exchange cannot serve (:mod:`epmoe.ep.dispatch.nodes`)."""
        size = self.ranks_per_node
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"ExpertParallelConfig(ranks_per_node): expected None or an int >= 1, got {size!r}")
        if size is not None and self.dispatch == "static":
            raise ValueError(
                "ExpertParallelConfig(ranks_per_node): the static exchange has no two-level form (fixed-size "
                "buffers across nodes are not served yet: the two-level exchange reads its counts to the host "
                "once per layer); use dispatch='nodes' or 'auto', or dispatch='static' without ranks_per_node"
            )
        if size is not None and self.dispatch in ("fused", "alltoallv"):
            raise ValueError(
                f"ExpertParallelConfig(ranks_per_node): says which ranks share a node, for dispatch='nodes' or "
                f"'auto'; dispatch={self.dispatch!r} sends every row rank to rank"
            )
        if self.dispatch != "nodes":
            return
        if self.capacity_factor is not None:
            raise ValueError(
                "ExpertParallelConfig(capacity_factor): not served by dispatch='nodes' yet (the two-level exchange "
                "runs dropless); use dispatch='alltoallv' with capacity_factor"
            )

    def _check_replicas(self) -> None:
        """What expert replicas cannot serve (:mod:`epmoe.ep.replicas`)."""
        n = self.replicas
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"ExpertParallelConfig(replicas): expected an int >= 0, got {n!r}")
        if n and self.dispatch in ("fused", "static"):  # "nodes" moves them through both hops
            raise ValueError(
                f"ExpertParallelConfig(replicas): moves slots between ranks by the counts exchange's plan, "
                f"which dispatch={self.dispatch!r} does not run ("
                + ("its ops keep the vendor's per-slot layout" if self.dispatch == "fused" else "no counts exchange")
                + "); use dispatch='alltoallv' or 'auto' with replicas, or replicas=0"
            )
        if n and self.capacity_factor is not None:
            raise ValueError(
                "ExpertParallelConfig(replicas): capacity_factor keeps each expert's first slots where its "
                "owner computes them; replicas move slots to other ranks: use one or the other"
            )

    def _check_static(self) -> None:
        """The static exchange's conflicts (:mod:`epmoe.ep.dispatch.static`)."""
        tokens = self.static_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ValueError(f"ExpertParallelConfig(static_tokens): expected None or an int >= 1, got {tokens!r}")
        if tokens is not None and self.dispatch != "static":
            raise ValueError(
                f"ExpertParallelConfig(static_tokens): sizes the static exchange's buffer; it needs "
                f"dispatch='static', not {self.dispatch!r}"
            )
        if self.dispatch != "static":
            return
        if self.capacity_factor is not None:
            raise ValueError(
                "ExpertParallelConfig(capacity_factor): the static exchange is dropless by construction "
                "(each expert's capacity would need the counts on the host); use dispatch='alltoallv' "
                "with capacity_factor, or dispatch='static' without it"
            )
        if self.num_chunks != "auto":
            raise ValueError(
                f"ExpertParallelConfig(num_chunks): {self.num_chunks!r} pipelines the fused ops, which "
                f"dispatch='static' does not run (it sends fixed-size buffers); leave num_chunks='auto' "
                f"or use dispatch='fused'"
            )

    def decodes_static(self) -> bool:
        """The rule by which ``dispatch="auto"`` takes the static exchange: at the decode steps of a
        ``generate`` call on an EP model (every forward of the call after its first, the prompt's;
        :mod:`epmoe.training.generate`), where it halves the collectives and measured faster
        (``benchmarks/static_cpu.md``), and nowhere else (training-sized steps pay for its padding).
        Every rank agrees by construction: the ranks run a generate call's forwards in lockstep.
        Not with ``capacity_factor`` (the static exchange is dropless)."""
        return self.dispatch == "auto" and self.capacity_factor is None

    @classmethod
    def from_any(cls, config: ExpertParallelConfig | dict[str, Any] | None) -> ExpertParallelConfig:
        """Accept a config, a dict of its fields (unknown keys raise), or ``None`` for defaults."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if isinstance(config, dict):
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(config) - fields)
            if unknown:
                raise ValueError(f"config: unknown key {unknown[0]!r}; known keys are {sorted(fields)}")
            return cls(**config)
        raise TypeError(f"config: expected ExpertParallelConfig, dict or None, got {type(config).__name__}")


@dataclass(frozen=True)
class ExpertShard:
    """The slice of one experts module a rank holds: global experts ``[local_start, local_end)``."""

    module_name: str
    num_experts: int
    num_local_experts: int
    local_start: int
    local_end: int
    ep_rank: int
    ep_size: int
