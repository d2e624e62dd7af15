"""Rank functions for the expert-parallel tests (module level, so spawned ranks can import them)."""

import copy
import traceback

import torch
import torch.distributed as dist

import epmoe
from epmoe.models import build_model

VOCAB = 256


def batch_of(rank, lengths, batch=2, vocab=64):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, vocab, (batch, lengths[rank]), generator=g)


def silence_experts_of_rank(model, rank, ep_size):
    """Make the router never pick rank ``rank``'s experts (they receive no tokens), through the
    selection bias of routers that have one (DeepSeek-V3's correction bias, GPT-OSS's router bias)."""
    silenced = 0
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is None and type(module).__name__.endswith("TopKRouter"):
                bias = module.bias
            if bias is not None:
                local = bias.shape[0] // ep_size
                bias[rank * local : (rank + 1) * local] = -1e4
                silenced += 1
    assert silenced, "no router with a selection bias"


def max_rel(a, b):
    scale = b.abs().max().clamp_min(1e-12)
    return ((a - b).abs().max() / scale).item()


def model_parity(rank, world, family, dtype_name, lengths, scenario):
    """EP model on this rank's batch vs the unsharded model on every rank's batch: max relative errors."""
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    ref = build_model(family, dtype=dtype)
    if scenario == "silent_rank":
        silence_experts_of_rank(ref, world - 1, world)
    model = copy.deepcopy(ref)
    if scenario == "experts_implementation":  # set to epmoe's transformers experts implementation, run once
        model.set_experts_implementation("epmoe")
        with torch.no_grad():
            model(batch_of(rank, lengths))
    config = {"dispatch": "fused", "num_chunks": 2} if scenario == "fused" else None
    shards = epmoe.apply_expert_parallel(model, config=config)
    if scenario == "fused":
        assert all(model.get_submodule(s.module_name)._epmoe.transport.name == "fused" for s in shards)
    errors = {}

    ids = batch_of(rank, lengths)
    out = model(ids, labels=ids)
    out.loss.backward()

    ref_params = dict(ref.named_parameters())
    expert_names = {
        f"{s.module_name}.{n}"
        for s in shards
        for n, _ in model.get_submodule(s.module_name).named_parameters(recurse=False)
    }
    expert_grad_sum = {name: torch.zeros_like(ref_params[name]) for name in expert_names}
    for source in range(world):
        ref.zero_grad()
        src_ids = batch_of(source, lengths)
        ref_out = ref(src_ids, labels=src_ids)
        ref_out.loss.backward()
        for name in expert_names:
            expert_grad_sum[name] += ref_params[name].grad
        if source == rank:
            errors["logits"] = max_rel(out.logits, ref_out.logits)
            errors["loss"] = max_rel(out.loss, ref_out.loss)
            own = {n: p.grad.clone() for n, p in ref_params.items() if n not in expert_names and p.grad is not None}
    errors["non_expert_grads"] = 0.0
    errors["router_grads"] = 0.0
    compared = {"non_expert_grads": 0, "router_grads": 0, "expert_grads": 0}
    for name, param in model.named_parameters():
        if name in expert_names:
            continue
        if param.grad is None:
            assert name not in own, f"{name} has no gradient under EP"
            continue
        err = max_rel(param.grad, own[name])
        errors["non_expert_grads"] = max(errors["non_expert_grads"], err)
        compared["non_expert_grads"] += 1
        if ".gate." in name or ".router." in name:
            errors["router_grads"] = max(errors["router_grads"], err)
            compared["router_grads"] += 1
    errors["expert_grads"] = 0.0
    for shard in shards:
        module = model.get_submodule(shard.module_name)
        for name, param in module.named_parameters(recurse=False):
            assert param.grad is not None, f"{shard.module_name}.{name} has no gradient under EP"
            compared["expert_grads"] += 1
            full = expert_grad_sum[f"{shard.module_name}.{name}"][shard.local_start : shard.local_end]
            if scenario == "silent_rank" and rank == world - 1:
                assert torch.count_nonzero(param.grad) == 0
            errors["expert_grads"] = max(
                errors["expert_grads"],
                max_rel(param.grad, full) if full.abs().max() > 0 else param.grad.abs().max().item(),
            )
    assert len(shards) >= 1 and all(s.ep_size == world and s.ep_rank == dist.get_rank() for s in shards)
    errors["compared"] = compared  # tensors compared per kind: the test requires each to be > 0
    return errors


