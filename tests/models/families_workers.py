"""Rank functions of the families coverage test (module level, so spawned ranks can import them).

Every family runs in one spawned group (:func:`check_families`): apply EP to its tiny fp64 model and
compare with the unsharded model as the parity tests do (outputs and loss against this rank's batch,
expert gradients against the unsharded sum over ranks, every other gradient against this rank's batch),
or record the ``ValueError`` that refused it.
"""

from __future__ import annotations

import copy
import traceback

import torch
import torch.distributed as dist
from families import Family, build, inputs, loss_of
from torch.utils._python_dispatch import TorchDispatchMode

import epmoe
from epmoe.ep.adopt import find_experts_modules
from epmoe.ep.recognize import zero_experts

LENGTHS = [7, 5, 6, 9]


def max_rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12) -> float:
    """``max |a - b|`` relative to ``max |b|``, or to ``floor`` where ``b`` is smaller."""
    scale = b.abs().max().clamp_min(floor)
    return ((a - b).abs().max() / scale).item()


class _Narrowing(TorchDispatchMode):
    """Records the float dtypes narrower than float64 that code run inside an experts module casts
    float64 tensors to (an experts forward that computes or sums in float32 on purpose)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.inside, self.to = 0, set()
        self.hooks = []
        for _, module, _ in find_experts_modules(model):
            self.hooks.append(module.register_forward_pre_hook(lambda *_: self._enter(1)))
            self.hooks.append(module.register_forward_hook(lambda *_: self._enter(-1)))

    def _enter(self, step: int) -> None:
        self.inside += step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            self.inside
            and func.overloadpacket is torch.ops.aten._to_copy
            and isinstance(args[0], torch.Tensor)
            and args[0].dtype == torch.float64
            and out.dtype.is_floating_point
            and out.dtype != torch.float64
        ):
            self.to.add(out.dtype)
        return out

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*exc)


def family_parity(rank: int, world: int, family: Family) -> dict:
    """``{"refused": message}``, or ``{"errors": {kind: max relative error}, "compared": {kind: count},
    "rounds_to": dtype name or None}``: ``rounds_to`` is the narrowest dtype the family's own experts
    forward casts float64 tensors to in the unsharded model (float32 where it computes or sums its
    experts in float32 on purpose), which bounds how close any other order of the same sums can be."""
    ref = build(family, dtype=torch.float64)
    model = copy.deepcopy(ref)
    try:
        shards = epmoe.apply_expert_parallel(model, config={"timeout": 120})
    except ValueError as error:
        assert not any(hasattr(m, "_epmoe") for m in model.modules()), "a refused model was changed"
        return {"refused": str(error)}
    torch.manual_seed(rank)  # a model drawing noise in its forward (diffusion) draws the same for both
    out, loss = loss_of(model(**inputs(family, rank, LENGTHS[rank])))
    loss.backward()

    sharded = {id(p) for p in epmoe.expert_parameters(model)}
    expert_names = {n for n, p in model.named_parameters() if id(p) in sharded}
    ref_params = dict(ref.named_parameters(remove_duplicate=False))  # tied experts: each name its own
    torch.manual_seed(rank)
    with _Narrowing(ref) as narrowing:
        ref_out, ref_loss = loss_of(ref(**inputs(family, rank, LENGTHS[rank])))
    ref_loss.backward()
    errors = {"output": max_rel(out, ref_out), "loss": max_rel(loss, ref_loss)}
    own = {n: p.grad.clone() for n, p in ref_params.items() if p.grad is not None}
    expert_sum, reached = summed_over_ranks({n: ref_params[n].grad for n in expert_names}, ref_params)
    rounds_to = set().union(*gathered(narrowing.to))
    errors.update(non_expert_grads=0.0, expert_grads=0.0)
    # a gradient 1e4 times below the largest one is compared to that scale: a router nothing reaches
    # (DeepSeek-V4's hash-routed first layers) has a gradient of rounding noise, 1e-20
    floor = 1e-4 * max(g.abs().max().item() for g in [*own.values(), *expert_sum.values()])
    compared = {"non_expert_grads": 0, "expert_grads": 0}
    for name, param in model.named_parameters():
        if name not in expert_names:
            if param.grad is None:
                assert name not in own, f"{name} has no gradient under EP"
                continue
            errors["non_expert_grads"] = max(errors["non_expert_grads"], max_rel(param.grad, own[name], floor))
            compared["non_expert_grads"] += 1
            continue
        if param.grad is None:  # experts no token reaches (a vision tower's, on text) have none unsharded too
            assert name not in reached, f"{name} has no gradient under EP"
            continue
        full = local_rows(expert_sum[name], name, param, shards)
        err = max_rel(param.grad, full, floor) if full.abs().max() > 0 else param.grad.abs().max().item()
        errors["expert_grads"] = max(errors["expert_grads"], err)
        compared["expert_grads"] += 1
    narrowest = min(rounds_to, key=lambda d: torch.finfo(d).bits, default=None)
    try:
        marks = joined_by_marks(rank, ref, model, shards, lora=dist.get_world_size() == 2)
    except BaseException:  # noqa: BLE001 - the marks test reports it; the verdict stands
        marks = {"error": traceback.format_exc()}
    return {
        "errors": errors,
        "compared": compared,
        "rounds_to": str(narrowest).removeprefix("torch.") if narrowest else None,
        "marks": marks,
    }


def joined_by_marks(rank: int, ref: torch.nn.Module, model: torch.nn.Module, shards: list, lora: bool) -> dict:
    """What a framework that gathers by ``epmoe_shard`` gets from ``model`` (``ref`` made expert-parallel
    over every rank), then, with ``lora`` (at EP 2: the factors' marks are laid out alike at any EP
    size, and the EP 4 spawn keeps the suite's time), from both with PEFT LoRA on every per-expert
    tensor (the same seed): for the
    base weights as ``"base"`` and the LoRA factors as ``"lora"``, ``{"marked": expert tensors (factors)
    that carry a ShardMark, "unmarked": expert tensors without one, "joined_wrong": names whose
    ``mark.join`` of every rank's tensor is not ``ref``'s, "whole_wrong": keys of ``whole_state_dict``
    (on the writer) missing or unlike ``ref.state_dict()``'s, and extra ones}``; ``"lora"`` is
    ``{"without_ep": error}`` where peft cannot add it to ``ref``, ``{"refused": message}`` where
    epmoe refuses it by name. Both models are changed (peft wraps them in place)."""
    from peft import LoraConfig, get_peft_model

    out = {"base": _joined(rank, ref, model, epmoe.expert_parameters(model))}
    if not lora:
        return out
    config = LoraConfig(
        r=2, init_lora_weights=False, target_modules=[], target_parameters=expert_targets(model, shards)
    )
    torch.manual_seed(1)
    try:
        ref = get_peft_model(ref, config)
    except Exception as error:  # noqa: BLE001 - peft's own limit, whatever it raises
        out["lora"] = {"without_ep": f"{type(error).__name__}: {error}"}
        return out
    torch.manual_seed(1)
    try:  # adding it inside whole_experts_for_peft settles the factors, and refuses, there
        model = ep_peft_model(model, config)
        experts = epmoe.expert_parameters(model)  # settles the factors to this rank's experts
    except ValueError as error:
        out["lora"] = {"refused": str(error)}
        return out
    factors = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    out["lora"] = _joined(rank, ref, model, [p for p in experts if id(p) in factors])
    return out


def _joined(rank: int, ref: torch.nn.Module, model: torch.nn.Module, experts: list) -> dict:
    """:func:`joined_by_marks`' counts and names for the expert tensors ``experts`` of ``model``, against
    ``ref``'s state dict with the rows no expert reads (zero-computation experts', which EP does not
    keep) zeros, as saving writes them."""
    from epmoe.checkpoint.save import whole_state_dict
    from epmoe.ep.shard_mark import mark_of
    from epmoe.ep.state import ep_states

    unread = {f"{name}.{key}": rows for name, _, state in ep_states(model) for key, rows in state.unread_rows.items()}
    expected = ref.state_dict()
    for key, rows in unread.items():
        expected[key] = torch.cat([expected[key][:-rows], expected[key].new_zeros(rows, *expected[key].shape[1:])])
    names = {id(p): n for n, p in model.named_parameters()}
    joined_wrong, unmarked, marked = [], [], 0
    for param in experts:
        shard_mark = mark_of(param)
        if shard_mark is None:
            unmarked.append(names[id(param)])
            continue
        marked += 1
        parts = [torch.empty_like(param) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, param.detach().contiguous())
        if not torch.equal(shard_mark.join(parts), expected[names[id(param)]]):
            joined_wrong.append(names[id(param)])
    whole = whole_state_dict(model)
    whole_wrong = []
    if rank == 0:
        whole_wrong = sorted(
            [k for k, v in expected.items() if k not in whole or not torch.equal(whole[k], v)]
            + [k for k in whole if k not in expected]
        )
    return {"marked": marked, "unmarked": unmarked, "joined_wrong": joined_wrong, "whole_wrong": whole_wrong}


def expert_targets(model: torch.nn.Module, shards: list, only: str | None = None) -> list[str]:
    """peft's ``target_parameters`` for every per-expert tensor of ``model``'s experts modules (their
    names inside the experts module); ``only``: ``"projections"`` (the experts module's own tensors)
    or ``"post"`` (a per-expert post module's, Ergo's ``post_expert_norm``)."""
    inside = {s.module_name + ".": len(s.module_name) + 1 for s in shards}  # names inside the experts module
    targets = sorted(
        {
            n[next(inside[m] for m in inside if n.startswith(m)) :]
            for n, p in model.named_parameters()
            if epmoe.is_expert_parameter(p)
        }
    )
    if only is not None:  # a dotted name lives in a module inside the experts module
        targets = [t for t in targets if ("." in t) == (only == "post")]
    return targets


def gathered(obj) -> list:
    """Every rank's ``obj``, by rank."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def summed_over_ranks(grads: dict[str, torch.Tensor | None], params: dict) -> tuple[dict, set[str]]:
    """The unsharded model's gradients summed over every rank's batch, from each rank's own
    (``grads``, by name; ``None`` where its batch reaches none): added in rank order into zeros, as one
    process accumulating every rank's batch in turn would (bitwise, in the gradients' dtype); and the
    names some rank's batch reaches. Each rank runs the unsharded model on its own batch only."""
    total = {n: torch.zeros_like(params[n]) for n in grads}
    reached = set()
    for per_rank in gathered(grads):
        for name, grad in per_rank.items():
            if grad is not None:
                total[name] += grad
                reached.add(name)
    return total, reached


def local_rows(full: torch.Tensor, name: str, param: torch.Tensor, shards: list) -> torch.Tensor:
    """The rows of the unsharded expert tensor ``full`` this rank's ``param`` (named ``name``) holds:
    its experts' rows (``param.shape[0] / e`` rows each: one for packed experts, ``I`` for stacked rows)."""
    shard = next(s for s in shards if name.startswith(f"{s.module_name}."))
    return full.narrow(0, shard.local_start * param.shape[0] // shard.num_local_experts, param.shape[0])


def bf16_distances(rank: int, world: int, family: Family) -> dict:
    """bfloat16 EP over every rank and the bfloat16 model without EP (the family's own experts), each
    one's distance from the float64 model, ``||x - x64|| / ||x64||``: this rank's per-token losses (the
    squared outputs' mean per token) and this rank's experts' gradients (summed over every rank's
    batch), as ``{"losses": {"ep": d, "no_ep": d}, "expert_grads": {...}}``."""
    ref64, ref16 = build(family, dtype=torch.float64), build(family, dtype=torch.bfloat16)
    ep16 = copy.deepcopy(ref16)
    shards = epmoe.apply_expert_parallel(ep16)
    torch.manual_seed(rank)
    out_ep = ep16(**inputs(family, rank, LENGTHS[rank]))[0]
    out_ep.float().square().mean().backward()
    # experts no token reaches (a vision tower's, on text) have no gradient, unsharded or not
    experts = [(n, p) for n, p in ep16.named_parameters() if epmoe.is_expert_parameter(p) and p.grad is not None]
    outs, grads = {}, {}  # by dtype: the unsharded model's output on this rank's batch, its experts' gradients
    for dtype, ref in ((torch.float64, ref64), (torch.bfloat16, ref16)):
        params = dict(ref.named_parameters())
        torch.manual_seed(rank)
        out = ref(**inputs(family, rank, LENGTHS[rank]))[0]
        out.float().square().mean().backward()
        outs[dtype] = out.detach()
        summed, _ = summed_over_ranks({n: params[n].grad for n, _ in experts}, params)
        grads[dtype] = torch.cat([local_rows(summed[n].double(), n, p, shards).reshape(-1) for n, p in experts])
    grads_ep = torch.cat([p.grad.double().reshape(-1) for _, p in experts])

    def distance(x: torch.Tensor, x64: torch.Tensor) -> float:  # 0 where float64 has nothing (no gradient)
        return ((x.double() - x64.double()).norm() / x64.double().norm().clamp_min(1e-300)).item()

    def losses(out: torch.Tensor) -> torch.Tensor:
        return out.double().square().mean(-1)

    loss64 = losses(outs[torch.float64])
    return {
        "losses": {
            "ep": distance(losses(out_ep.detach()), loss64),
            "no_ep": distance(losses(outs[torch.bfloat16]), loss64),
        },
        "expert_grads": {
            "ep": distance(grads_ep, grads[torch.float64]),
            "no_ep": distance(grads[torch.bfloat16], grads[torch.float64]),
        },
        "experts": len(experts),
    }


def ep_peft_model(model: torch.nn.Module, config) -> torch.nn.Module:
    """``get_peft_model(model, config)`` of an EP model as its users add LoRA with the installed peft: as
    it is where peft reads the whole shape epmoe marks (>= 0.21), else inside
    :func:`epmoe.ep.lora.whole_experts_for_peft` (older peft sizes the factors from the shard: refused
    by name otherwise, as tests/ep/compose_workers.py checks; the transformers 5.6 test environment's peft is 0.18)."""
    import peft
    from packaging.version import Version

    from epmoe.ep.lora import whole_experts_for_peft

    if Version(peft.__version__) >= Version("0.21"):
        return peft.get_peft_model(model, config)
    with whole_experts_for_peft(model):
        return peft.get_peft_model(model, config)


def lora_parity(rank: int, world: int, family: Family, only: str | None = None) -> dict:
    """PEFT LoRA (``target_parameters``: every per-expert tensor, random A and B) on ``family``'s EP model
    against the same LoRA on the unsharded model, the same seed: ``{"errors": {"output": ..., "lora_grads":
    ...}, "compared": LoRA factors}``, each factor's gradient against the unsharded one's summed over the
    ranks' batches, narrowed to this rank's experts (``lora_A`` ``(r*E, in)`` expert-major, ``lora_B``
    ``(out, r*E)`` expert-minor); or ``{"refused": message}`` (epmoe's ``ValueError``), or
    ``{"without_ep": error}`` where peft's LoRA does not run on the unsharded model either. ``only``:
    ``"projections"`` (the experts module's own tensors) or ``"post"`` (a per-expert post module's, Ergo's
    ``post_expert_norm``) of the targets."""
    from peft import LoraConfig, get_peft_model

    ref = build(family)
    model = copy.deepcopy(ref)
    shards = epmoe.apply_expert_parallel(model)
    targets = expert_targets(model, shards, only)
    config = LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, target_modules=[], target_parameters=targets)
    torch.manual_seed(1)
    try:
        ref = get_peft_model(ref, config)
        torch.manual_seed(rank)
        ref_out, ref_loss = loss_of(ref(**inputs(family, rank, LENGTHS[rank])))
    except Exception as error:  # noqa: BLE001 - peft's own limit, whatever it raises
        return {"without_ep": f"{type(error).__name__}: {error}"}
    ref_loss.backward()
    torch.manual_seed(1)
    try:  # adding it inside whole_experts_for_peft settles the factors, and refuses, there
        model = ep_peft_model(model, config)
        torch.manual_seed(rank)
        out, loss = loss_of(model(**inputs(family, rank, LENGTHS[rank])))
    except ValueError as error:
        return {"refused": str(error)}
    loss.backward()
    ref_params = dict(ref.named_parameters())
    shard_of = {f"base_model.model.{s.module_name}.": s for s in shards}
    expert_factors = {n for n in ref_params if "lora_" in n and any(n.startswith(prefix) for prefix in shard_of)}
    summed, reached = summed_over_ranks({n: ref_params[n].grad for n in expert_factors}, ref_params)
    errors, compared = {"output": max_rel(out, ref_out), "lora_grads": 0.0}, 0
    for name, param in model.named_parameters():
        if "lora_" not in name:
            continue
        if param.grad is None:  # experts no token reaches (a vision tower's, on text): none unsharded either
            assert name not in reached and ref_params[name].grad is None, f"{name} has no gradient under EP"
            continue
        if name not in expert_factors:  # LoRA on a module the targets' names also match (a shared expert)
            expected = ref_params[name].grad
        else:
            shard = next(s for prefix, s in shard_of.items() if name.startswith(prefix))
            full, E, start, end = summed[name], shard.num_experts, shard.local_start, shard.local_end
            expected = (
                full.reshape(E, -1, full.shape[1])[start:end].reshape(param.shape)
                if ".lora_A." in name
                else full.reshape(full.shape[0], -1, E)[:, :, start:end].reshape(param.shape)
            )
        errors["lora_grads"] = max(errors["lora_grads"], max_rel(param.grad, expected))
        compared += 1
    return {"errors": errors, "compared": compared}


def check_families(rank: int, world: int, families: list[Family]) -> dict[str, dict]:
    """:func:`family_parity` (with :func:`joined_by_marks` as ``"marks"``; and, where it runs,
    :func:`bf16_distances` as ``"bf16"`` and, on 2 ranks, :func:`lora_parity` as ``"lora"`` and, for DBRX,
    :func:`wrong_mark_refused` as ``"wrong_mark"``) of every family on this process group, by
    ``Family.key``; a family whose check raised gets ``{"error": traceback}`` (the others still run).
    A barrier after each keeps the ranks in step."""
    out = {}
    for family in families:
        try:
            out[family.key] = family_parity(rank, world, family)
            if "refused" not in out[family.key]:
                out[family.key]["bf16"] = bf16_distances(rank, world, family)
                if world == 2 and family.name == "dbrx":
                    try:
                        out[family.key]["wrong_mark"] = wrong_mark_refused(family)
                    except BaseException:  # noqa: BLE001 - the marks test reports it; the verdict stands
                        out[family.key]["wrong_mark"] = traceback.format_exc()
                if world == 2:
                    try:
                        out[family.key]["lora"] = lora_parity(rank, world, family)
                        if family.name == "ergo":  # LoRA on its projections alone, on its per-expert norm alone
                            for only in ("projections", "post"):
                                out[family.key][f"lora_{only}"] = lora_parity(rank, world, family, only)
                    except BaseException:  # noqa: BLE001 - the LoRA test reports it; the verdict stands
                        out[family.key]["lora"] = {"error": traceback.format_exc()}
        except BaseException:  # noqa: BLE001 - the test reports it, naming the family
            out[family.key] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


def wrong_mark_refused(family: Family) -> str | None:
    """``apply_expert_parallel`` on ``family``'s stacked-rows experts with their marks read as one row
    per expert (what every mark said before; DBRX's ``w1`` is ``(E*I, H)``): the ``ValueError`` it
    raises on every rank (``None``: it did not)."""
    from unittest import mock

    from epmoe.ep.recognize import expert_rows

    def one_row_each(module):
        return [(name, 1) for name, _ in expert_rows(module)]

    with mock.patch("epmoe.ep.lora.expert_rows", one_row_each):
        try:
            epmoe.apply_expert_parallel(build(family))
        except ValueError as error:
            return str(error)
    return None


def verdict(family: Family, results: list[dict]) -> str:
    """One line of the families table (docs/models.md): ``exact``, ``exact to <dtype> rounding ...`` (a
    family whose own experts forward rounds to ``<dtype>``: compared at :data:`TOL_ROUNDS_TO`), ``refused: <reason>``,
    ``wrong: <kind> ...`` or ``error: <exception>``, from every rank's :func:`family_parity` result."""
    if any("error" in r for r in results):
        last = next(r["error"] for r in results if "error" in r).strip().splitlines()[-1]
        return f"error: {last[:120]}"
    if any("refused" in r for r in results):
        message = results[0].get("refused", "")
        reason = message.split("nothing was changed: ", 1)[-1]
        return f"refused: {reason}"
    worst = {k: max(r["errors"][k] for r in results) for k in results[0]["errors"]}
    rounds_to = results[0]["rounds_to"]
    tol = TOL_ROUNDS_TO.get(rounds_to, TOL) if rounds_to else TOL
    bad = {k: v for k, v in worst.items() if not v <= tol}
    for metric in ("losses", "expert_grads"):  # bfloat16: as close to float64 as without EP
        ep, no_ep = (max(r["bf16"][metric][run] for r in results) for run in ("ep", "no_ep"))
        if ep > BF16_BOUND * no_ep:
            bad[f"bf16 {metric}"] = ep / no_ep if no_ep else float("inf")
    if bad or not all(n > 0 for r in results for n in r["compared"].values()):
        return "wrong: " + ", ".join(
            f"{k} rel. err. {v:.2g}"
            if not k.startswith("bf16")
            else f"{k} {v:.2f}x the distance from float64 without EP"
            for k, v in bad.items()
        )
    if max(worst.values()) > TOL:
        return f"exact to {rounds_to} rounding (its own experts forward rounds float64 to {rounds_to}; epmoe does not)"
    return "exact"


TOL = 1e-10
# a family whose own experts forward rounds to float32 in a float64 model is as close to any other order
# of its sums as float32 rounding allows, amplified through its layers and gradients
TOL_ROUNDS_TO = {"float32": 1e-4}
# bfloat16: EP's distance from float64 (per-token losses, expert gradients; the largest rank's) at most this
# factor times the run without EP's. Other summation orders of the same bf16 sums land 0.86-1.38x apart on
# these tiny models; computing experts in a narrower dtype than the family (1.7x and 5x on OpenAI's
# privacy filter before epmoe followed its float32) does not fit.
BF16_BOUND = 1.5


def save_round_trip(rank: int, world: int, root: str, family: Family, **options) -> dict:
    """``save_pretrained`` on every rank of ``family``'s EP model (fp32), then plain ``from_pretrained``
    of the files by the family's own class: ``{"keys": (keys written, keys of a plain save of the
    unsharded model), "unequal": names of loaded weights unlike the unsharded model's (rows no expert
    reads, which EP does not keep, must be zeros instead), "missing": keys the plain load reported
    missing, "logits": the loaded model's largest relative difference from the unsharded one's}``."""
    import os

    import safetensors.torch

    from epmoe.ep.state import state_of

    ref = build(family, dtype=torch.float32)
    model = copy.deepcopy(ref)
    epmoe.apply_expert_parallel(model)
    if family.variant:  # a class made for the purpose, loaded by its state dict: its own keys, not the family's
        options = {**options, "save_original_format": False}  # checkpoint layout (LongCat-Flash's, 5.25)
    ep_dir, plain_dir = os.path.join(root, f"{family.key}-ep"), os.path.join(root, f"{family.key}-plain")
    model.save_pretrained(ep_dir, **options)
    if rank == 0:
        ref.save_pretrained(plain_dir, **options)
    dist.barrier()
    keys = tuple(sorted(safetensors.torch.load_file(os.path.join(d, "model.safetensors"))) for d in (ep_dir, plain_dir))
    if family.variant:  # a class made for the purpose: its state dict, as from_pretrained would read it
        loaded = build(family, dtype=torch.float32)
        saved = safetensors.torch.load_file(os.path.join(ep_dir, "model.safetensors"))
        info = {"missing_keys": loaded.load_state_dict(saved, strict=False).missing_keys}
    else:
        loaded, info = type(ref).from_pretrained(ep_dir, dtype=torch.float32, output_loading_info=True)
    unread = {
        f"{name}.{key}": rows
        for name, module in model.named_modules()
        if state_of(module) is not None
        for key, rows in state_of(module).unread_rows.items()
    }
    ref_params, unequal = dict(ref.named_parameters()), []
    for name, param in loaded.named_parameters():
        kept = param.shape[0] - unread.get(name, 0) if param.dim() else None
        if (
            param.shape != ref_params[name].shape
            or not torch.equal(param[:kept], ref_params[name][:kept])
            or (kept is not None and param[kept:].any())
        ):
            unequal.append(name)
    with torch.no_grad():
        torch.manual_seed(0)
        out = loaded(**inputs(family, rank, LENGTHS[rank]))[0]
        torch.manual_seed(0)
        expected = ref(**inputs(family, rank, LENGTHS[rank]))[0]
    return {"keys": keys, "unequal": unequal, "missing": sorted(info["missing_keys"]), "logits": max_rel(out, expected)}


def converted_round_trip(rank: int, world: int, root: str, family: Family) -> dict:
    """:func:`save_round_trip` in the class's checkpoint layout as ``"saved"``; where epmoe refuses to
    write that layout one experts tensor at a time, its message as ``"refused"`` and the round trip
    with ``save_original_format=False`` as ``"saved"``."""
    try:
        return {"saved": save_round_trip(rank, world, root, family)}
    except NotImplementedError as error:
        refused = str(error)
    return {"refused": refused, "saved": save_round_trip(rank, world, root, family, save_original_format=False)}


def dcp_round_trip(rank: int, world: int, root: str, family: Family) -> dict:
    """``family``'s EP model (fp64) after one AdamW step, ``epmoe.get_state_dict`` -> ``dcp.save``; then
    ``dcp.load`` into a fresh EP model and optimizer (``epmoe.set_state_dict``) and into the unsharded
    model's plain state dict (the experts with weights: zero-computation experts' rows are never read
    and not kept): ``{"resumed": names of parameters or Adam moments not bitwise the saved ones,
    "unsharded": names whose full tensor's rows of this rank's experts (the rest: the whole tensor)
    are not bitwise the EP model's, "experts": expert tensors compared}``."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    def trained():
        model = build(family)
        shards = epmoe.apply_expert_parallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, shards, optimizer

    model, shards, optimizer = trained()
    torch.manual_seed(rank)
    loss_of(model(**inputs(family, rank, LENGTHS[rank])))[1].backward()
    for param in model.parameters():  # state for every trained parameter, as the fresh optimizer's load expects
        if param.grad is None and param.requires_grad:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    experts = {id(p) for p in epmoe.expert_parameters(model)}
    for param in model.parameters():  # replicas as data parallelism keeps them: rank 0's (each rank's batch differs)
        if id(param) not in experts:
            for tensor in (param.data, *optimizer.state[param].values()):
                dist.broadcast(tensor, 0)
    path = os.path.join(root, f"{family.key}-dcp")
    saved = epmoe.get_state_dict(model, optimizer)
    dcp.save(saved, checkpoint_id=path)

    fresh, _, fresh_optimizer = trained()
    state = epmoe.get_state_dict(fresh, fresh_optimizer)
    dcp.load(state, checkpoint_id=path)
    epmoe.set_state_dict(fresh, fresh_optimizer, state=state)
    resumed = []
    for (name, param), loaded in zip(model.named_parameters(), fresh.parameters()):
        moments, loaded_moments = optimizer.state[param], fresh_optimizer.state[loaded]
        resumed += [name] if not torch.equal(param, loaded) else []
        resumed += [
            f"{name}.{k}"
            for k, v in moments.items()
            if k not in loaded_moments or not torch.equal(v, loaded_moments[k])
        ]

    # tied weights once; zero-computation experts' rows (never read, not kept under EP) left out
    full = {
        k: v[: saved["model"][k].shape[0]].clone()
        for k, v in get_model_state_dict(build(family)).items()
        if k in saved["model"]
    }
    dcp.load({"model": full}, checkpoint_id=path)
    unsharded, compared = [], 0
    for name, param in model.named_parameters():
        expected = full[name]
        if id(param) in experts:
            expected, compared = local_rows(expected, name, param, shards), compared + 1
        if not torch.equal(param.detach(), expected):
            unsharded.append(name)
    return {"resumed": resumed, "unsharded": unsharded, "experts": compared}


def zero_experts_only(rank: int, world: int, family: Family) -> dict:
    """``family``'s zero-computation experts module under EP called on a batch that chooses only zero
    experts on the last rank (it sends nothing) and real and zero experts on the others: ``{"output":
    max relative error, "hidden_grad": ...}`` against the family's own module (fp64)."""
    ref = build(family)
    model = copy.deepcopy(ref)
    epmoe.apply_expert_parallel(model)
    experts, ref_experts = (find_experts_modules(x)[0][1] for x in (model, ref))
    assert zero_experts(experts), f"{family.name}: no zero-computation experts"
    num = ref_experts.down_proj.shape[0]
    g = torch.Generator().manual_seed(rank)
    hidden = torch.randn(6, ref_experts.down_proj.shape[1], dtype=torch.float64, generator=g)
    index = torch.stack([torch.arange(6) % num, torch.full((6,), num)], 1)
    if rank == world - 1:
        index[:, 0] = num
    weights = torch.rand(6, 2, dtype=torch.float64, generator=g)
    results = []
    for module in (experts, ref_experts):
        x = hidden.clone().requires_grad_()
        out = module(x, index, weights)
        out.square().sum().backward()
        results.append((out.detach(), x.grad))
    (out, grad), (ref_out, ref_grad) = results
    return {"output": max_rel(out, ref_out), "hidden_grad": max_rel(grad, ref_grad)}


def lora_on_experts(rank: int, world: int, family: Family) -> str | None:
    """PEFT LoRA on every per-expert weight of ``family``'s EP model: the error of its first forward
    (``None`` if it ran)."""
    from peft import LoraConfig

    model = build(family)
    epmoe.apply_expert_parallel(model)
    experts = {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if epmoe.is_expert_parameter(p)}
    try:  # adding it inside whole_experts_for_peft settles the factors, and refuses, there
        model = ep_peft_model(model, LoraConfig(r=2, target_modules=[], target_parameters=sorted(experts)))
        model(**inputs(family, rank, LENGTHS[rank]))
    except ValueError as error:
        return str(error)
    return None


def stacked_and_zero_cases(rank: int, world: int, root: str, families: list[Family], converted: list[Family]) -> dict:
    """:func:`bf16_distances`, :func:`save_round_trip`, :func:`dcp_round_trip` and :func:`lora_on_experts`
    of every family, :func:`zero_experts_only` of the zero-computation experts, and :func:`converted_round_trip` of
    the ``converted`` families, in one spawn."""
    return {
        "converted": {f.name: converted_round_trip(rank, world, root, f) for f in converted},
        "bf16": {f.key: bf16_distances(rank, world, f) for f in families},
        "saved": {f.key: save_round_trip(rank, world, root, f) for f in families},
        "dcp": {f.key: dcp_round_trip(rank, world, root, f) for f in families},
        "lora": {f.key: lora_on_experts(rank, world, f) for f in families if f.name != "ergo"},  # see lora_parity
        "zero_only": zero_experts_only(rank, world, next(f for f in families if f.variant == "zero_experts")),
    }
