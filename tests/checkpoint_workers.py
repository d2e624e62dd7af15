"""Rank functions for tests/test_checkpoint.py: complete ``save_pretrained`` of EP models."""

from __future__ import annotations

import copy
import json
import os

import torch
import torch.distributed as dist
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


def save_checks(rank, world, root):
    return {
        "qwen3_moe_sharded": save_complete(rank, world, root, "qwen3_moe", "200KB"),
        "gpt_oss": save_complete(rank, world, root, "gpt_oss", "50GB"),
        "deepseek_v3": save_complete(rank, world, root, "deepseek_v3", "50GB"),
    }
