"""Training with and without expert parallelism, side by side: the body of ``epmoe demo``.

Every rank builds the same small transformers MoE model (same seed) twice and trains both the way
users do, data parallel, with gradient clipping (max norm 1.0):

    without EP: every rank holds all E experts; DistributedDataParallel, torch's clip_grad_norm_
    with EP:    apply_expert_parallel -> rank r holds experts [r*E/W, (r+1)*E/W);
                DistributedDataParallel (which leaves the experts to epmoe), epmoe.clip_grad_norm_

or, with ``trainer=True``, each through a ``transformers.Trainer`` (the EP one through
``epmoe.prepare_trainer``). Both train on the same per-rank batches of a fixed synthetic dataset
with AdamW and optimise the same objective (the mean over ranks of each rank's loss), so their loss
curves must agree to floating-point tolerance.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import epmoe
from epmoe import platform
from epmoe.ep.experts import experts_backend
from epmoe.ep.load import max_over_mean
from epmoe.models import FAMILIES, build_model

VOCAB = 256
MAX_GRAD_NORM = 1.0
BALANCE_RATE = 1e-3  # --balance: per step, a thirtieth of a 32-expert softmax score (1/32)


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
    trainer: bool = False  # train through transformers.Trainer instead of a DDP loop
    balance: bool = False  # DDP loop only: epmoe.LoadBalancer on the EP model, mirrored on the reference
    replicas: int = 0  # ExpertParallelConfig(replicas=...) of the EP model
    show_progress: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"--model: {self.family!r} is not one of {list(FAMILIES)}")
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(f"--dtype: {self.dtype!r} is not one of float32, bfloat16, float64")
        if self.steps < 1:
            raise ValueError(f"--steps: must be >= 1, got {self.steps}")
        if self.balance and self.trainer:
            raise ValueError(
                "--balance: not supported with --trainer yet (the DDP loop mirrors the biases on the "
                "reference step by step)"
            )
        if self.device not in ("cpu", "cuda", "npu", "xpu"):
            raise ValueError(f"--device: {self.device!r} is not one of cpu, cuda, npu, xpu")


@dataclass
class StepRecord:
    step: int
    loss_ep: float
    loss_ref: float
    time_ep: float
    time_ref: float
    load: dict[str, list[int]] = field(default_factory=dict)  # EP model: slots per global expert, per layer
    rows: dict[str, list[int]] = field(default_factory=dict)  # EP model: slots each rank computed, per layer

    @property
    def imbalance(self) -> list[float]:
        """Per layer, the busiest expert's load over the mean (1.0: perfect balance)."""
        return [max_over_mean(counts) for counts in self.load.values()]

    @property
    def rank_imbalance(self) -> float:
        """The most loaded rank's computed slots over the mean, in the layer where that is largest."""
        return max(max_over_mean(counts) for counts in self.rows.values())

    @property
    def diff(self) -> float:
        return abs(self.loss_ep - self.loss_ref)


@dataclass
class TrainResult:
    options: TrainOptions
    world_size: int
    gmm_backend: str
    records: list[StepRecord] = field(default_factory=list)
    reload_error: float | None = None  # max relative logits difference, EP model vs its checkpoint reloaded without EP


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


def _global_loss(loss: torch.Tensor, world: int) -> float:
    value = loss.detach().double().reshape(1)
    if world > 1:
        dist.all_reduce(value)
    return value.item() / world


def train_parity(rank: int, world: int, options: TrainOptions) -> TrainResult:
    """Train the same model with and without EP on this rank; return both loss curves (rank 0's view)."""
    device = _rank_device(options, rank)
    dtype = getattr(torch, options.dtype)
    reference = build_model(
        options.family, num_experts=options.num_experts, top_k=options.top_k, seed=options.seed, dtype=dtype
    ).to(device)
    model = copy.deepcopy(reference)
    shards = epmoe.apply_expert_parallel(model, config={"gmm_backend": options.backend, "replicas": options.replicas})
    backend = experts_backend(model.get_submodule(shards[0].module_name), options.backend).name
    result = TrainResult(options, world, backend)
    ep_model = model
    balancer = None
    if options.balance:
        balancer = epmoe.LoadBalancer(model, update_rate=BALANCE_RATE)
        balancer.mirror(reference)  # the reference selects with the same biases: the curves stay comparable
    epmoe.reset_expert_load(model)
    if options.trainer:
        _train_with_trainer(result, model, reference, rank, device)
        result.reload_error = reload_error(ep_model, rank, world, options, device, balancer)
        return result
    ddp_args = {"device_ids": [device.index]} if device.type != "cpu" else {}
    model, reference = DDP(model, **ddp_args), DDP(reference, **ddp_args)
    opt_ep = torch.optim.AdamW(model.parameters(), lr=options.lr)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=options.lr)

    def clip_ep():
        epmoe.clip_grad_norm_(model, MAX_GRAD_NORM)

    def clip_ref():
        torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_GRAD_NORM)

    steps = range(options.steps)
    if options.show_progress and rank == 0:
        from tqdm import tqdm

        steps = tqdm(steps, desc=f"training {options.family} on {world} ranks", unit="step")
    for step in steps:
        ids = synthetic_batch(step, rank, options.batch_size, options.seq_len).to(device)
        loss_ep, time_ep = _timed_step(model, opt_ep, ids, clip_ep)
        loss_ref, time_ref = _timed_step(reference, opt_ref, ids, clip_ref)
        result.records.append(
            StepRecord(
                step,
                _global_loss(loss_ep, world),
                _global_loss(loss_ref, world),
                time_ep,
                time_ref,
                *_step_load(ep_model),
            )
        )
        if balancer is not None:  # after both steps: the next step of both selects with the new biases
            balancer.step()
    result.reload_error = reload_error(ep_model, rank, world, options, device, balancer)
    return result


