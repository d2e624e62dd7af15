"""Rank functions for tests/ep/test_static.py (module level, so spawned ranks can import them).

Each case runs the same model (or experts module) twice on this rank's batch, once with
``dispatch="alltoallv"`` and once with ``dispatch="static"``, and returns which tensors differ
(bitwise in float64: ``torch.equal``) or their largest difference, so one failing case does not
hide the others (``ep_workers.run_cases`` batches them in one spawned run).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from ep_layer_workers import CASES_2, base_model, experts_of, make_inputs
from ep_workers import batch_of, silence_experts_of_rank

import epmoe
from epmoe.models import build_model


def _differences(pairs):
    """``{name: max |a - b|}`` of the pairs that are not bitwise equal (``{}``: all equal)."""
    return {
        name: (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
        for name, (a, b) in pairs.items()
        if not torch.equal(a, b)
    }


def _step(model, ids):
    """Forward + backward of a causal LM on ``ids``: ``{name: tensor}`` of logits, loss and every gradient."""
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    found = {"logits": out.logits.detach(), "loss": out.loss.detach()}
    found.update({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    return found


def model_static_vs_dynamic(rank, world, family, dtype_name, lengths, scenario="plain", config=None):
    """A causal LM of ``family`` on this rank's batch (``lengths[rank]`` tokens per sequence), dynamic
    vs static: ``{"differences": ..., "compared": n, "transport": name}``. ``scenario``:
    ``"silent_rank"`` (the last rank's experts get no token), ``"checkpointing"`` (gradient
    checkpointing, recomputing the layers in backward)."""
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    base = build_model(family, dtype=dtype)
    with torch.no_grad():  # GPT-OSS's expert biases start at zero: nonzero ones reach the router's gradient
        for name, param in base.named_parameters():
            if name.endswith("_proj_bias"):
                param.normal_(0, 0.5)
    if scenario == "silent_rank":
        silence_experts_of_rank(base, world - 1, world)
    dynamic, static = copy.deepcopy(base), copy.deepcopy(base)
    epmoe.apply_expert_parallel(dynamic, config={"dispatch": "alltoallv"})
    epmoe.apply_expert_parallel(static, config={"dispatch": "static", **(config or {})})
    for model in (dynamic, static):
        if scenario == "checkpointing":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train(scenario == "checkpointing")
    ids = batch_of(rank, lengths)
    want, got = _step(dynamic, ids), _step(static, ids)
    assert set(want) == set(got), sorted(set(want) ^ set(got))
    names = {state.transport.name for _, _, state in epmoe.ep.state.ep_states(static)}
    return {
        "differences": _differences({n: (got[n], want[n]) for n in want}),
        "compared": len(want),
        "transport": sorted(names),
    }


def layer_static_vs_dynamic(rank, world, case_names, dtype_name="float64", config=None):
    """The first experts module called directly on the routing cases of ``ep_layer_workers.CASES_2``
    (ranks with different token counts, a rank with none, an expert with none, a rank receiving
    nothing): ``{case: differences}``, bitwise."""
    dtype = getattr(torch, dtype_name)
    base = base_model("qwen3_moe").to(dtype)
    dynamic, static = copy.deepcopy(base), copy.deepcopy(base)
    epmoe.apply_expert_parallel(dynamic, config={"dispatch": "alltoallv"})
    epmoe.apply_expert_parallel(static, config={"dispatch": "static", **(config or {})})
    out = {}
    for seed, name in enumerate(case_names):
        K, lengths, kind, arg = CASES_2[name]
        hidden, index, weights, grad_out = make_inputs(seed, rank, lengths[rank % len(lengths)], K, kind, arg, world)
        found = {}
        for label, model in (("dynamic", dynamic), ("static", static)):
            experts = experts_of(model)
            experts.zero_grad(set_to_none=True)
            h = hidden.to(dtype).requires_grad_(True)
            w = weights.to(dtype).requires_grad_(True)
            y = experts(h, index, w)
            (y * grad_out.to(dtype)).sum().backward()
            found[label] = {
                "out": y.detach(),
                "hidden_grad": h.grad,
                "weights_grad": w.grad,
                **{n: p.grad for n, p in experts.named_parameters()},
            }
        out[name] = _differences({n: (found["static"][n], found["dynamic"][n]) for n in found["dynamic"]})
    return out


def no_host_read(rank, world, static_tokens):
    """A layer's forward + backward at EP 2 in float32 (``torch`` grouped-matmul backend) with
    ``check_steps`` off: the host reads and exchanges of the first call and of a second one, for
    both transports."""
    from host_reads import counting_host_reads

    from epmoe.comm import count_traffic

    base = base_model("qwen3_moe").float()
    out = {}
    for dispatch in ("alltoallv", "static"):
        model = copy.deepcopy(base)
        config = {"dispatch": dispatch, "check_steps": False, "gmm_backend": "torch"}
        if dispatch == "static":
            config["static_tokens"] = static_tokens
        epmoe.apply_expert_parallel(model, config=config)
        experts = experts_of(model)
        hidden, index, weights, grad_out = make_inputs(3, rank, [12, 7][rank], 2, "random", None, world)
        calls = []
        for _ in range(2):
            h, w = hidden.float().requires_grad_(), weights.float().requires_grad_()
            with counting_host_reads() as reads, count_traffic() as traffic:
                y = experts(h, index, w)
                (y * grad_out.float()).sum().backward()
            calls.append({"reads": list(reads), "exchanges": traffic.exchanges, "bytes": traffic.bytes_to_peers})
        out[dispatch] = calls
    return out


def overflow(rank, world, check_steps, static_tokens):
    """A rank whose batch outgrows the static buffer: with ``check_steps`` on and no fixed size the
    ranks re-agree (the outputs still equal the dynamic path's); otherwise every rank raises.
    Returns ``{"equal": bool}`` or ``{"raised": message}``."""
    base = base_model("qwen3_moe")
    dynamic, static = copy.deepcopy(base), copy.deepcopy(base)
    epmoe.apply_expert_parallel(dynamic, config={"dispatch": "alltoallv"})
    epmoe.apply_expert_parallel(
        static, config={"dispatch": "static", "check_steps": check_steps, "static_tokens": static_tokens}
    )
    results = []
    for step, lengths in enumerate(([4, 4], [4, 9], [3, 2])):  # rank 1 grows at the second forward
        hidden, index, weights, _ = make_inputs(40 + step, rank, lengths[rank % 2], 2, "random", None, world)
        want = experts_of(dynamic)(hidden, index, weights)
        try:
            got = experts_of(static)(hidden, index, weights)
        except (ValueError, RuntimeError) as exc:
            return {"raised": str(exc), "step": step}
        results.append(torch.equal(got, want))
    return {"equal": results, "block": experts_of(static)._epmoe.transport.block}


def out_of_step(rank, world):
    """Rank 1 skips a layer's forward with ``check_steps`` off: every rank raises (device assert),
    none hangs."""
    base = base_model("qwen3_moe")
    model = copy.deepcopy(base)
    epmoe.apply_expert_parallel(model, config={"dispatch": "static", "check_steps": False, "static_tokens": 8})
    hidden, index, weights, _ = make_inputs(5, rank, 6, 2, "random", None, world)
    first, second = model.model.layers[0].mlp.experts, model.model.layers[1].mlp.experts
    try:
        (first if rank == 0 else second)(hidden, index, weights)
    except RuntimeError as exc:
        return {"raised": str(exc)}
    return {"raised": None}


def static_generate(rank, world):
    """``generate`` under EP 2 with ``dispatch="static"`` gives the same tokens as dynamic (ranks with
    different batch sizes and prompt lengths)."""
    torch.manual_seed(0)
    base = build_model("qwen3_moe", dtype=torch.float32).eval()
    dynamic, static = copy.deepcopy(base), copy.deepcopy(base)
    epmoe.apply_expert_parallel(dynamic, config={"dispatch": "alltoallv"})
    epmoe.apply_expert_parallel(static, config={"dispatch": "static"})
    g = torch.Generator().manual_seed(77 + rank)
    prompt = torch.randint(0, 200, ([1, 3][rank], [5, 7][rank]), generator=g)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = dynamic.generate(prompt, **kwargs)
        got = static.generate(prompt, **kwargs)
    dist.barrier()
    return {"equal": torch.equal(want, got), "tokens": got.tolist()}


def compiled_static(rank, world, static_tokens=24):
    """``torch.compile(model, fullgraph=True)`` of an EP-2 Qwen3-MoE (float32) with
    ``dispatch="static"``: forward and backward as one graph, against the same model run eagerly,
    over two steps (the second under ``fail_on_recompile``). Returns the largest loss and gradient
    differences, whether the logits were allclose (1e-5), and the graph breaks
    ``torch._dynamo.explain`` finds."""
    import contextlib

    import torch._dynamo
    from compile_workers import break_sites, train_step

    torch._dynamo.reset()
    config = {"dispatch": "static", "check_steps": False, "static_tokens": static_tokens}

    def make():
        model = build_model("qwen3_moe", num_experts=8, top_k=2, dtype=torch.float32)
        epmoe.apply_expert_parallel(model, config=config)
        return model

    eager, compiled = make(), torch.compile(make(), fullgraph=True)
    loss_diff, grad_diff, logits_close = 0.0, 0.0, True
    for step in range(2):
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))
        stance = torch.compiler.set_stance("fail_on_recompile") if step else contextlib.nullcontext()
        with stance:
            loss_c, grads_c, logits_c = train_step(compiled, ids)
        loss_e, grads_e, logits_e = train_step(eager, ids)
        logits_close &= torch.allclose(logits_c, logits_e, rtol=1e-5, atol=1e-5)
        loss_diff = max(loss_diff, (loss_c - loss_e).abs().item())
        assert sorted(grads_c) == sorted(grads_e)
        for name, g in grads_e.items():
            rel = (grads_c[name] - g).abs().max() / g.abs().max().clamp_min(1e-30)
            grad_diff = max(grad_diff, rel.item())
    return {
        "loss_diff": loss_diff,
        "grad_diff": grad_diff,
        "logits_close": logits_close,
        "sites": break_sites(make(), ids),
    }


def wrapped_static_vs_dynamic(rank, world, wrap):
    """Dynamic vs static under a data-parallel setup, float64, bitwise: ``"ddp"`` (EP over every
    rank, DistributedDataParallel around it: expert gradients averaged), ``"mesh"`` (a ("dp", "ep")
    = (world/2, 2) mesh, DDP over every rank: the "dp" reduction of the expert gradients), ``"fsdp2"``
    (``fully_shard`` per decoder layer and on the root, the experts ignored; gradient shards compared
    whole), two steps each. ``{"differences": ..., "compared": n}``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    def fsdp2(model):
        experts, mesh = set(epmoe.expert_parameters(model)), init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=experts)
        return fully_shard(model, mesh=mesh, ignored_params=experts)

    torch.manual_seed(0)
    base = build_model("qwen3_moe", dtype=torch.float64)
    group = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep")) if wrap == "mesh" else None
    found = {}
    for dispatch in ("alltoallv", "static"):
        model = copy.deepcopy(base)
        epmoe.apply_expert_parallel(model, group, config={"dispatch": dispatch})
        model = fsdp2(model) if wrap == "fsdp2" else DDP(model)
        for step in range(2):
            ids = batch_of(rank, [5 + step, 9, 7, 4])
            found[dispatch, step] = {
                name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in _step(model, ids).items()
            }
    pairs = {
        f"{name}/{step}": (found["static", step][name], found["alltoallv", step][name])
        for step in range(2)
        for name in found["alltoallv", step]
    }
    return {"differences": _differences(pairs), "compared": len(pairs)}


