"""Training with and without expert parallelism, side by side: the body of ``epmoe demo``.

Every rank builds the same small transformers MoE model (same seed) twice:

    without EP: every rank holds all E experts; data parallel (gradients all-reduced)
    with EP:    apply_expert_parallel -> rank r holds experts [r*E/W, (r+1)*E/W);
                non-expert gradients all-reduced, expert gradients already summed by the exchange

Both train on the same per-rank batches of a fixed synthetic dataset with AdamW, one step of each in
turn, and optimise the same objective (the mean over ranks of each rank's loss), so their loss curves
must agree to floating-point tolerance.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import epmoe
from epmoe import platform
from epmoe.experts import experts_backend

VOCAB = 256


@dataclass
class TrainOptions:
    family: str = "qwen3_moe"
    steps: int = 20
    dtype: str = "float32"
    backend: str = "auto"
    device: str = "cpu"
    batch_size: int = 4
    seq_len: int = 64
    num_experts: int = 32
    top_k: int = 4
    lr: float = 1e-3
    seed: int = 0
    show_progress: bool = False

    def __post_init__(self) -> None:
        from epmoe.models import FAMILIES

        if self.family not in FAMILIES:
            raise ValueError(f"--model: {self.family!r} is not one of {list(FAMILIES)}")
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(f"--dtype: {self.dtype!r} is not one of float32, bfloat16, float64")
        if self.steps < 1:
            raise ValueError(f"--steps: must be >= 1, got {self.steps}")
        if self.device not in ("cpu", "cuda", "npu", "xpu"):
            raise ValueError(f"--device: {self.device!r} is not one of cpu, cuda, npu, xpu")


@dataclass
class StepRecord:
    step: int
    loss_ep: float
    loss_ref: float
    time_ep: float
    time_ref: float

    @property
    def diff(self) -> float:
        return abs(self.loss_ep - self.loss_ref)


@dataclass
class TrainResult:
    options: TrainOptions
    world_size: int
    gmm_backend: str
    records: list[StepRecord] = field(default_factory=list)


def synthetic_batch(step: int, rank: int, batch_size: int, seq_len: int) -> torch.Tensor:
    """A fixed, learnable token batch: each row follows ``x[t+1] = (a*x[t] + b) mod V``."""
    g = torch.Generator().manual_seed(10_000 * rank + step % 8)  # 8 distinct batches per rank, cycled
    start = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
    a = torch.randint(1, 4, (batch_size, 1), generator=g)
    b = torch.randint(0, 7, (batch_size, 1), generator=g)
    rows = [start]
    for _ in range(seq_len - 1):
        rows.append((a * rows[-1] + b) % VOCAB)
    return torch.cat(rows, dim=1)


def _average_gradients(params: list[torch.nn.Parameter], world: int) -> None:
    """Data-parallel all-reduce (mean) of gradients, one flat buffer (the same size on every rank:
    a parameter without a gradient here contributes zeros)."""
    if world == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _global_loss(loss: torch.Tensor, world: int) -> float:
    value = loss.detach().double().reshape(1)
    if world > 1:
        dist.all_reduce(value)
    return value.item() / world


def train_parity(rank: int, world: int, options: TrainOptions) -> TrainResult:
    """Train the same model with and without EP on this rank; return both loss curves (rank 0's view)."""
    from epmoe.models import build_model

    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cpu") if options.device == "cpu" else torch.device(options.device, local_rank)
    if device.type != "cpu":
        platform.device_module(device.type).set_device(device)
    dtype = getattr(torch, options.dtype)
    reference = build_model(options.family, num_experts=options.num_experts, top_k=options.top_k,
                            seed=options.seed, dtype=dtype).to(device)
    model = copy.deepcopy(reference)
    shards = epmoe.apply_expert_parallel(model, config={"gmm_backend": options.backend})
    expert_params = {id(p) for s in shards for p in model.get_submodule(s.module_name).parameters()}
    non_expert = [p for p in model.parameters() if id(p) not in expert_params]
    experts = [p for p in model.parameters() if id(p) in expert_params]

    opt_ep = torch.optim.AdamW(model.parameters(), lr=options.lr)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=options.lr)
    backend = experts_backend(model.get_submodule(shards[0].module_name), options.backend).name
    result = TrainResult(options, world, backend)
    steps = range(options.steps)
    if options.show_progress and rank == 0:
        from tqdm import tqdm

        steps = tqdm(steps, desc=f"training {options.family} on {world} ranks", unit="step")
    for step in steps:
        ids = synthetic_batch(step, rank, options.batch_size, options.seq_len).to(device)

        start = time.perf_counter()
        loss_ep = model(ids, labels=ids).loss
        loss_ep.backward()
        _average_gradients(non_expert, world)
        for p in experts:  # the exchange summed every rank's contribution: make it the mean over ranks
            if p.grad is not None:
                p.grad /= world
        opt_ep.step()
        opt_ep.zero_grad(set_to_none=True)
        platform.synchronize(device)
        time_ep = time.perf_counter() - start

        start = time.perf_counter()
        loss_ref = reference(ids, labels=ids).loss
        loss_ref.backward()
        _average_gradients(list(reference.parameters()), world)
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        platform.synchronize(device)
        time_ref = time.perf_counter() - start

        result.records.append(StepRecord(step, _global_loss(loss_ep, world), _global_loss(loss_ref, world),
                                         time_ep, time_ref))
    return result