def module_list_parity(rank, world, expert_kind):
    """A custom model with nn.ModuleList experts: EP on this rank vs the unsharded model."""
    from custom_moe import BiasedExpert, ExpertMLP, TinyMoELM

    torch.manual_seed(0)
    ref = TinyMoELM(expert_cls={"mlp": ExpertMLP, "biased": BiasedExpert}[expert_kind]).double()
    model = copy.deepcopy(ref)
    shards = epmoe.apply_expert_parallel(model)
    names = [n for n, _ in model.named_parameters()]
    local = range(shards[0].local_start, shards[0].local_end)
    assert all(any(f"experts.{i}." in n for n in names) for i in local)
    assert not any(f"blocks.0.experts.{i}." in n for n in names for i in set(range(4)) - set(local))
    assert set(names) <= {n for n, _ in ref.named_parameters()}

    lengths = [5, 11, 3, 7]
    out = model(batch_of(rank, lengths))
    out.square().mean().backward()
    errors = {}
    ref_params = dict(ref.named_parameters())
    expert_sum = {n: torch.zeros_like(p) for n, p in ref_params.items()}
    for source in range(world):
        ref.zero_grad()
        ref_out = ref(batch_of(source, lengths))
        ref_out.square().mean().backward()
        for n, p in ref_params.items():
            if ".experts." in n:
                expert_sum[n] += p.grad
        if source == rank:
            errors["output"] = max_rel(out, ref_out)
            own = {n: p.grad.clone() for n, p in ref_params.items()}
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient under EP: {missing}"
    grads = [max_rel(p.grad, expert_sum[n] if ".experts." in n else own[n]) for n, p in model.named_parameters()]
    errors["grads"] = max(grads)
    errors["compared"] = {
        "grads": len(grads),
        "expert_grads": sum(".experts." in n for n, _ in model.named_parameters()),
    }
    return errors


def run_cases(rank, world, cases):
    """Run ``cases`` (``{label: (fn, args)}``, ``fn(rank, world, *args)``) one after the other on this
    process group; ``{label: result}``, or ``{label: {"error": traceback}}`` for a case that raised
    (the others still run). A barrier after each case keeps the ranks in step."""
    out = {}
    for label, (fn, args) in cases.items():
        try:
            out[label] = fn(rank, world, *args)
        except BaseException:  # noqa: BLE001 - the test reports it, naming the case
            out[label] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


def one_rank_fails_validation(rank, world):
    """Only rank 1's model is broken: both ranks raise (rank 0 naming rank 1's error), none hangs,
    neither model is changed."""
    from custom_moe import TinyMoELM
    from torch import nn

    model = TinyMoELM()
    if rank == 1:
        model.blocks[1].gate = nn.Sequential(nn.Linear(16, 4, bias=False))
    try:
        epmoe.apply_expert_parallel(model)
    except ValueError as error:
        assert not any(hasattr(m, "_epmoe") for m in model.modules())
        dist.barrier()  # still in step
        return str(error)
    return None


def disagreeing_config(rank, world):
    """Ranks pass different configs or models whose experts differ (dtype, hidden size, expert width):
    every rank must raise ValueError before changing the model, none may hang or abort. Returns the
    message per case."""
    cases = {
        "config": ({}, {"dispatch": "fused" if rank else "alltoallv"}),
        "dtype": ({"dtype": torch.bfloat16 if rank else torch.float32}, {}),
        "hidden_size": ({"hidden_size": 64 + 32 * rank}, {}),
        "moe_intermediate_size": ({"moe_intermediate_size": 32 + 16 * rank}, {}),
    }
    messages = {}
    for case, (model_kwargs, config) in cases.items():
        model = build_model("qwen3_moe", **model_kwargs)
        try:
            epmoe.apply_expert_parallel(model, config=config)
            messages[case] = None
        except ValueError as error:
            assert not any(hasattr(m, "_epmoe") for m in model.modules())
            messages[case] = str(error)
        dist.barrier()  # still in step
    return messages
