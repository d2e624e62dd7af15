"""Rank functions for tests/models/test_transformers_ep.py: transformers' own expert parallelism with
``ep_implementation="epmoe"`` against the same load with ``"all_to_all"``, on spawned gloo ranks."""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

import epmoe  # registers ep_implementation="epmoe"
from epmoe.bench.versus import _rel, _train
from epmoe.ep.counters import counted_modules
from epmoe.integrations import transformers_ep

# configured registrations the cases load with (registered on each rank, as a user would)
CONFIGURED = {
    "epmoe-static": {"dispatch": "static", "static_tokens": 64, "check_steps": False},
    "epmoe-capacity": {"capacity_factor": 1.0},
    "epmoe-replicas": {"replicas": 2},
    "epmoe-fused": {"dispatch": "fused"},
    "epmoe-unchecked": {"check_steps": False},  # what accelerators default to
    "epmoe-two-nodes": {"ranks_per_node": 2},  # EP 4 over 2 emulated nodes: "auto" takes the two-level exchange
}


def load(
    path: str, implementation: str, dtype: torch.dtype, ep_size: int, fsdp_size: int, tp_size: int = 1
) -> torch.nn.Module:
    """The saved model through transformers' own EP, its experts exchanged by ``implementation``."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if implementation in CONFIGURED:
        transformers_ep.register(implementation, CONFIGURED[implementation])
    return AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        experts_implementation="eager" if dtype == torch.float64 else "grouped_mm",  # grouped_mm takes no float64
        distributed_config=DistributedConfig(
            ep_size=ep_size, fsdp_size=fsdp_size, tp_size=tp_size, ep_implementation=implementation
        ),
    )


def _skewed(model: torch.nn.Module) -> None:
    """Every router's weights zero: every token picks the same K experts (topk's ties), all on one EP
    rank: the other rank receives nothing and most experts get no token."""
    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    with torch.no_grad():
        for router in routers:
            router.weight.zero_()
        weight = routers[0].weight
        weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight  # FSDP2 shards it
        scores = torch.softmax(torch.randn(6, weight.shape[1], dtype=weight.dtype) @ weight.T, dim=-1)
        index_TK = torch.topk(scores, model.config.num_experts_per_tok).indices  # what the router picks
    assert (index_TK // (model.config.num_experts // 2)).unique().numel() == 1, index_TK  # one EP rank's experts


def compared(
    rank: int,
    path: str,
    dtype: torch.dtype,
    ep_size: int,
    world: int,
    variant: str,
    implementation: str = "epmoe",
    tp_size: int = 1,
) -> dict:
    """``{"loss": ..., "grads": ..., "compared": n}``: the largest relative differences of ``"epmoe"``
    from ``"all_to_all"`` over a few AdamW steps (every parameter's whole gradient), the batches of
    ranks in different TP groups of different lengths; ``variant``: ``"plain"``, ``"checkpointing"``
    (gradient checkpointing on), ``"skewed"`` (routers zeroed: one rank receives every token)."""
    runs = {}
    for name in ("all_to_all", implementation):
        model = load(path, name, dtype, ep_size, world // tp_size, tp_size)
        if variant == "checkpointing":
            model.gradient_checkpointing_enable()
        if variant == "skewed":
            _skewed(model)
        runs[name] = _train(model, rank // tp_size, 0, reduce=False)  # the ranks of a TP group share a batch
    ref, got = runs["all_to_all"], runs[implementation]
    return {
        "loss": max(map(_rel, got["loss"], ref["loss"])),
        "grads": max(_rel(s[n], r[n]) for s, r in zip(got["grads"], ref["grads"]) for n in r),
        "compared": len(ref["grads"][0]),
        "transports": sorted({layer.training.name for _, layer in counted_modules(model)}),
    }


def generated(rank: int, path: str, ep_size: int, world: int, implementation: str = "epmoe", tp_size: int = 1) -> bool:
    """Whether greedy ``generate`` gives the same tokens with ``implementation`` as with ``"all_to_all"``
    (TP groups with prompts of different lengths)."""
    group = rank // tp_size  # the ranks of a TP group share a batch
    g = torch.Generator().manual_seed(11 + group)
    prompt = torch.randint(0, 200, (1, 4 + 3 * group), generator=g)
    tokens = {}
    for name in ("all_to_all", implementation):
        model = load(path, name, torch.float64, ep_size, world // tp_size, tp_size).eval()
        with torch.no_grad():
            tokens[name] = model.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    return torch.equal(tokens["all_to_all"], tokens[implementation])


def cases(rank: int, world: int, runs: dict) -> dict:
    """Every case of ``runs`` (``{label: (kind, arguments)}``) on these ranks: ``{label: result}``, a
    case that raised as ``{"error": traceback}`` (the others still run)."""
    out = {}
    for label, (kind, args) in runs.items():
        try:
            out[label] = KINDS[kind](rank, *args)
        except Exception:  # noqa: BLE001 - reported by the test that reads this case
            out[label] = {"error": traceback.format_exc()[-3000:]}
        dist.barrier()
    return out


def refused(rank: int, world: int, path: str) -> dict:
    """``{case: the error it raises on this rank, or "no error"}``: loading an implementation
    registered with ``capacity_factor``, expert replicas, or the fused ops; calling experts whose EP group shares
    one batch (``ep_size == tp_size``) with batches of different sizes."""
    out = {}
    for case, loading in (
        ("capacity_factor", lambda: load(path, "epmoe-capacity", torch.float32, 2, 2)),
        ("fused", lambda: load(path, "epmoe-fused", torch.float32, 2, 2)),
        ("replicas", lambda: load(path, "epmoe-replicas", torch.float32, 2, 2)),
        ("batches of two sizes", lambda: _uneven_shared_batch(rank, path)),
    ):
        try:
            loading()
            out[case] = "no error"
        except ValueError as exc:
            out[case] = f"ValueError: {exc}"
        dist.barrier()
    return out


def inference_reads(rank: int, path: str, implementation: str, tp_size: int = 1) -> dict:
    """Host reads and whether the output is right (to float32 rounding), of one experts module's
    decode-sized inference call (its second: the first sets it up) under ``implementation``, against
    ``"all_to_all"``'s (``tp_size=2``: the EP group shares one batch). float32: the grouped matmuls
    take their counts on the device (float64's ``loop`` backend reads them)."""
    from host_reads import counting_host_reads

    seed = 5 + rank // tp_size  # the ranks of a TP group share a batch
    g = torch.Generator().manual_seed(seed)
    outs, reads = {}, {}
    for name in ("all_to_all", implementation):
        model = load(path, name, torch.float32, 2, 2 // tp_size, tp_size)
        experts = model.model.layers[0].mlp.experts
        E, K = model.config.num_experts, model.config.num_experts_per_tok
        x = torch.randn(3 + rank // tp_size, model.config.hidden_size, generator=g)
        index = torch.rand(x.shape[0], E, generator=g).argsort(dim=1)[:, :K]
        weights = torch.softmax(torch.randn(x.shape[0], K, generator=g), dim=-1)
        with torch.no_grad():
            experts(x, index, weights)
            with counting_host_reads() as calls:
                outs[name] = experts(x, index, weights)
        reads[name] = len(calls)
        g = torch.Generator().manual_seed(seed)  # the same tokens for both
    return {"reads": reads[implementation], "equal": _rel(outs[implementation], outs["all_to_all"]) <= 1e-5}


def _histogram(routes_LNK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``(L, E)``: slots per global expert of every rank's routes (summed over the ranks)."""
    hist = torch.stack([torch.bincount(r.reshape(-1), minlength=num_experts) for r in routes_LNK])
    dist.all_reduce(hist)
    return hist


def telemetry_and_replay(rank: int, path: str) -> dict:
    """``epmoe.expert_load`` and ``epmoe.replay_routing`` on a model loaded with ``"epmoe"``, against
    the same runs with ``"all_to_all"``: the load after a training forward and backward (gradient
    checkpointing on: the recomputation counts nothing) against the recorded routes' histogram; then,
    the routers zeroed (left alone they would send every token to one rank's experts), the recorded
    routes replayed: loss and every gradient against ``"all_to_all"`` replaying them, the load against
    their histogram; and a replay that fails on rank 0 only raises on every rank."""

    ids = torch.randint(0, 200, (2, 6 + 3 * rank), generator=torch.Generator().manual_seed(rank))
    routes, replayed, out = {}, {}, {}
    for name in ("all_to_all", "epmoe"):
        model = load(path, name, torch.float64, 2, 2)
        model.gradient_checkpointing_enable()
        with epmoe.record_routing(model) as record:
            model(ids, labels=ids).loss.backward()
        routes[name] = record.routes_by_position()
        E = model.config.num_experts
        if name == "epmoe":
            loads = epmoe.expert_load(model)
            out["names"] = list(loads)
            out["load"] = torch.equal(torch.stack(list(loads.values())), _histogram(routes[name], E))
            epmoe.reset_expert_load(model)
        model.zero_grad()
        _skewed(model)
        with epmoe.replay_routing(model, routes["all_to_all"]):
            loss = model(ids, labels=ids).loss
            loss.backward()
        replayed[name] = {"loss": loss.detach(), **_full_grads(model)}
        if name == "epmoe":
            loads = torch.stack(list(epmoe.expert_load(model).values()))
            out["replayed load"] = torch.equal(loads, _histogram(routes["all_to_all"], E))
            out["one rank's experts"] = bool((loads[:, E // 2 :] == 0).all() or (loads[:, : E // 2] == 0).all())
            out["refused everywhere"] = _refused_on_every_rank(model, rank, routes["all_to_all"], ids)
    out["same routes"] = torch.equal(routes["all_to_all"], routes["epmoe"])
    ref, got = replayed["all_to_all"], replayed["epmoe"]
    out["replayed"] = max(_rel(got[n], ref[n]) for n in ref)
    return out


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in model.named_parameters()
    }


def _refused_on_every_rank(model: torch.nn.Module, rank: int, routes: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether flat routes covering more tokens than the block's forward on rank 0 only (rank 1's cover
    exactly its tokens) raise ``ValueError`` on every rank when the block ends."""

    flat = routes.flatten(1, 2)[:, : ids.numel()]
    if rank == 0:
        flat = torch.cat([flat, flat[:, :1]], dim=1)
    try:
        with epmoe.replay_routing(model, flat), torch.no_grad():
            model(ids)
    except ValueError as exc:
        return "left over" in str(exc) if rank == 0 else "could not replay" in str(exc)
    return False


def _uneven_shared_batch(rank: int, path: str) -> None:
    model = load(path, "epmoe", torch.float32, 2, 1, tp_size=2)
    K, H = model.config.num_experts_per_tok, model.config.hidden_size
    index = torch.arange(K).repeat(3 + rank, 1)
    with torch.no_grad():
        model.model.layers[0].mlp.experts(torch.randn(3 + rank, H), index, torch.ones(3 + rank, K) / K)


def forward_reads(rank: int, path: str, implementation: str) -> dict:
    """Host reads of a whole model's inference forward (its second: the first agrees the buffers)
    under ``implementation`` and ``"all_to_all"``, ranks' batches of different sizes, and whether the
    logits agree (float32 rounding)."""
    from host_reads import counting_host_reads

    ids = torch.randint(0, 200, (1, 3 + rank), generator=torch.Generator().manual_seed(rank))
    logits, reads = {}, {}
    for name in ("all_to_all", implementation):
        model = load(path, name, torch.float32, 2, 2)
        with torch.no_grad():
            model(ids)
            with counting_host_reads() as calls:
                logits[name] = model(ids).logits
        reads[name] = len(calls)
    equal = _rel(logits[implementation], logits["all_to_all"]) <= 1e-5
    return {"reads": reads[implementation], "all_to_all reads": reads["all_to_all"], "equal": equal}


KINDS = {
    "compared": compared,
    "generated": generated,
    "inference_reads": inference_reads,
    "forward_reads": forward_reads,
}


def _full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


def trainer_run(rank: int, path: str, out_dir: str, implementation: str) -> dict[str, torch.Tensor]:
    """Every parameter, whole, after 3 steps of ``transformers.Trainer`` (AdamW, gradient clipping at
    1.0, no checkpoints: transformers' Trainer refuses them for a model sharded at load) on the same
    token batches, the model loaded through transformers' own EP with ``implementation``."""
    from transformers import Trainer, TrainingArguments

    model = load(path, implementation, torch.float32, 2, 2)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, model.config.vocab_size, (16,), generator=g) for _ in range(24)]
    data = [{"input_ids": r, "labels": r} for r in rows]
    args = TrainingArguments(
        output_dir=f"{out_dir}/{implementation}",
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        logging_steps=1,
    )
    Trainer(model=model, args=args, train_dataset=data).train()
    return _full_parameters(model)


def trainer_compared(rank: int, path: str, out_dir: str) -> dict:
    """``{"params": largest relative difference of any parameter, "compared": n}``: the Trainer with
    ``"epmoe"`` against the Trainer with ``"all_to_all"``."""
    ref, got = (trainer_run(rank, path, out_dir, name) for name in ("all_to_all", "epmoe"))
    return {"params": max(_rel(got[n], ref[n]) for n in ref), "compared": len(ref), "moved": _moved(path, ref)}


def _moved(path: str, trained: dict[str, torch.Tensor]) -> bool:
    """Whether training changed the experts (the comparison compares something)."""
    start = _full_parameters(load(path, "all_to_all", torch.float32, 2, 2))
    return any(not torch.equal(trained[n], start[n]) for n in start if ".experts." in n)


def saved_and_resumed(rank: int, path: str, out_dir: str) -> dict:
    """``save_pretrained`` on every rank then plain ``from_pretrained`` (no EP) of the files: logits
    against the EP model's; and a DCP save of the model and optimizer after one step, loaded into a
    fresh load, then one more step on both: the largest relative difference of any parameter."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from transformers import AutoModelForCausalLM

    def model_and_optimizer():
        model = load(path, "epmoe", torch.float64, 2, 2)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model, optimizer, seed):
        ids = torch.randint(
            0, model.config.vocab_size, (2, 12 + 4 * rank), generator=torch.Generator().manual_seed(seed)
        )
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = model_and_optimizer()
    step(model, optimizer, 1)
    dcp.save(dict(zip(("model", "optim"), get_state_dict(model, optimizer))), checkpoint_id=f"{out_dir}/dcp")
    resumed, resumed_optimizer = model_and_optimizer()
    state = dict(zip(("model", "optim"), get_state_dict(resumed, resumed_optimizer)))
    dcp.load(state, checkpoint_id=f"{out_dir}/dcp")
    set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step(model, optimizer, 2)
    step(resumed, resumed_optimizer, 2)
    a, b = _full_parameters(model), _full_parameters(resumed)
    out = {"resumed": max(_rel(b[n], a[n]) for n in a)}
    model.save_pretrained(f"{out_dir}/saved")
    dist.barrier()
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ep_logits = model(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(
            f"{out_dir}/saved", dtype=torch.float64, experts_implementation="eager"
        )
        out["reloaded"] = _rel(plain(ids).logits, ep_logits)
    return out


KINDS.update(trainer=trainer_compared, saved=saved_and_resumed, telemetry=telemetry_and_replay)
