"""Rank functions for tests/models/test_experts_inside.py (module level, so spawned ranks can import them).

Each compares an EP model on this rank's batch with the unsharded model (its own copy on every rank):
expert gradients against the unsharded model's summed over every rank's batch (this rank's experts),
everything else (the parameters the experts share included) against the unsharded model on this
rank's batch alone."""

import copy
import traceback

import torch
import torch.distributed as dist
from experts_inside_models import FLOAT32_FAMILIES, batch_of, build_custom, build_family, loss_of, outputs_of, to_dtype
from torch.distributed.tensor import DTensor

import epmoe
from epmoe.ep.recognize import shared_parameters


def run_cases(rank, world, cases):
    """``{label: fn(rank, world, *args)}`` for ``cases`` (``{label: (fn, args)}``), one after the other;
    a case that raised gives ``{"error": traceback}`` (the others still run). A barrier after each."""
    out = {}
    for label, (fn, args) in cases.items():
        try:
            out[label] = fn(rank, world, *args)
        except BaseException:  # noqa: BLE001 - the test reports it, naming the case
            out[label] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


def max_rel(a, b):
    """Largest elementwise difference relative to ``b``'s largest magnitude."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def reference_grads(ref, rank, world):
    """``(loss on this rank's batch, {name: grad on this rank's batch}, {name: grad summed over every
    rank's batch})`` of the unsharded ``ref``, under every name a parameter has (gradients in float64)."""
    params = dict(ref.named_parameters(remove_duplicate=False))
    own, summed, own_loss = {}, {}, None
    for source in range(world):
        ref.zero_grad()
        loss = loss_of(ref, batch_of(source))
        loss.backward()
        for name, p in params.items():
            grad = p.grad.double() if p.grad is not None else torch.zeros_like(p, dtype=torch.float64)
            summed[name] = summed[name] + grad if name in summed else grad
            if source == rank:
                own[name] = grad
        if source == rank:
            own_loss = loss.detach()
    return own_loss, own, summed


def local_slice(name, grad, model, shards):
    """The part of an unsharded expert tensor ``grad`` this rank holds (packed: rows of its experts)."""
    for shard in shards:
        if name.startswith(shard.module_name + ".") and grad.shape != model.get_parameter(name).shape:
            return grad[shard.local_start : shard.local_end]
    return grad


def compare(rank, world, ref, model, shards, scale=1.0, average=False, run=None):
    """Errors of ``model``'s loss and gradients on this rank's batch (``run``, default ``model``, runs
    the forward): ``expert`` (against the sum over ranks, times ``scale``), ``shared`` (the experts
    modules' other parameters), ``other``; with ``average``, non-expert gradients against the mean over
    ranks (a data-parallel wrapper's)."""
    loss_ref, own, summed = reference_grads(ref, rank, world)
    model.zero_grad()
    loss = loss_of(run or model, batch_of(rank))
    loss.backward()

    def grad_and_expected(name, p, kind):
        assert p.grad is not None, f"{name} has no gradient under EP"
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad  # FSDP2's shards, gathered
        if kind == "expert":
            return grad, local_slice(name, summed[name], model, shards) * scale
        return grad, summed[name] / world if average else own[name]

    return {"loss": max_rel(loss, loss_ref), **errors_by_kind(model, shards, grad_and_expected)}


def errors_by_kind(model, shards, compared) -> dict:
    """The largest relative error of ``compared(name, param, kind) -> (actual, expected)`` over
    ``model``'s parameters by kind (``expert``; ``shared``: the experts modules' other parameters;
    ``other``), and ``"counted"``: how many of each."""
    experts = {id(p) for p in epmoe.expert_parameters(model)}
    inside = {id(p) for s in shards for p in model.get_submodule(s.module_name).parameters()}
    errors = {"expert": 0.0, "shared": 0.0, "other": 0.0}
    counted = {"expert": 0, "shared": 0, "other": 0}
    for name, p in model.named_parameters():
        kind = "expert" if id(p) in experts else "shared" if id(p) in inside else "other"
        errors[kind] = max(errors[kind], max_rel(*compared(name, p, kind)))
        counted[kind] += 1
    return {**errors, "counted": counted}


def shared_parameters_case(rank, world, kind):
    """A model whose experts share parameters, EP over every rank, no wrapper: their gradient is the
    unsharded model's on this rank's batch; they are not expert parameters."""
    ref = build_family("muse_spark") if kind == "muse_spark" else build_custom(kind)
    model = copy.deepcopy(ref)
    shards = epmoe.apply_expert_parallel(model)
    not_experts = {
        id(p)
        for s in shards
        for p in model.get_submodule(s.module_name).parameters()
        if not epmoe.is_expert_parameter(p)
    }
    found = {id(p) for s in shards for _, p in shared_parameters(model.get_submodule(s.module_name))}
    assert found and not_experts == found, "the shared parameters are not exactly the non-expert ones"
    assert not found & {id(p) for p in epmoe.expert_parameters(model)}
    return compare(rank, world, ref, model, shards)


def shared_parameters_ddp_case(rank, world, kind):
    """The same under DistributedDataParallel: the shared parameters averaged with the rest, expert
    gradients ``expert_grad="auto"`` -> the mean over the data-parallel ranks."""
    ref = build_family("muse_spark") if kind == "muse_spark" else build_custom(kind)
    model = copy.deepcopy(ref)
    shards = epmoe.apply_expert_parallel(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    return compare(rank, world, ref, model, shards, scale=1.0 / world, average=True, run=ddp)


def shared_parameters_fsdp2_case(rank, world, kind):
    """The same under FSDP2 (``fully_shard`` with the expert parameters ignored, as docs/training.md's
    recipe): the shared parameters sharded and averaged with the rest."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ref = build_custom(kind)
    model = copy.deepcopy(ref)
    shards = epmoe.apply_expert_parallel(model)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), ignored_params=set(epmoe.expert_parameters(model)))
    return compare(rank, world, ref, model, shards, scale=1.0 / world, average=True)


class _WithLoss(torch.nn.Module):
    """A Trainer-facing model: ``forward(input_ids) -> {"loss": loss_of(inner, input_ids[0])}`` (one
    sample per device, itself a batch)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        return {"loss": loss_of(self.inner, input_ids[0])}


def shared_parameters_trainer_case(rank, world, kind):
    """The same under ``transformers.Trainer`` (``prepare_trainer``; DDP inside): one SGD step of
    learning rate 1 on each rank's batch moves every parameter by minus the unsharded model's gradient
    averaged over the ranks' batches (experts: their rows of it), whichever rank got which batch."""
    import tempfile

    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ref = build_custom(kind)
    model = _WithLoss(copy.deepcopy(ref))  # the module DDP wraps is the EP model
    shards = epmoe.apply_expert_parallel(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    samples = Dataset.from_dict({"input_ids": [batch_of(source).tolist() for source in range(world)]})
    samples.set_format("torch")
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=1,
        max_steps=1,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        remove_unused_columns=False,
    )
    trainer = epmoe.prepare_trainer(Trainer(model=model, args=args, train_dataset=samples))
    trainer.train()
    return _step_errors(rank, world, ref, model, shards, before, learning_rate=1.0)


def shared_parameters_deepspeed_case(rank, world, kind):
    """The same under DeepSpeed ZeRO-2 (``prepare_deepspeed``, DeepSpeed's SGD, no clipping): one step
    moves every parameter by minus the learning rate times that mean gradient."""
    import deepspeed
    from deepspeed_workers import ds_config  # sets DS_ACCELERATOR=cpu before deepspeed is imported

    ref = build_custom(kind)
    model = _WithLoss(copy.deepcopy(ref))
    shards = epmoe.apply_expert_parallel(model)
    epmoe.prepare_deepspeed(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = ds_config(2, optimizer="SGD", clip=0.0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    engine.backward(engine(batch_of(rank).unsqueeze(0))["loss"])
    engine.step()
    return _step_errors(rank, world, ref, model, shards, before, learning_rate=config["optimizer"]["params"]["lr"])


def _step_errors(rank, world, ref, model, shards, before, learning_rate):
    """Relative errors of one SGD step of ``model`` (a :class:`_WithLoss`, its parameters ``before``
    the step) against ``-learning_rate`` times the unsharded ``ref``'s gradient averaged over the
    ranks' batches (experts: their rows of it), by kind (``expert``, ``shared``, ``other``)."""
    _, _, summed = reference_grads(ref, rank, world)

    def step_and_expected(name, p, kind):
        expected = -learning_rate * local_slice(name, summed[name.removeprefix("inner.")], model, shards) / world
        return p.detach() - before[name], expected

    return errors_by_kind(model, shards, step_and_expected)


def float32_family_case(rank, world, family):
    """A family whose experts forward computes in float32. bfloat16: EP over every rank and the model
    without EP (the family's own experts loop), each one's distance from the float64 model on this
    rank's batch: per-token losses (the squared outputs' mean per token) and this rank's experts'
    gradients (summed over every rank's batch), ``||x - x64|| / ||x64||``; the largest difference of
    their outputs; the static transport's outputs against all-to-all-v's. float64: EP against the family's loop (``"exact"``, which computes in float32
    there too) and against epmoe's unsharded model (a group of one: ``"exact_one"``)."""
    groups = [dist.new_group([r]) for r in range(world)]
    ref64 = build_family(family)
    ep64 = copy.deepcopy(ref64)
    shards = epmoe.apply_expert_parallel(ep64)
    one = copy.deepcopy(ref64)
    epmoe.apply_expert_parallel(one, groups[rank])
    exact_one = compare(rank, world, one, ep64, shards)
    exact = compare(rank, world, ref64, ep64, shards)
    ref16 = to_dtype(copy.deepcopy(ref64), torch.bfloat16)
    ep16 = copy.deepcopy(ref16)
    epmoe.apply_expert_parallel(ep16)
    _, _, summed64 = reference_grads(ref64, rank, world)
    _, _, summed16 = reference_grads(ref16, rank, world)
    ep16.zero_grad()
    out_ep = outputs_of(ep16, batch_of(rank))
    out_ep.square().mean().backward()
    with torch.no_grad():
        out64, out16 = outputs_of(ref64, batch_of(rank)), outputs_of(ref16, batch_of(rank))
    static16 = copy.deepcopy(ref16)
    epmoe.apply_expert_parallel(static16, config={"dispatch": "static"})
    with torch.no_grad():
        out_static = outputs_of(static16, batch_of(rank))
    experts = [(n, p) for n, p in ep16.named_parameters() if epmoe.is_expert_parameter(p)]
    grads64 = torch.cat([local_slice(n, summed64[n], ep16, shards).reshape(-1) for n, _ in experts])
    grads16 = torch.cat([local_slice(n, summed16[n], ep16, shards).reshape(-1) for n, _ in experts])
    grads_ep = torch.cat([p.grad.double().reshape(-1) for _, p in experts])

    def distance(x, x64):
        return ((x.double() - x64).norm() / x64.norm()).item()

    def losses(out):
        return out.double().square().mean(-1)

    return {
        "exact": exact,
        "exact_one": exact_one,
        "experts": len(experts),
        "losses": {"ep": distance(losses(out_ep), losses(out64)), "no_ep": distance(losses(out16), losses(out64))},
        "expert_grads": {"ep": distance(grads_ep, grads64), "no_ep": distance(grads16, grads64)},
        "outputs_vs_no_ep": max_rel(out_ep.detach(), out16),
        "static_vs_alltoallv": max_rel(out_static, out_ep.detach()),
    }


SHARED_KINDS = ("muse_spark", "packed", "packed_gate", "module_list")


def all_cases():
    """Every case of tests/models/test_experts_inside.py, for one spawned run of 2 ranks."""
    cases = {f"shared/{kind}": (shared_parameters_case, (kind,)) for kind in SHARED_KINDS}
    cases["shared_ddp/muse_spark"] = (shared_parameters_ddp_case, ("muse_spark",))
    cases["shared_ddp/module_list"] = (shared_parameters_ddp_case, ("module_list",))
    cases["shared_fsdp2/packed"] = (shared_parameters_fsdp2_case, ("packed",))
    cases["shared_fsdp2/module_list"] = (shared_parameters_fsdp2_case, ("module_list",))
    cases["shared_trainer/packed"] = (shared_parameters_trainer_case, ("packed",))
    cases["shared_trainer/module_list"] = (shared_parameters_trainer_case, ("module_list",))
    cases["shared_deepspeed/packed"] = (shared_parameters_deepspeed_case, ("packed",))
    cases["shared_deepspeed/module_list"] = (shared_parameters_deepspeed_case, ("module_list",))
    for family in FLOAT32_FAMILIES:
        cases[f"float32/{family}"] = (float32_family_case, (family,))
    return cases