def _rank_device(options: TrainOptions, rank: int) -> torch.device:
    """This rank's device (``LOCAL_RANK``'s accelerator, set current), or the CPU."""
    if options.device == "cpu":
        return torch.device("cpu")
    device = torch.device(options.device, int(os.environ.get("LOCAL_RANK", rank)))
    platform.device_module(device.type).set_device(device)
    return device


def _timed_step(model, optimizer, ids: torch.Tensor, clip) -> tuple[torch.Tensor, float]:
    """``(loss, seconds)`` of one training step: forward, backward, ``clip()``, the optimizer."""
    start = time.perf_counter()
    loss = model(ids, labels=ids).loss
    loss.backward()
    clip()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    platform.synchronize(loss.device)
    return loss, time.perf_counter() - start


def _step_load(model) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """The EP model's expert load of the step just run and the slots each rank computed (collectives),
    counting afresh after them."""
    load = {name: counts.tolist() for name, counts in epmoe.expert_load(model).items()}
    rows = {name: counts.tolist() for name, counts in epmoe.expert_load(model, computed=True).items()}
    epmoe.reset_expert_load(model)
    return load, rows


def reload_error(model, rank: int, world: int, options: TrainOptions, device: torch.device, balancer=None) -> float:
    """Save the trained EP model with ``save_pretrained`` (every rank), reload it with plain transformers
    (no EP, all experts on every rank; selecting with the balancer's biases, if any) and compare logits
    on this rank's batch: the max over ranks of the relative difference."""
    import tempfile

    from transformers import AutoModelForCausalLM

    ids = synthetic_batch(0, rank, options.batch_size, options.seq_len).to(device)
    with tempfile.TemporaryDirectory() as path:
        shared = [path]
        if world > 1:
            dist.broadcast_object_list(shared, src=0)  # one directory, rank 0's
        model.save_pretrained(shared[0])
        plain = AutoModelForCausalLM.from_pretrained(shared[0], dtype=getattr(torch, options.dtype)).to(device)
        if balancer is not None:
            balancer.mirror(plain)
        with torch.no_grad():
            mine, theirs = model(ids).logits.double(), plain(ids).logits.double()
        if world > 1:
            dist.barrier()  # nobody reads rank 0's directory any more
    error = ((mine - theirs).abs().max() / theirs.abs().max()).reshape(1)
    if world > 1:
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
    return error.item()


class SyntheticDataset(torch.utils.data.Dataset):
    """The demo's token rows for ``transformers.Trainer``: ``synthetic_batch`` rows, cycled."""

    def __init__(self, options: TrainOptions, world: int):
        rows = [
            synthetic_batch(step, rank, options.batch_size, options.seq_len)
            for step in range(8)
            for rank in range(world)
        ]
        self.rows = torch.cat(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def step_times(device: torch.device):
    """A ``transformers.TrainerCallback`` whose ``times`` are the seconds of each Trainer step."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            platform.synchronize(device)
            self.times.append(time.perf_counter() - self._start)

    return StepTimes()


def _train_with_trainer(result: TrainResult, model, reference, rank: int, device: torch.device) -> None:
    """Both models through ``transformers.Trainer``; per-step losses from Trainer's logs, per-step times
    and the EP model's expert load from callbacks."""
    import tempfile

    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    class Loads(TrainerCallback):  # after each optimizer step: the step's expert load
        def __init__(self):
            self.loads = []

        def on_step_end(self, args, state, control, **kwargs):
            self.loads.append(_step_load(model))

    options = result.options
    dataset = SyntheticDataset(options, result.world_size)
    curves = {}
    loads = Loads()
    with tempfile.TemporaryDirectory() as out_dir:
        for label, net in (("ep", model), ("ref", reference)):
            args = TrainingArguments(
                output_dir=f"{out_dir}/{label}",
                per_device_train_batch_size=options.batch_size,
                max_steps=options.steps,
                learning_rate=options.lr,
                lr_scheduler_type="constant",
                max_grad_norm=MAX_GRAD_NORM,
                logging_steps=1,
                report_to=[],
                save_strategy="no",
                use_cpu=device.type == "cpu",
                disable_tqdm=True,
                seed=options.seed,
                dataloader_num_workers=0,
            )
            times = step_times(device)
            extra = [loads] if label == "ep" else []
            trainer = Trainer(model=net, args=args, train_dataset=dataset, callbacks=[times, *extra])
            trainer.remove_callback(PrinterCallback)
            if label == "ep":
                epmoe.prepare_trainer(trainer)
            trainer.train()
            losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            curves[label] = (losses, times.times)
    (losses_ref, times_ref), (losses_ep, times_ep) = curves["ref"], curves["ep"]
    for step, (*values, (load, rows)) in enumerate(zip(losses_ep, losses_ref, times_ep, times_ref, loads.loads)):
        result.records.append(StepRecord(step, *values, load, rows))