def trainer_static(rank, world, out_dir):
    """``prepare_trainer`` (transformers.Trainer: AdamW, clipping, gradient checkpointing,
    accumulation 2, evaluate, save_model) on the EP model with ``dispatch="static"`` against the same
    Trainer on the unsharded model, float64: ``training_workers.trainer_parity``'s per-parameter errors."""
    from training_workers import trainer_parity

    return trainer_parity(rank, world, out_dir, dtype_name="float64", config={"dispatch": "static"})


def auto_generate(rank, world):
    """``dispatch="auto"``: ``generate`` gives the dynamic path's tokens and runs each layer's
    prompt forward on the all-to-all-v, every decode step on the static exchange (ranks with
    different batch sizes, prompt lengths and ``max_new_tokens``; then ``use_cache=False``, whose
    growing decode steps re-agree the buffer); afterwards a training step runs the all-to-all-v
    alone. ``{"equal": [...], "calls": {...}, "transports": [...]}`` (calls: dispatches per transport,
    per layer)."""
    from epmoe.ep.dispatch.alltoallv import AllToAllVDispatcher
    from epmoe.ep.dispatch.static import StaticDispatcher

    torch.manual_seed(0)
    base = build_model("qwen3_moe", dtype=torch.float64).eval()
    dynamic, auto = copy.deepcopy(base), copy.deepcopy(base)
    epmoe.apply_expert_parallel(dynamic, config={"dispatch": "alltoallv"})
    epmoe.apply_expert_parallel(auto)
    layers, calls, label = base.config.num_hidden_layers, {}, None
    originals = {cls: cls.dispatch for cls in (AllToAllVDispatcher, StaticDispatcher)}
    counting = [False]  # while `auto` runs

    def counted(cls):
        def dispatch(self, *args, **kwargs):
            if counting[0]:
                calls[label, cls.name] = calls.get((label, cls.name), 0) + 1 / layers
            return originals[cls](self, *args, **kwargs)

        return dispatch

    g = torch.Generator().manual_seed(5 + rank)
    prompt = torch.randint(0, 200, ([1, 3][rank], [5, 7][rank]), generator=g)
    runs = {
        "cached": dict(max_new_tokens=[6, 4][rank], min_new_tokens=[6, 4][rank]),
        "no_cache": dict(max_new_tokens=4, use_cache=False),
    }
    equal = []
    try:
        for cls in originals:
            cls.dispatch = counted(cls)
        for label, kwargs in runs.items():  # noqa: B007 - label is read by counted()'s dispatch
            with torch.no_grad():
                want = dynamic.generate(prompt, do_sample=False, pad_token_id=0, **kwargs)
                counting[0] = True
                got = auto.generate(prompt, do_sample=False, pad_token_id=0, **kwargs)
                counting[0] = False
            equal.append(torch.equal(want, got))
        label, counting[0] = "train", True
        auto.train()
        ids = batch_of(rank, [6, 9])
        loss = auto(ids, labels=ids).loss
        loss.backward()
    finally:
        for cls, dispatch in originals.items():
            cls.dispatch = dispatch
    dist.barrier()
    return {
        "equal": equal,
        "calls": {f"{k[0]}/{k[1]}": round(v, 6) for k, v in calls.items()},
        "transports": sorted({state.transport.name for _, _, state in epmoe.ep.state.ep_states(auto)}),
    }
