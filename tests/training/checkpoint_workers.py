"""Rank functions for tests/training/test_checkpoint.py: complete ``save_pretrained`` of EP models."""

from __future__ import annotations

import copy
import json
import os

import torch
import torch.distributed as dist
from peft_release import expert_lora
from safetensors import safe_open

import epmoe
from epmoe.models import build_model


def files_of(path):
    """``{key: (shape, dtype)}`` over every safetensors file, the index (or None) and config.json."""
    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                for key in f.keys():
                    t = f.get_slice(key)
                    tensors[key] = (tuple(t.get_shape()), t.get_dtype())
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path)) if os.path.exists(index_path) else None
    config = json.load(open(os.path.join(path, "config.json")))
    return tensors, index, config


def save_complete(rank, world, root, family, max_shard_size):
    """save_pretrained on every rank of an EP model vs a plain save of the unsharded model: the same
    keys, shapes, dtypes, config and index; plain transformers reloads every weight bitwise and gives
    the EP model's logits on this rank's batch."""
    from transformers import AutoModelForCausalLM

    ref = build_model(family, dtype=torch.float32)
    model = copy.deepcopy(ref)
    epmoe.apply_expert_parallel(model)
    ep_dir, plain_dir = os.path.join(root, f"{family}-ep"), os.path.join(root, f"{family}-plain")
    model.save_pretrained(ep_dir, max_shard_size=max_shard_size)
    if rank == 0:
        ref.save_pretrained(plain_dir, max_shard_size=max_shard_size)
    dist.barrier()
    ep_files, plain_files = files_of(ep_dir), files_of(plain_dir)
    loaded = AutoModelForCausalLM.from_pretrained(ep_dir, dtype=torch.float32)
    ref_params = dict(ref.named_parameters())
    weights_equal = all(torch.equal(p, ref_params[n]) for n, p in loaded.named_parameters())
    ids = torch.randint(0, 256, (2, 7 + rank), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        logits_ep, logits_plain = model(ids).logits, loaded(ids).logits
    err = ((logits_ep - logits_plain).abs().max() / logits_plain.abs().max()).item()
    return {
        "same_tensors": ep_files[0] == plain_files[0],
        "num_keys": len(ep_files[0]),
        "same_index": ep_files[1] == plain_files[1],
        "sharded": ep_files[1] is not None,
        "total_parameters": ep_files[1]["metadata"]["total_parameters"] if ep_files[1] else None,
        "ref_parameters": ref.num_parameters(),
        "same_config": ep_files[2] == plain_files[2],
        "weights_equal": weights_equal,
        "logits_error": err,
    }


def save_refusals(rank, world, root):
    """What save_pretrained of an EP model refuses, on every rank, before writing any weights."""
    model = build_model("qwen3_moe", dtype=torch.float32)
    epmoe.apply_expert_parallel(model)
    out = {}
    for case, call in {
        "push_to_hub": lambda path: model.save_pretrained(path, push_to_hub=True),
        "class_call": lambda path: type(model).save_pretrained(model, path),
    }.items():
        path = os.path.join(root, f"refused-{case}")
        try:
            call(path)
            out[case] = None
        except (ValueError, RuntimeError) as exc:
            out[case] = (type(exc).__name__, str(exc))
        dist.barrier()
        out[case + "_weights"] = (
            sorted(n for n in os.listdir(path) if ".safetensors" in n) if os.path.isdir(path) else []
        )
    return out


def shard_marks(rank, world, root):
    """What a framework that gathers by ``named_parameters`` gets: every expert-sharded parameter (base
    experts, LoRA factors on them) carries its ShardMark, whose ``join`` of every rank's parameter is the
    unsharded model's tensor; ``whole_state_dict`` is the unsharded peft model's state dict on the writer;
    and ``save_pretrained(state_dict=...)`` handed every rank's slices (as such a framework builds it)
    still writes every expert."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from epmoe.checkpoint.save import whole_state_dict
    from epmoe.ep.shard_mark import mark_of

    def config():
        return LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])

    torch.manual_seed(3)
    ref = get_peft_model(build_model("qwen3_moe", dtype=torch.float64), config())
    base = build_model("qwen3_moe", dtype=torch.float64)
    epmoe.apply_expert_parallel(base)
    torch.manual_seed(3)
    with expert_lora(base):
        model = get_peft_model(base, config())
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 8)))  # the first forward settles the expert factors to their slices
    marked, joined_wrong = 0, []
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        shard_mark = mark_of(param)
        if shard_mark is None:
            continue
        marked += 1
        parts = [torch.empty_like(param) for _ in range(world)]
        dist.all_gather(parts, param.detach().contiguous())
        if not torch.equal(shard_mark.join(parts), ref_params[name]):
            joined_wrong.append(name)
    unmarked_experts = [n for n in epmoe.expert_parameters(model) if mark_of(n) is None]
    whole = whole_state_dict(model)
    ref_state = ref.state_dict()
    whole_wrong = [k for k in ref_state if rank == 0 and not torch.equal(whole[k], ref_state[k])]

    plain = build_model("qwen3_moe", dtype=torch.float64)
    ep = copy.deepcopy(plain)
    epmoe.apply_expert_parallel(ep)
    path = os.path.join(root, "slices")
    ep.save_pretrained(path, state_dict={n: p.detach() for n, p in ep.named_parameters()})
    dist.barrier()
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    plain_params = dict(plain.named_parameters())
    return {
        "marked": marked,
        "unmarked_experts": len(unmarked_experts),
        "joined_wrong": joined_wrong,
        "whole_keys": sorted(whole) == sorted(ref_state),
        "whole_wrong": whole_wrong,
        "slices_saved_whole": all(torch.equal(p, plain_params[n]) for n, p in reloaded.named_parameters()),
    }


def save_checks(rank, world, root):
    return {
        "shard_marks": shard_marks(rank, world, root),
        "qwen3_moe_sharded": save_complete(rank, world, root, "qwen3_moe", "200KB"),
        "gpt_oss": save_complete(rank, world, root, "gpt_oss", "50GB"),
        "deepseek_v3": save_complete(rank, world, root, "deepseek_v3", "50GB"),
        "refusals": save_refusals(rank, world, root),
    }


# --------------------------------------------------------------------------------------------
# torch.distributed.checkpoint resume


def _train(ddp, opt, rank, steps, start, sizes):
    from training_workers import batch

    losses = []
    for step in range(start, start + steps):
        ids = batch(step, rank, sizes)
        loss = ddp(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _full(model, optimizer):
    """Every parameter and Adam moment as the unsharded model's tensor (experts gathered over EP)."""
    state = epmoe.get_state_dict(model, optimizer)
    out = {}
    for key, value in state["model"].items():
        out[f"model/{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value
    for fqn, moments in state["optimizer"]["state"].items():
        for name, value in moments.items():
            out[f"optim/{fqn}/{name}"] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return {k: v.detach().clone() for k, v in out.items() if isinstance(v, torch.Tensor)}


def dcp_resume(rank, world, path, save_group, load_group):
    """Train 4 AdamW steps with EP over ``save_group``, ``dcp.save``, train 4 more. A fresh model (other
    weights) with EP over ``load_group`` and a fresh optimizer load the checkpoint and train the same
    4 steps. Returns the losses of both continuations and the max relative error of every parameter
    and moment, right after loading and after the 4 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    def groups(kind):
        return None if kind == "world" else init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))

    sizes = [(2, 8), (1, 11), (3, 5), (2, 6)]
    model = build_model("qwen3_moe", dtype=torch.float32)
    epmoe.apply_expert_parallel(model, groups(save_group))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    _train(ddp, opt, rank, 4, 0, sizes)
    dcp.save(epmoe.get_state_dict(ddp, opt), checkpoint_id=path)
    saved = _full(ddp, opt)
    losses = _train(ddp, opt, rank, 4, 4, sizes)
    after = _full(ddp, opt)

    fresh = build_model("qwen3_moe", dtype=torch.float32, seed=123)
    epmoe.apply_expert_parallel(fresh, groups(load_group))
    ddp2 = DDP(fresh)
    opt2 = torch.optim.AdamW(ddp2.parameters(), lr=1e-3)  # never stepped: get_state_dict initialises it
    state = epmoe.get_state_dict(ddp2, opt2)
    dcp.load(state, checkpoint_id=path)
    epmoe.set_state_dict(ddp2, opt2, state=state)
    loaded = _full(ddp2, opt2)
    losses2 = _train(ddp2, opt2, rank, 4, 4, sizes)
    after2 = _full(ddp2, opt2)

    def errors(mine, ref):
        assert ref, "nothing to compare: no parameter or optimizer state"
        assert set(mine) == set(ref), sorted(set(mine) ^ set(ref))[:4]
        return {k: ((mine[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30)).item() for k in ref}

    return {
        "losses": losses,
        "losses_loaded": losses2,
        "loaded": errors(loaded, saved),
        "after": errors(after2, after),
        "bitwise": all(torch.equal(after2[k], after[k]) for k in after),
    }


def dcp_lora_resume(rank, world, path, save_group, load_group):
    """LoRA on the packed experts (and q/v), EP over ``save_group``: 3 AdamW steps, ``dcp.save``, 2 more.
    A fresh adapted model (other weights) with EP over ``load_group`` and a fresh optimizer load it
    and take the same 2 steps. Every rank trains on the same batch (the non-expert factors stay
    replicas without DDP). Returns the losses and the max relative error per parameter and moment."""
    import torch.distributed.checkpoint as dcp
    from compose_workers import lora_config
    from peft import get_peft_model
    from torch.distributed.device_mesh import init_device_mesh

    def adapted(seed, kind):
        model = build_model("qwen3_moe", dtype=torch.float32, seed=seed)
        mesh = None if kind == "world" else init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))
        epmoe.apply_expert_parallel(model, mesh)
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, lora_config(experts=True, attention=True))  # A and B random
        return peft_model, torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)

    def train(model, opt, steps):
        losses = []
        for step in range(steps):
            ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(step))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    model, opt = adapted(0, save_group)
    train(model, opt, 3)
    dcp.save(epmoe.get_state_dict(model, opt), checkpoint_id=path)
    saved = _full(model, opt)
    losses = train(model, opt, 2)
    after = _full(model, opt)
    fresh, opt2 = adapted(7, load_group)
    state = epmoe.get_state_dict(fresh, opt2)
    dcp.load(state, checkpoint_id=path)
    epmoe.set_state_dict(fresh, opt2, state=state)
    loaded = _full(fresh, opt2)
    losses2 = train(fresh, opt2, 2)
    after2 = _full(fresh, opt2)

    def errors(mine, ref):
        assert ref, "nothing to compare: no parameter or optimizer state"
        assert set(mine) == set(ref), sorted(set(mine) ^ set(ref))[:4]
        return {k: ((mine[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30)).item() for k in ref}

    return {
        "losses": losses,
        "losses_loaded": losses2,
        "loaded": errors(loaded, saved),
        "after": errors(after2, after),
        "expert_lora": sorted(k for k in saved if ".experts." in k and ".lora_" in k),
        "bitwise": all(torch.equal(after2[k], after[k]) for k in after),
    }


def dcp_checks(rank, world, root):
    if world == 2:
        return {
            "same_size": dcp_resume(rank, world, f"{root}/same", "world", "world"),
            "lora_same_size": dcp_lora_resume(rank, world, f"{root}/lora", "world", "world"),
        }
    return {
        "pair_then_world": pair_then_world(rank, world, root, 10.0),
        "same_size": dcp_resume(rank, world, f"{root}/same4", "world", "world"),
        "lora_ep2_to_ep4": dcp_lora_resume(rank, world, f"{root}/lora2to4", "mesh", "world"),
        "ep2_to_ep4": dcp_resume(rank, world, f"{root}/2to4", "mesh", "world"),
        "ep4_to_ep2": dcp_resume(rank, world, f"{root}/4to2", "world", "mesh"),
        "pretrained_any_size": pretrained_any_size(rank, world, root),
        "apply_without_peers": apply_without_peers(rank, world, 3.0),
    }  # last: leaves the world group waiting


def pair_then_world(rank, world, root, timeout):
    """An EP model made and saved on ranks 0 and 1 (a group of the pair), then one over all ranks made
    and saved, with ``ExpertParallelConfig.timeout`` = ``timeout``: the seconds each took on this rank
    and whether plain from_pretrained of each checkpoint equals its unsharded model, every weight.
    Then one made and saved on ranks 2 and 3 (without global rank 0, the writer): ``(error type,
    message, seconds)`` on those ranks."""
    import time

    from transformers import AutoModelForCausalLM

    pair, other_pair = dist.new_group([0, 1]), dist.new_group([2, 3])  # every rank creates both: torch's rule
    references, seconds = {}, {}
    for name, group, ranks, seed in (("pair", pair, (0, 1), 1), ("world", None, range(world), 2)):
        if rank not in ranks:
            continue
        references[name] = build_model("qwen3_moe", dtype=torch.float32, seed=seed)
        started = time.monotonic()
        model = copy.deepcopy(references[name])
        epmoe.apply_expert_parallel(model, group, config={"timeout": timeout})
        model.save_pretrained(os.path.join(root, f"pair-then-{name}"))
        seconds[name] = time.monotonic() - started
    equal = {}
    for name, ref in references.items():  # the world save returned: the writer has written both
        loaded = dict(
            AutoModelForCausalLM.from_pretrained(
                os.path.join(root, f"pair-then-{name}"), dtype=torch.float32
            ).named_parameters()
        )
        equal[name] = set(loaded) == {n for n, _ in ref.named_parameters()} and all(
            torch.equal(p, loaded[n]) for n, p in ref.named_parameters()
        )
    without_writer = None
    if rank >= 2:
        model = build_model("qwen3_moe", dtype=torch.float32)
        epmoe.apply_expert_parallel(model, other_pair, config={"timeout": timeout})
        started = time.monotonic()
        try:
            model.save_pretrained(os.path.join(root, "pair-without-writer"))
            without_writer = (None, "", time.monotonic() - started)
        except ValueError as exc:
            without_writer = (type(exc).__name__, str(exc), time.monotonic() - started)
    return {"seconds": seconds, "equal": equal, "without_writer": without_writer}


def apply_without_peers(rank, world, timeout):
    """apply_expert_parallel over every rank, called on ranks 2 and 3 only (ranks 0 and 1 are alive,
    elsewhere): ``(error type, message, seconds)`` on the ranks that called it, ``None`` on the others."""
    import time

    if rank < 2:
        time.sleep(timeout + 4)
        return None
    model = build_model("qwen3_moe", dtype=torch.float32)
    started = time.monotonic()
    try:
        epmoe.apply_expert_parallel(model, config={"timeout": timeout})
    except RuntimeError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - started
    return None, "", time.monotonic() - started


def pretrained_any_size(rank, world, root):
    """save_pretrained at EP 2 (a ("dp", "ep") mesh) -> epmoe.from_pretrained at EP 4, and that model's
    save_pretrained at EP 4 -> epmoe.from_pretrained at EP 2: logits against the unsharded model's
    (max relative difference per hop)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3MoeForCausalLM

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))
    reference = build_model("qwen3_moe", dtype=torch.float32, seed=5)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        want = reference(ids).logits

    def error(model):
        with torch.no_grad():
            return ((model(ids).logits - want).abs().max() / want.abs().max()).item()

    ep2 = copy.deepcopy(reference)
    epmoe.apply_expert_parallel(ep2, mesh)
    ep2.save_pretrained(os.path.join(root, "pretrained-ep2"))
    ep4, shards4 = epmoe.from_pretrained(Qwen3MoeForCausalLM, os.path.join(root, "pretrained-ep2"), dtype=torch.float32)
    ep4.save_pretrained(os.path.join(root, "pretrained-ep4"))
    back, shards2 = epmoe.from_pretrained(
        Qwen3MoeForCausalLM, os.path.join(root, "pretrained-ep4"), mesh, dtype=torch.float32
    )
    return {
        "sizes": [shards4[0].ep_size, shards2[0].ep_size],
        "ep2": error(ep2),
        "ep2_to_ep4": error(ep4),
        "ep4_to_ep2": error(back),
    }


