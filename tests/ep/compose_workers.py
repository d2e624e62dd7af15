"""Rank functions for the composition tests (EP + PEFT LoRA, EP + FSDP2); module level for spawned ranks."""

import contextlib
import copy
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import epmoe
from epmoe.demo import _global_loss, synthetic_batch
from epmoe.models import build_model

EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def batch_of(rank, lengths, batch=2, vocab=64):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, vocab, (batch, lengths[rank]), generator=g)


def max_rel(a, b):
    scale = b.abs().max().clamp_min(1e-12)
    return ((a - b).abs().max() / scale).item()


def lora_config(*, attention=True, experts=False, shared_expert=False):
    from peft import LoraConfig

    # init_lora_weights=False: B is random too, so every LoRA factor gets a non-zero gradient.
    return LoraConfig(
        r=2,
        lora_alpha=4,
        init_lora_weights=False,
        # a string is matched as a regex against full module names, a list by name suffix
        target_modules=(
            r".*\.shared_expert\.(gate|up|down)_proj" if shared_expert else ["q_proj", "v_proj"] if attention else []
        ),
        target_parameters=EXPERT_PARAMS if experts else None,
    )


def trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def grad_of(name, param):
    """``param.grad``, which must exist (a comparator must not skip a parameter that got none)."""
    assert param.grad is not None, f"{name} has no gradient"
    return param.grad


def compose_checks(rank, world, lengths):
    """Every composition recipe on the same 2 ranks, one after the other: ``{recipe: result}``, or
    ``{recipe: {"error": traceback}}`` for one that raised (the others still run)."""
    checks = {
        "peft_attention": lambda: peft_attention_parity(rank, world, lengths),
        "peft_expert_lora": lambda: peft_expert_lora_parity(rank, world, lengths),
        "peft_fused_shared_expert": lambda: peft_fused_shared_expert_parity(rank, world, lengths),
        "fsdp2": lambda: fsdp2_train(rank, world, 3, "float64"),
        "fsdp2_lora": lambda: fsdp2_lora_train(rank, world, "qwen3_5_moe", 3),
        "lora_init": lambda: lora_init_parity(rank, world, 3),
        "lora_load_unsharded": lambda: load_unsharded_adapter(rank, world),
        "second_adapter": lambda: second_adapter(rank, world),
    }
    out = {}
    for name, check in checks.items():
        try:
            out[name] = check()
        except BaseException:  # noqa: BLE001 - the test reports it, naming the recipe
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


def reference_grads(ref, lengths, world):
    """Loss and LoRA grads of the unsharded model on each rank's batch: ``[(loss, {name: grad})]``."""
    out = []
    for source in range(world):
        ref.zero_grad()
        ids = batch_of(source, lengths)
        loss = ref(ids, labels=ids).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in trainable(ref).items()}))
    return out


