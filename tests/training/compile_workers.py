"""``torch.compile`` of EP models against the same EP models run eagerly (module level, so spawned
ranks can import it)."""

import contextlib

import torch
import torch._dynamo
import torch._inductor.config
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import epmoe
from epmoe.models import build_model


def ep_model(family, dtype, group=None):
    model = build_model(family, num_experts=8, top_k=2, dtype=dtype)
    epmoe.apply_expert_parallel(model, group)
    return model


def train_step(model, ids):
    """Loss, every parameter's gradient (names without torch.compile's ``_orig_mod.`` and DDP's
    ``module.`` prefixes) and the logits."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {
        name.removeprefix("_orig_mod.").removeprefix("module."): p.grad
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    return out.loss.detach(), grads, out.logits.detach()


def break_sites(model, ids):
    """Distinct ``(reason, function)`` of the graph breaks ``torch._dynamo.explain`` finds in a forward."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    return sorted(
        {(r.reason.splitlines()[0], r.user_stack[-1].name if r.user_stack else "?") for r in explained.break_reasons}
    )


def compile_checks(rank, world, ep_size):
    """``{case: compiled_vs_eager(...)}``. ``ep_size`` 1: this rank's own cases, on a group of one
    (the ranks compile in parallel); 2: the cases of both ranks together."""
    if ep_size == 1:
        own_group = [dist.new_group([r]) for r in range(world)][rank]
        cases = [("qwen3_moe", "float32"), ("gpt_oss", "float32")] if rank == 0 else [("qwen3_moe", "bfloat16")]
        return {("ep1", family, dtype): compiled_vs_eager(rank, family, dtype, own_group) for family, dtype in cases}
    results = {
        ("ep2", "qwen3_moe", dtype): compiled_vs_eager(rank, "qwen3_moe", dtype, dist.group.WORLD)
        for dtype in ("float32", "bfloat16")
    }
    results["ep2 ddp", "qwen3_moe", "float32"] = compiled_vs_eager(
        rank, "qwen3_moe", "float32", dist.group.WORLD, wrap=DDP
    )
    return results


def compiled_vs_eager(rank, family, dtype_name, group, steps=2, wrap=None):
    """The largest loss difference, each parameter's largest gradient difference over the eager
    gradient's largest magnitude (over ``steps`` steps on fresh batches, every step after the first
    under ``fail_on_recompile``), whether the logits were allclose at rtol = atol = 1e-5 at every step,
    whether the expert loads (telemetry) agreed after every step, and the graph-break sites. Inductor rounds bf16 intermediates as eager does
    (``emulate_precision_casts``): else a routing choice on a near tie may flip, and whole tokens move
    between experts. ``wrap``: a wrapper (DDP) around both models, inside ``torch.compile``."""
    dtype = getattr(torch, dtype_name)
    torch._dynamo.reset()
    wrap = wrap or (lambda model: model)
    eager, compiled = wrap(ep_model(family, dtype, group)), torch.compile(wrap(ep_model(family, dtype, group)))
    loss_diff, grad_diff, names, same_loads, logits_close = 0.0, {}, None, True, True
    for step in range(steps):
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))
        stance = torch.compiler.set_stance("fail_on_recompile") if step else contextlib.nullcontext()
        with stance, torch._inductor.config.patch(emulate_precision_casts=True):
            loss_c, grads_c, logits_c = train_step(compiled, ids)
        loss_e, grads_e, logits_e = train_step(eager, ids)
        logits_close &= torch.allclose(logits_c, logits_e, rtol=1e-5, atol=1e-5)
        loads_c, loads_e = epmoe.expert_load(compiled), epmoe.expert_load(eager)
        same_loads &= loads_c.keys() == loads_e.keys() and all(torch.equal(loads_c[k], loads_e[k]) for k in loads_e)
        names = (sorted(grads_c), sorted(grads_e))
        loss_diff = max(loss_diff, (loss_c - loss_e).abs().item())
        for name, g in grads_e.items():
            rel = (grads_c[name].double() - g.double()).abs().max() / g.double().abs().max().clamp_min(1e-30)
            grad_diff[name] = max(grad_diff.get(name, 0.0), rel.item())
    return dict(
        loss_diff=loss_diff,
        grad_diff=grad_diff,
        names=names,
        same_loads=same_loads,
        logits_close=logits_close,
        sites=break_sites(wrap(ep_model(family, dtype, group)), ids),
    )