# --------------------------------------------------------------------------------------------
# epmoe.from_pretrained: sharded loading


def sharded_load(rank, world, root, families):
    """For each family, in the Hub layout (a plain save_pretrained: per-expert keys) and, for the first,
    the packed v5 layout: epmoe.from_pretrained vs from_pretrained then apply_expert_parallel: every
    parameter and buffer bitwise (dtypes included), and the logits; the first family also with a named
    grouped-matmul backend, and from bf16 checkpoints in both layouts (loaded as float32: cast)."""
    import transformers

    from epmoe.models import _family_config

    out = {}
    firsts = ("hub", "packed", "named backend", "hub bf16", "packed bf16")
    cases = [(family, layout) for family in families for layout in (firsts if family == families[0] else ("hub",))]
    for family, layout in cases:
        path = os.path.join(root, f"{family}-{layout}")
        if rank == 0:
            saved = torch.bfloat16 if layout.endswith("bf16") else torch.float32
            build_model(family, dtype=saved).save_pretrained(path, save_original_format=not layout.startswith("packed"))
        dist.barrier()
        cls = getattr(transformers, _family_config(family, 8, 2)[1])
        ref = cls.from_pretrained(path, dtype=torch.float32)
        epmoe.apply_expert_parallel(ref)
        # a named grouped-matmul backend is checked at the first forward, not on the meta weights
        config = epmoe.ExpertParallelConfig(gmm_backend="torch") if layout == "named backend" else None
        model, shards = epmoe.from_pretrained(cls, path, ep_config=config, dtype=torch.float32)
        ids = torch.randint(0, 256, (2, 6 + rank), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            mine_logits, ref_logits = model(ids).logits, ref(ids).logits
            err = ((mine_logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
        mine = dict(model.named_parameters()) | dict(model.named_buffers())
        theirs = dict(ref.named_parameters()) | dict(ref.named_buffers())
        out[f"{family}/{layout}"] = {
            "same_names": set(mine) == set(theirs),
            "unequal": sorted(
                k
                for k in theirs
                if k in mine and not (mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]))
            ),
            "logits_error": err,
            "class": type(model) is cls,
            "local_experts": all(s.num_local_experts == 8 // world for s in shards),
            "marked": len(epmoe.expert_parameters(model)) == len(epmoe.expert_parameters(ref)) > 0,
        }
    return out


def local_reads(rank, world, root):
    """epmoe.from_pretrained of a Hub-layout checkpoint (16 experts, 2 layers) at EP 4 (the whole
    world) and at EP 2 (a ("dp", "ep") mesh), counting what transformers' loader materialises on this
    rank: the experts whose per-expert tensors it read (``DtensorShardOperation.shard_tensor`` not
    returning None), how many tensors each expert converter was handed, and how many packed tensors
    MergeConcatenate built. Also: the conversions kept for saving are transformers' own."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3MoeForCausalLM
    from transformers.core_model_loading import WeightConverter
    from transformers.distributed.sharding_utils import DtensorShardOperation

    from epmoe.checkpoint.load import MergeConcatenate

    path = os.path.join(root, "hub")
    if rank == 0:
        build_model("qwen3_moe", num_experts=16).save_pretrained(path)
    dist.barrier()
    seen = {"read": [], "skipped": 0, "handed": [], "packed": 0}
    shard_tensor, materialize, convert = (
        DtensorShardOperation.shard_tensor,
        WeightConverter.materialize_tensors,
        MergeConcatenate.convert,
    )

    def counting_shard(self, source, tensor_idx=None, device=None, dtype=None):
        out = shard_tensor(self, source, tensor_idx, device, dtype)
        if tensor_idx is not None and out is None:
            seen["skipped"] += 1
        elif tensor_idx is not None:
            seen["read"].append(tensor_idx)
        return out

    def counting_materialize(self):
        tensors = materialize(self)
        seen["handed"].extend(len(group) for group in tensors.values())
        return tensors

    def counting_convert(self, *args, **kwargs):
        seen["packed"] += 1
        return convert(self, *args, **kwargs)

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))
    out = {}
    DtensorShardOperation.shard_tensor, WeightConverter.materialize_tensors = counting_shard, counting_materialize
    MergeConcatenate.convert = counting_convert
    try:
        for case, group in (("ep4", None), ("ep2", mesh)):
            seen.update(read=[], skipped=0, handed=[], packed=0)
            model, shards = epmoe.from_pretrained(Qwen3MoeForCausalLM, path, group, dtype=torch.float32)
            kept = [
                type(op).__name__
                for conversion in model._weight_conversions
                for op in getattr(conversion, "operations", ())
            ]
            local = list(range(shards[0].local_start, shards[0].local_end))
            out[case] = {**seen, "read": sorted(seen["read"]), "local": local, "kept_ops": sorted(set(kept))}
    finally:
        DtensorShardOperation.shard_tensor, WeightConverter.materialize_tensors = shard_tensor, materialize
        MergeConcatenate.convert = convert
    return out


def bad_checkpoints(rank, world, root):
    """Broken checkpoints for epmoe.from_pretrained: every rank raises a clear error, none hangs.
    Returns ``{case: "ExceptionType: message"}``."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeForCausalLM

    def broken(case, edit=None, **model_kwargs):
        path = os.path.join(root, case)
        if rank == 0:
            build_model("qwen3_moe", **model_kwargs).save_pretrained(path)
            if edit is not None:
                edit(os.path.join(path, "model.safetensors"))
        dist.barrier()
        return path

    def drop_expert(file):
        tensors = load_file(file)
        del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
        save_file(tensors, file, metadata={"format": "pt"})

    def wrong_shape(file):
        tensors = load_file(file)
        tensors["model.layers.0.mlp.experts.6.down_proj.weight"] = torch.zeros(64, 16)
        save_file(tensors, file, metadata={"format": "pt"})

    def truncate(file):
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) // 2)

    cases = {
        "experts_not_divisible": broken("experts_not_divisible", num_experts=7),
        "missing_expert": broken("missing_expert", drop_expert),
        "wrong_shape": broken("wrong_shape", wrong_shape),
        "truncated": broken("truncated", truncate),
    }
    out = {}
    for case, path in cases.items():
        try:
            epmoe.from_pretrained(Qwen3MoeForCausalLM, path, dtype=torch.float32)
            out[case] = None
        except Exception as exc:  # noqa: BLE001 - the error is the result
            out[case] = f"{type(exc).__name__}: {exc}"
        dist.barrier()  # every rank got here: no one is left in a collective
    return out


def state_dict_warnings(rank, world, root):
    """A bare state_dict() of an EP model warns (torch.save / dcp.save of it would lose or swap experts);
    epmoe's own paths (save_pretrained, get_state_dict / set_state_dict, from_pretrained) do not, nor a
    prepared Trainer's or peft's own save of an adapter that holds nothing of the experts (attention LoRA
    only); peft's own save of LoRA on the experts raises.
    Returns ``{path: number of ExpertStateDictWarning}``."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    from epmoe.checkpoint.state_dict_warning import ExpertStateDictWarning

    model = build_model("qwen3_moe")
    epmoe.apply_expert_parallel(model)
    opt = torch.optim.AdamW(model.parameters())

    def bare_torch_save():
        torch.save(model.state_dict(), os.path.join(root, f"bare-{rank}.pt"))

    def bare_dcp_save():
        dcp.save(model.state_dict(), checkpoint_id=os.path.join(root, "bare-dcp"))

    def epmoe_paths():
        model.save_pretrained(os.path.join(root, "saved"))
        state = epmoe.get_state_dict(model, opt)
        dcp.save(state, checkpoint_id=os.path.join(root, "dcp"))
        dcp.load(state, checkpoint_id=os.path.join(root, "dcp"))
        epmoe.set_state_dict(model, opt, state=state)
        epmoe.from_pretrained(Qwen3MoeForCausalLM, os.path.join(root, "saved"))

    def prepared_trainer_adapter():  # an adapter without experts' LoRA: peft saves none of the experts
        from peft import LoraConfig, get_peft_model
        from transformers import Trainer, TrainingArguments

        base = build_model("qwen3_moe")
        epmoe.apply_expert_parallel(base)
        peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
        args = TrainingArguments(output_dir=os.path.join(root, "trainer"), report_to=[], use_cpu=True)
        epmoe.prepare_trainer(Trainer(model=peft_model, args=args)).save_model(os.path.join(root, "adapter"))
        dist.barrier()
        saved.extend(sorted(load_file(os.path.join(root, "adapter", "adapter_model.safetensors"))))

    def peft_adapter():  # peft's own save of an adapter without the experts' LoRA: no expert in it
        from peft import LoraConfig, get_peft_model

        base = build_model("qwen3_moe")
        epmoe.apply_expert_parallel(base)
        peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
        peft_model.save_pretrained(os.path.join(root, f"peft-{rank}"))

    def peft_expert_adapter():  # ... with LoRA on the experts: this rank's factors only, refused
        from peft import LoraConfig, get_peft_model

        base = build_model("qwen3_moe")
        epmoe.apply_expert_parallel(base)
        with expert_lora(base):
            peft_model = get_peft_model(base, LoraConfig(r=2, target_parameters=["mlp.experts.gate_up_proj"]))
        try:
            peft_model.save_pretrained(os.path.join(root, f"peft-experts-{rank}"))
        except RuntimeError as exc:
            refused.append(str(exc))

    saved, refused = [], []  # the adapter file's keys; the refusal of peft's save of expert factors
    counts = {}
    cases = (
        ("torch.save", bare_torch_save),
        ("dcp.save", bare_dcp_save),
        ("epmoe", epmoe_paths),
        ("trainer adapter", prepared_trainer_adapter),
        ("peft adapter", peft_adapter),
        ("peft expert adapter", peft_expert_adapter),
    )
    for name, fn in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
        messages = [str(w.message) for w in caught if issubclass(w.category, ExpertStateDictWarning)]
        counts[name] = (len(messages), messages[:1])
        dist.barrier()
    counts["adapter keys"] = saved
    counts["peft expert refusal"] = refused
    return counts


def rank0_only_save(rank, world, root, timeout):
    """``save_pretrained`` called on rank 0 alone (what ``Trainer._save`` does without
    ``prepare_trainer``): ``(error type, message, seconds, files written)`` on rank 0."""
    import time

    model = build_model("qwen3_moe")
    epmoe.apply_expert_parallel(model, config={"timeout": timeout})
    path = os.path.join(root, "rank0-only")
    if rank != 0:
        time.sleep(timeout + 4)  # alive, elsewhere
        return None
    started = time.monotonic()
    try:
        model.save_pretrained(path)
    except RuntimeError as exc:
        seen = (type(exc).__name__, str(exc), time.monotonic() - started)
    else:
        seen = (None, "", time.monotonic() - started)
    return (*seen, sorted(os.listdir(path)) if os.path.isdir(path) else [])