def peft_attention_parity(rank, world, lengths):
    """LoRA on q_proj/v_proj with EP, in both orders, vs the unsharded PEFT model on this rank's batch."""
    from peft import get_peft_model

    dtype = torch.float64
    torch.manual_seed(1)
    ref = get_peft_model(build_model("qwen3_moe", dtype=dtype), lora_config())
    per_rank = reference_grads(ref, lengths, world)
    ref_loss, ref_grads = per_rank[rank]

    models = {}
    # 1) PEFT first (the reference's exact LoRA init), deepcopy, then EP on the PeftModel.
    models["peft_then_ep"] = copy.deepcopy(ref)
    shards = epmoe.apply_expert_parallel(models["peft_then_ep"])
    assert [s.module_name for s in shards] == [f"base_model.model.model.layers.{i}.mlp.experts" for i in range(2)]
    assert all(s.ep_size == world and s.num_local_experts == 8 // world for s in shards)
    # 2) EP first, then PEFT, with the same seed as the reference's LoRA init (EP consumes no RNG).
    base = build_model("qwen3_moe", dtype=dtype)
    epmoe.apply_expert_parallel(base)
    torch.manual_seed(1)
    models["ep_then_peft"] = get_peft_model(base, lora_config())

    errors = {}
    ids = batch_of(rank, lengths)
    for order, model in models.items():
        params = trainable(model)
        assert set(params) == set(ref_grads) and all("lora_" in n for n in params), order
        loss = model(ids, labels=ids).loss
        loss.backward()
        errors[f"{order}/loss"] = max_rel(loss.detach(), ref_loss)
        assert params, f"{order}: no LoRA parameter to compare"
        errors[f"{order}/lora_grads"] = max(max_rel(grad_of(n, p), ref_grads[n]) for n, p in params.items())
    return errors


def _expert_lora_slice(ref_wrapper, name, tensor, start, end):
    """This rank's slice of a ParamWrapper's LoRA factor for experts ``[start, end)``.

    peft lays out ``lora_A.weight`` ``(r*E, in)`` expert-major (viewed ``(E, r, in)``) but ``lora_B.weight``
    ``(out, r*E)`` expert-minor (viewed ``(out, r, E)``): the experts of a rank are a contiguous row block
    of A but a strided column set of B.
    """
    num_experts = ref_wrapper.num_experts
    if ".lora_A." in name:
        return tensor.reshape(num_experts, -1, tensor.shape[-1])[start:end].reshape(-1, tensor.shape[-1])
    return tensor.reshape(tensor.shape[0], -1, num_experts)[:, :, start:end].reshape(tensor.shape[0], -1)


def _owning_wrapper(model, param_name):
    return model.get_submodule(param_name.split(".lora_")[0])


def copy_lora_from_reference(model, ref, shard):
    """Give the EP model's LoRA factors the unsharded reference's values (expert factors sliced to this
    rank's experts); return the names of the expert LoRA parameters."""
    epmoe.expert_parameters(model)  # narrows the expert factors peft made for all E experts (epmoe.ep.lora)
    params, ref_params = trainable(model), trainable(ref)
    assert set(params) == set(ref_params)
    expert_names = {n for n in params if ".experts." in n}
    with torch.no_grad():
        for name, param in params.items():
            source = ref_params[name]
            if name in expert_names:
                assert _owning_wrapper(model, name).num_experts == shard.num_local_experts
                wrapper = _owning_wrapper(ref, name)
                source = _expert_lora_slice(wrapper, name, source, shard.local_start, shard.local_end)
            param.copy_(source)
    return expert_names


def peft_expert_lora_parity(rank, world, lengths):
    """LoRA on the packed experts (target_parameters) + q/v, EP first then PEFT, vs the unsharded model.

    After EP each rank's ParamWrapper sees ``E/P`` experts, so peft builds LoRA factors for the local
    experts only. Seeded from the reference's factors (sliced per expert), the expert LoRA gradients equal
    the sum over all ranks' batches of the reference's, the attention LoRA gradients this rank's own.
    """
    from peft import get_peft_model

    dtype = torch.float64
    torch.manual_seed(1)
    ref = get_peft_model(build_model("qwen3_moe", dtype=dtype), lora_config(experts=True))
    per_rank = reference_grads(ref, lengths, world)
    ref_loss, ref_grads = per_rank[rank]
    summed = {n: sum(grads[n] for _, grads in per_rank) for n in ref_grads}

    base = build_model("qwen3_moe", dtype=dtype)
    shard = epmoe.apply_expert_parallel(base)[0]
    model = get_peft_model(base, lora_config(experts=True))
    params = trainable(model)
    assert set(params) == set(ref_grads)
    expert_names = copy_lora_from_reference(model, ref, shard)
    assert len(expert_names) == 8  # 2 layers x 2 packed parameters x (A, B)

    ids = batch_of(rank, lengths)
    loss = model(ids, labels=ids).loss
    loss.backward()
    errors = {"loss": max_rel(loss.detach(), ref_loss), "attention_lora_grads": 0.0, "expert_lora_grads": 0.0}
    compared = {"attention_lora_grads": 0, "expert_lora_grads": 0}
    for name, param in params.items():
        if name in expert_names:
            wrapper = _owning_wrapper(ref, name)
            full = _expert_lora_slice(wrapper, name, summed[name], shard.local_start, shard.local_end)
            errors["expert_lora_grads"] = max(errors["expert_lora_grads"], max_rel(grad_of(name, param), full))
            compared["expert_lora_grads"] += 1
        else:
            errors["attention_lora_grads"] = max(
                errors["attention_lora_grads"], max_rel(grad_of(name, param), ref_grads[name])
            )
            compared["attention_lora_grads"] += 1
    assert all(compared.values()), f"nothing compared: {compared}"
    errors.update(adapter_save_roundtrip(model, ref, rank, ids))
    errors["peft_first"] = peft_expert_lora_then_ep(rank, world, lengths)
    return errors


def adapter_save_roundtrip(model, ref, rank, ids):
    """peft's save_pretrained with epmoe.adapter_state_dict, reloaded by plain peft into an unsharded
    model on every rank: every adapter tensor bitwise the reference's (whose values the EP factors
    were seeded from), and the reference's logits."""
    import tempfile

    from peft import PeftModel
    from transformers import Trainer, TrainingArguments

    paths = [tempfile.mkdtemp(prefix="epmoe-adapter-") if rank == 0 else None]
    dist.broadcast_object_list(paths, src=0)
    direct, through_trainer = f"{paths[0]}/direct", f"{paths[0]}/trainer"
    model.save_pretrained(direct, state_dict=epmoe.adapter_state_dict(model), is_main_process=rank == 0)
    args = TrainingArguments(output_dir=f"{paths[0]}/out", report_to=[], use_cpu=True, save_strategy="no")
    epmoe.prepare_trainer(Trainer(model=model, args=args)).save_model(through_trainer)  # every rank joins
    dist.barrier()
    out = {}
    with torch.no_grad():
        want = ref(ids).logits
    for label, path in (("adapter", direct), ("trainer_adapter", through_trainer)):
        reloaded = PeftModel.from_pretrained(build_model("qwen3_moe", dtype=torch.float64), path)
        got = dict(reloaded.named_parameters())
        out[f"{label}_unequal_tensors"] = float(sum(not torch.equal(got[n], p) for n, p in trainable(ref).items()))
        with torch.no_grad():
            out[f"{label}_logits"] = max_rel(reloaded(ids).logits, want)
    return out


def peft_fused_shared_expert_parity(rank, world, lengths):
    """dispatch="fused" on Qwen3.5-MoE (shared expert in the fused ops' gaps), then LoRA on the packed
    experts and on the shared expert's Linears: the wrapped shared expert cannot ride along the fused
    ops, so the block runs its own forward (experts still fused); loss and LoRA gradients equal the
    unsharded PEFT model's."""
    from peft import get_peft_model

    family, dtype = "qwen3_5_moe", torch.float64
    config = lora_config(attention=False, experts=True, shared_expert=True)
    torch.manual_seed(1)
    ref = get_peft_model(build_model(family, dtype=dtype), config)
    per_rank = reference_grads(ref, lengths, world)
    ref_loss, ref_grads = per_rank[rank]
    summed = {n: sum(grads[n] for _, grads in per_rank) for n in ref_grads}

    base = build_model(family, dtype=dtype)
    shard = epmoe.apply_expert_parallel(base, config={"dispatch": "fused"})[0]
    blocks = [m for m in base.modules() if type(m).__name__ == "Qwen3_5MoeSparseMoeBlock"]
    assert blocks and all(b.forward.__func__.__name__ == "shared_block_forward" for b in blocks)
    model = get_peft_model(base, config)
    expert_names = copy_lora_from_reference(model, ref, shard)
    assert any("shared_expert" in n for n in trainable(model)) and len(expert_names) == 8

    ids = batch_of(rank, lengths)
    loss = model(ids, labels=ids).loss
    loss.backward()
    errors = {"loss": max_rel(loss.detach(), ref_loss), "lora_grads": 0.0}
    compared = 0
    for name, param in trainable(model).items():
        if name in expert_names:
            full = _expert_lora_slice(
                _owning_wrapper(ref, name), name, summed[name], shard.local_start, shard.local_end
            )
        else:
            full = ref_grads[name]
        errors["lora_grads"] = max(errors["lora_grads"], max_rel(grad_of(name, param), full))
        compared += 1
    assert compared, "no LoRA gradient compared"
    return errors


def peft_expert_lora_then_ep(rank, world, lengths):
    """PEFT (target_parameters on the experts) first, then EP: ``(sharded module names, error)``.

    peft's ParamWrappers hold LoRA factors for all E experts, so EP must refuse (before changing
    anything) rather than slice the wrapped module to E/P experts.
    """
    from peft import get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(build_model("qwen3_moe", dtype=torch.float64), lora_config(experts=True))
    ids = batch_of(rank, lengths)
    shards = []
    try:
        shards = epmoe.apply_expert_parallel(model)
        model(ids, labels=ids)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return [s.module_name for s in shards], f"{type(exc).__name__}: {exc}"
    return [s.module_name for s in shards], None


def fsdp2_train(rank, world, steps, dtype_name):
    """EP, then FSDP2 (fully_shard per decoder layer and root, expert params ignored), AdamW for
    ``steps`` steps; vs the non-EP model under DDP (same batches, same objective).

    Both clip to a total norm of 0.05 every step (epmoe.clip_grad_norm_ on the FSDP2 model).
    Returns ``(losses_fsdp, losses_ref, max rel error of the final parameters and the clip norms)``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dtype = getattr(torch, dtype_name)
    ref = build_model("qwen3_moe", dtype=dtype)
    model = copy.deepcopy(ref)
    shards = epmoe.apply_expert_parallel(model)
    experts = set(epmoe.expert_parameters(model))
    assert experts == {p for s in shards for p in model.get_submodule(s.module_name).parameters(recurse=False)}
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=experts)
    fully_shard(model, mesh=mesh, ignored_params=experts)
    assert all(not isinstance(p, DTensor) and p.shape[0] == 8 // world for p in experts)
    assert all(isinstance(p, DTensor) for p in model.parameters() if p not in experts)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_ddp = DDP(ref)
    losses, losses_ref, norm_err = [], [], 0.0
    for step in range(steps):
        ids = synthetic_batch(step, rank, 2, 16)
        loss = model(ids, labels=ids).loss
        loss.backward()  # FSDP2 averages the non-expert grads, expert_grad="auto" the expert grads
        norm = epmoe.clip_grad_norm_(model, 0.05)  # DTensor shards + expert shards, each counted once
        opt.step()
        opt.zero_grad(set_to_none=True)

        loss_ref = ref_ddp(ids, labels=ids).loss
        loss_ref.backward()
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert norm_ref > 0.05  # the clip factor matters
        norm_err = max(norm_err, max_rel(norm, norm_ref))
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        losses.append(_global_loss(loss, world))
        losses_ref.append(_global_loss(loss_ref, world))

    ref_params = dict(ref.named_parameters())
    shard_of = {s.module_name: s for s in shards}
    err, compared = 0.0, {"sharded": 0, "experts": 0}
    for name, param in model.named_parameters():
        full = ref_params[name]
        if isinstance(param, DTensor):
            mine = param.full_tensor()
            compared["sharded"] += 1
        else:
            shard = shard_of[name.rsplit(".", 1)[0]]
            mine, full = param, full[shard.local_start : shard.local_end]
            compared["experts"] += 1
        err = max(err, max_rel(mine.detach(), full.detach()))
    assert all(compared.values()), f"nothing compared: {compared}"
    dist.barrier()
    return losses, losses_ref, max(err, norm_err)


def fsdp2_lora_train(rank, world, family, steps):
    """The full recipe: EP -> PEFT LoRA (q/v + packed experts) -> FSDP2 (expert base + expert LoRA params
    ignored) -> AdamW on the LoRA params; vs the unsharded PEFT model trained data-parallel.

    Returns ``(losses, losses_ref, max rel error of the final LoRA parameters)``.
    """
    from peft import get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dtype = torch.float64
    torch.manual_seed(1)
    ref = get_peft_model(build_model(family, dtype=dtype), lora_config(experts=True))
    base = build_model(family, dtype=dtype)
    shards = epmoe.apply_expert_parallel(base)
    # the experts modules themselves: after PEFT their names lead to peft's ParamWrappers around them
    experts = [base.get_submodule(s.module_name) for s in shards]
    model = get_peft_model(base, lora_config(experts=True))
    expert_lora = copy_lora_from_reference(model, ref, shards[0])
    local = set(epmoe.expert_parameters(model))  # expert weights and the LoRA factors on them
    assert local == (
        {p for n, p in model.named_parameters() if n in expert_lora}
        | {p for module in experts for p in module.parameters(recurse=False)}
    )

    mesh = init_device_mesh("cpu", (world,))
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=local)
    fully_shard(model, mesh=mesh, ignored_params=local)
    lora = [p for p in model.parameters() if p.requires_grad]
    assert all(isinstance(p, DTensor) != (p in local) for p in lora)

    opt = torch.optim.AdamW(lora, lr=1e-2)
    ref_lora = [p for p in ref.parameters() if p.requires_grad]
    opt_ref = torch.optim.AdamW(ref_lora, lr=1e-2)
    ref_ddp = DDP(ref)
    losses, losses_ref = [], []
    for step in range(steps):
        ids = synthetic_batch(step, rank, 2, 16)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

        loss_ref = ref_ddp(ids, labels=ids).loss
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        losses.append(_global_loss(loss, world))
        losses_ref.append(_global_loss(loss_ref, world))

    ref_params = dict(ref.named_parameters())
    err, compared = 0.0, {"sharded": 0, "experts": 0}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        full = ref_params[name].detach()
        if isinstance(p, DTensor):
            mine = p.full_tensor()
            compared["sharded"] += 1
        else:
            mine = p
            start, end = shards[0].local_start, shards[0].local_end
            full = _expert_lora_slice(_owning_wrapper(ref, name), name, full, start, end)
            compared["experts"] += 1
        err = max(err, max_rel(mine.detach(), full))
    assert all(compared.values()), f"nothing compared: {compared}"
    dist.barrier()
    return losses, losses_ref, err


def _expert_factor_slices(model, ref, shard, names):
    """``{name: (EP model's factor, the unsharded reference's)}`` for ``names``: expert factors the
    reference's sliced to this rank's experts, every other factor whole."""
    ref_params = dict(ref.named_parameters())
    out = {}
    for name, param in model.named_parameters():
        if name not in names:
            continue
        full = ref_params[name].detach()
        if ".experts." in name:
            full = _expert_lora_slice(_owning_wrapper(ref, name), name, full, shard.local_start, shard.local_end)
        out[name] = (param.detach(), full)
    return out


def lora_init_parity(rank, world, steps):
    """Same seed, ``get_peft_model`` on the unsharded model and on the EP model, for peft's three random
    inits (``True``: kaiming A, zero B; ``"gaussian"``; ``False``: both nn.Linear's init), LoRA on the
    packed experts of both layers (layer 1's drawn after layer 0's) and on q/v:

    * right after ``get_peft_model``: every factor equals the reference's, bitwise (the expert factors
      still whole: peft made all E experts' from the shard's ``ds_shape``);
    * after the first forward (nothing of epmoe called in between): the expert factors are the
      reference's sliced to this rank's experts, the others unchanged, still bitwise;
    * then ``steps`` AdamW steps under DDP, vs the reference under DDP on the same batches: losses and
      every LoRA parameter (experts sliced) per parameter.

    A control with the ``ds_shape`` removed before ``get_peft_model`` must differ (what EP gave before).
    Returns ``{init: {...}}`` of errors and counts."""
    from peft import LoraConfig, get_peft_model

    from epmoe.ep.lora import clear_full_shapes, whole_experts_for_peft

    dtype = torch.float64
    out = {}
    for init in (True, "gaussian", False):

        def config():
            return LoraConfig(
                r=2,
                lora_alpha=4,
                init_lora_weights=init,
                target_modules=["q_proj", "v_proj"],
                target_parameters=EXPERT_PARAMS,
            )

        torch.manual_seed(5)
        ref = get_peft_model(build_model("qwen3_moe", dtype=dtype), config())
        lora_names = set(trainable(ref))
        base = build_model("qwen3_moe", dtype=dtype)
        shard = epmoe.apply_expert_parallel(base)[0]
        torch.manual_seed(5)
        model = get_peft_model(base, config())
        result = {"factors": len(lora_names), "expert_factors": sum(".experts." in n for n in lora_names)}
        mine, theirs = trainable(model), trainable(ref)
        assert set(mine) == lora_names
        result["unequal_after_get_peft_model"] = sum(not torch.equal(mine[n], theirs[n]) for n in lora_names)

        ids = synthetic_batch(0, rank, 2, 16)
        with torch.no_grad():
            model(ids, labels=ids)  # its first forward narrows the expert factors (a forward pre-hook)
        pairs = _expert_factor_slices(model, ref, shard, lora_names)
        assert len(pairs) == len(lora_names), "nothing compared"
        result["unequal_after_forward"] = sum(not torch.equal(a, b) for a, b in pairs.values())
        result["local_shapes"] = all(
            a.shape == b.shape
            and (".experts." not in n or a.numel() * world == dict(ref.named_parameters())[n].numel())
            for n, (a, b) in pairs.items()
        )

        ddp, ref_ddp = DDP(model), DDP(ref)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
        losses, losses_ref = [], []
        for step in range(steps):
            ids = synthetic_batch(step, rank, 2, 16)
            for net, optimizer, record in ((ddp, opt, losses), (ref_ddp, opt_ref, losses_ref)):
                loss = net(ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                record.append(_global_loss(loss, world))
        result["loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(losses, losses_ref))
        pairs = _expert_factor_slices(model, ref, shard, lora_names)
        assert len(pairs) == len(lora_names), "nothing compared"
        result["param_err"] = max(max_rel(a, b) for a, b in pairs.values())
        result["trained"] = losses[-1] != losses[0]

        # peft <= 0.20 reads the shard's shape, not ds_shape: what it does here with ds_shape removed. Its
        # factors sized from the shard are refused; added inside whole_experts_for_peft they are exact.
        torch.manual_seed(5)
        fresh_ref = get_peft_model(build_model("qwen3_moe", dtype=dtype), config())
        for older_peft in ("plain", "whole_experts_for_peft"):
            plain = build_model("qwen3_moe", dtype=dtype)
            epmoe.apply_expert_parallel(plain)
            clear_full_shapes(plain)
            torch.manual_seed(5)
            with whole_experts_for_peft(plain) if older_peft != "plain" else contextlib.nullcontext():
                plain = get_peft_model(plain, config())
            try:
                epmoe.expert_parameters(plain)
            except ValueError as exc:
                result[f"older_peft_{older_peft}"] = str(exc)
                continue
            pairs = _expert_factor_slices(plain, fresh_ref, shard, lora_names)
            result[f"older_peft_{older_peft}"] = sum(not torch.equal(a, b) for a, b in pairs.values())
        out[str(init)] = result
    return out


def second_adapter(rank, world):
    """An adapter added to expert wrappers that already hold their slice (after a forward): peft sizes it
    from the wrapper's local ``num_experts``, refused by name; added inside ``whole_experts_for_peft`` its
    factors are the unsharded model's second adapter's (this rank's slice), the first adapter untouched.
    Returns ``{"refused": message, "unequal": factors that differ, "compared": factors compared}``."""
    from peft import LoraConfig, get_peft_model

    from epmoe.ep.lora import whole_experts_for_peft

    def config():
        return LoraConfig(r=2, target_modules=["q_proj"], target_parameters=EXPERT_PARAMS, init_lora_weights=False)

    ids = synthetic_batch(0, rank, 2, 8)
    out = {}
    for inside in (False, True):
        torch.manual_seed(4)
        ref = get_peft_model(build_model("qwen3_moe", dtype=torch.float64), config())
        ref.add_adapter("second", config())
        base = build_model("qwen3_moe", dtype=torch.float64)
        shard = epmoe.apply_expert_parallel(base)[0]
        torch.manual_seed(4)
        model = get_peft_model(base, config())
        with torch.no_grad():
            model(ids)  # settles the first adapter's expert factors to this rank's slice
        with whole_experts_for_peft(model) if inside else contextlib.nullcontext():
            model.add_adapter("second", config())
        try:
            with torch.no_grad():
                model(ids)
        except ValueError as exc:
            out["refused"] = str(exc)
            continue
        names = {n for n, _ in model.named_parameters() if "lora_" in n}
        pairs = _expert_factor_slices(model, ref, shard, names)
        out["compared"] = len(pairs)
        out["unequal"] = sum(not torch.equal(a, b) for a, b in pairs.values())
    return out


def load_unsharded_adapter(rank, world):
    """An adapter saved by plain peft from the unsharded model, loaded with ``PeftModel.from_pretrained``
    into an EP model: the expert factors are read whole (peft sized them from ``ds_shape``), then each
    rank keeps its slice at the first forward. Returns ``(factors compared, unequal, logits error)``."""
    import tempfile

    from peft import PeftModel, get_peft_model

    torch.manual_seed(2)
    ref = get_peft_model(build_model("qwen3_moe", dtype=torch.float64), lora_config(experts=True))
    paths = [tempfile.mkdtemp(prefix="epmoe-unsharded-adapter-") if rank == 0 else None]
    dist.broadcast_object_list(paths, src=0)
    if rank == 0:
        ref.save_pretrained(paths[0])
    dist.barrier()
    base = build_model("qwen3_moe", dtype=torch.float64)
    shard = epmoe.apply_expert_parallel(base)[0]
    torch.manual_seed(99)  # not the reference's: every factor comes from the file
    model = PeftModel.from_pretrained(base, paths[0])
    ids = batch_of(rank, [7, 12])
    with torch.no_grad():
        logits_err = max_rel(model(ids).logits, ref(ids).logits)
    names = {n for n, _ in ref.named_parameters() if ".lora_" in n}
    pairs = _expert_factor_slices(model, ref, shard, names)
    assert len(pairs) == len(names), "nothing compared"
    return len(pairs), sum(not torch.equal(a, b) for a, b in pairs.values()), logits_err


def copies_own_ep_model(rank, world):
    """Copies of an EP model (``copy.deepcopy``, ``AveragedModel``, TRL's ``create_reference_model``), of
    the bare model and of a PeftModel with LoRA on the experts: per copy, ``{check: value}``. Each copy
    has its own EPModel (rooted at the copy, found from its modules and every parameter), and
    ``is_expert_parameter`` agrees with ``expert_parameters`` on it, asked before anything else."""
    from peft import get_peft_model
    from torch.optim.swa_utils import AveragedModel
    from trl import create_reference_model

    bare = _ep_model_of_seed()
    peft = get_peft_model(_ep_model_of_seed(), lora_config(experts=True))
    epmoe.expert_parameters(peft)  # what a user's optimizer / FSDP2 set-up does: marks the expert LoRA factors
    ids = batch_of(rank, [5, 7])
    out = {}
    for name, model, inner in (("bare", bare, lambda m: m), ("peft", peft, lambda m: m.base_model.model)):
        original = epmoe.ep_model(model)
        copies = {
            "deepcopy": (copy.deepcopy(model), lambda c: c),
            "averaged": (AveragedModel(model), lambda c: c.module),
            "reference": (create_reference_model(model), lambda c: c),
        }
        for kind, (made, root_of) in copies.items():
            flags = [epmoe.is_expert_parameter(p) for p in made.parameters()]  # before anything marks them
            experts = {id(p) for p in epmoe.expert_parameters(made)}
            own = epmoe.ep_model(made)
            made(ids)  # a forward with gradients enabled: the copy's hooks and records run on its EPModel
            out[f"{name} {kind}"] = {
                "agree": flags == [id(p) in experts for p in made.parameters()],
                "experts": len(experts),
                "original_experts": len(epmoe.expert_parameters(model)),
                "own": own is not None and own is not original,
                "root_is_copy": own is not None and own.root is inner(root_of(made)),
                "found_from_every_parameter": all(epmoe.ep_model(p) is own for p in made.parameters()),
                "found_from_its_modules": all(epmoe.ep_model(m) is own for m in made.modules()),
                "own_policy_and_guard": own.policy is not original.policy and own.guard is not original.guard,
                "shares_channels": own.channel is original.channel and own.group is original.group,
                "forward_ran_on_own": own.started and not original.started,
            }
    return out


def _ep_model_of_seed():
    torch.manual_seed(0)
    model = build_model("qwen3_moe")
    epmoe.apply_expert_parallel(model)
    return model
