"""Rank functions for the launcher tests (module level, so spawned ranks can import them): the paths
users take around epmoe (deep copies, groups made after other groups, dtypes, timeouts, Auto classes)."""

import copy
import datetime
import time

import torch
import torch.distributed as dist

import epmoe
from epmoe.models import build_model

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def batch_of(rank, batch=2, length=9, vocab=64):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, vocab, (batch, length), generator=g)


def ep_vs_unsharded_grads(model, ref, rank, world):
    """Max relative difference, per parameter, between the EP ``model``'s gradients on this rank's
    batch and the unsharded ``ref``'s: other parameters on the same batch, expert slices summed over
    every rank's batch (the EP contract). Both models' gradients are set here."""
    model.zero_grad()
    ids = batch_of(rank)
    model(ids, labels=ids).loss.backward()
    grads = {}
    for source in range(world):
        ref.zero_grad()
        ids = batch_of(source)
        ref(ids, labels=ids).loss.backward()
        for name, p in ref.named_parameters():
            if source == rank or name.endswith(EXPERTS):
                grads[name] = grads.get(name, 0) + p.grad
    local = {}
    for name, p in model.named_parameters():
        expected = grads[name]
        if name.endswith(EXPERTS):
            e = p.shape[0]
            expected = expected[rank * e:(rank + 1) * e]
        scale = expected.abs().max().clamp_min(1e-12)
        local[name] = ((p.grad - expected).abs().max() / scale).item()
    assert local, "compared nothing"
    return max(local.values()), len(local)


def deep_copies(rank, world):
    """``copy.deepcopy`` of an EP model (and TRL's ``create_reference_model``): an independent EP model
    whose outputs and gradients equal the unsharded model's, with its own weights."""
    torch.manual_seed(0)
    ref = build_model("qwen3_moe", dtype=torch.float64)
    model = copy.deepcopy(ref)
    epmoe.apply_expert_parallel(model)
    twin = copy.deepcopy(model)
    out = {"twin_vs_unsharded": ep_vs_unsharded_grads(twin, ref, rank, world)}
    torch.optim.SGD(twin.parameters(), lr=0.1).step()
    out["original_untouched"] = all(torch.equal(p, q) for (n, p), (_, q) in zip(
        model.named_parameters(), copy.deepcopy(ref).named_parameters()) if not n.endswith(EXPERTS))
    out["twin_moved"] = any(not torch.equal(p, q) for p, q in zip(twin.parameters(), model.parameters()))
    out["copy_is_ep"] = len(epmoe.expert_parameters(twin)) == 2 * len(twin.model.layers)
    out["original_vs_unsharded"] = ep_vs_unsharded_grads(model, ref, rank, world)
    from trl import create_reference_model

    frozen = create_reference_model(model)
    ids = batch_of(rank)
    with torch.no_grad():
        out["reference_model_logits"] = (frozen(ids).logits - ref(ids).logits).abs().max().item()
    out["reference_model_frozen"] = not any(p.requires_grad for p in frozen.parameters())
    return out


def dtype_on_one_rank(rank, world):
    """One rank casts its EP model to bf16 after apply_expert_parallel: every rank raises a clear
    ValueError at the next forward (no abort inside gloo)."""
    model = build_model("qwen3_moe")
    epmoe.apply_expert_parallel(model, config={"timeout": 30})
    if rank == 1:
        model.to(torch.bfloat16)
    ids = batch_of(rank)
    start = time.monotonic()
    try:
        model(ids)
    except ValueError as error:
        return str(error), time.monotonic() - start
    return None, time.monotonic() - start


def shorter_group_timeout(rank, world):
    """A process group whose timeout is shorter than epmoe's default bounds epmoe's waits too."""
    from epmoe.comm.steps import group_timeout_s, step_timeout_s

    short = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=7))
    return group_timeout_s(short), step_timeout_s(None, short), step_timeout_s(None, None), step_timeout_s(3, short)


def groups_after_other_groups(rank, world):
    """Ranks 0 and 1 train an EP model on their own pair first; then EP over all ranks must still form
    its groups (their names may not depend on what a process did before)."""
    torch.manual_seed(0)
    pair, other = dist.new_group([0, 1]), dist.new_group([2, 3])
    if rank < 2:
        first = build_model("qwen3_moe")
        epmoe.apply_expert_parallel(first, pair)
        ids = batch_of(rank)
        first(ids, labels=ids).loss.backward()
    ref = build_model("qwen3_moe", dtype=torch.float64)
    model = copy.deepcopy(ref)
    epmoe.apply_expert_parallel(model, config={"timeout": 60})
    return ep_vs_unsharded_grads(model, ref, rank, world)


def auto_class_loading(rank, world, path):
    """``epmoe.from_pretrained`` takes Auto classes: same weights and logits as the concrete class."""
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    auto, auto_shards = epmoe.from_pretrained(AutoModelForCausalLM, path, dtype=torch.float64)
    concrete, shards = epmoe.from_pretrained(Qwen3MoeForCausalLM, path, dtype=torch.float64)
    ids = batch_of(rank)
    same = all(torch.equal(p, q) for p, q in zip(auto.parameters(), concrete.parameters()))
    with torch.no_grad():
        diff = (auto(ids).logits - concrete(ids).logits).abs().max().item()
    return type(auto).__name__, same, diff, auto_shards == shards


def launcher_cases(rank, world, path):
    """Every 2-rank case of tests/test_launchers.py in one spawn: ``{case: result or error text}``."""
    results = {}
    for name, run in (("deep_copies", lambda: deep_copies(rank, world)),
                      ("dtype_on_one_rank", lambda: dtype_on_one_rank(rank, world)),
                      ("shorter_group_timeout", lambda: shorter_group_timeout(rank, world)),
                      ("auto_class_loading", lambda: auto_class_loading(rank, world, path))):
        results[name] = run()
        dist.barrier()
    return results
