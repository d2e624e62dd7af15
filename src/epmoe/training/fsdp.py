"""A Trainer under accelerate's FSDP2 plugin (``TrainingArguments(fsdp=..., fsdp_config={"version": 2})``), exact.

accelerate's ``fsdp2_prepare_model`` calls ``fully_shard`` on the wrapped layers and the root with
``ignored_params`` taken from its plugin's ``ignored_modules`` (``FSDP_IGNORED_MODULES``, a regex of
module names, or modules). The expert parameters differ on every EP rank and must be among them, and
nothing else may (an ignored replicated weight would never be synchronised). ``TrainingArguments``
has no field for it, so :func:`prepare_fsdp_trainer` sets the plugin's ``ignored_modules`` to the
modules that hold the experts (each holding expert parameters only), or, when the user already set
it, checks that it names exactly the expert parameters. Then:

* the optimizer Trainer builds gets the expert parameters in param groups of their own (FSDP2
  turns the others into DTensors, which torch's fused and foreach kernels cannot mix with plain
  tensors);
* Trainer's clip: with plain expert tensors next to FSDP2's DTensors, Trainer bypasses
  ``accelerator.clip_grad_norm_`` (``Trainer._mixed_mesh_grad_norm``: one norm per mesh, the plain
  part of which sees only this rank's experts); :func:`epmoe.prepare_trainer` routes that method to
  epmoe's clip too (every expert counted once, FSDP2 shards over their mesh).
* ``save_model``: Trainer's FSDP branch would gather ``accelerator.get_state_dict`` (this rank's
  experts only) for the main process, or, with ``SHARDED_STATE_DICT``, write nothing.
  :func:`fsdp_save_model` takes Trainer's ordinary branch instead: every rank joins the EP model's
  ``save_pretrained`` (:mod:`epmoe.checkpoint.save`), which gathers FSDP2's DTensors and every
  rank's experts and writes the unsharded model's checkpoint.
* Trainer checkpoints (``save_strategy``): the model as above and, through
  :func:`epmoe.get_state_dict` and DCP, model and optimizer (:mod:`epmoe.training.trainer`); the
  FSDP plugin's own model and optimizer files (rank 0's experts only) are not written.

Refused: FSDP1 (``version: 1``: it flattens and shards every parameter, and its
``ignored_modules`` are not what accelerate's Trainer path supports for EP) and
``cpu_ram_efficient_loading`` (accelerate moves the whole model to ``meta`` and then broadcasts
rank 0's full state dict over every rank, which would overwrite each rank's experts with rank 0's).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from torch import nn

from epmoe.ep.params import expert_parameters, is_expert_parameter
from epmoe.training.optim import split_groups_of_created_optimizer, split_param_groups


def prepare_fsdp_trainer(trainer: Any) -> None:
    """What :func:`epmoe.prepare_trainer` does for a Trainer whose accelerator runs the FSDP plugin:
    refuse what cannot be exact, keep the experts out of ``fully_shard`` through the plugin's
    ``ignored_modules``. Call before ``trainer.train()`` (accelerate shards the model there)."""
    plugin = trainer.accelerator.state.fsdp_plugin
    version = getattr(plugin, "fsdp_version", 1)
    if version != 2:
        raise ValueError(
            "prepare_trainer(trainer): accelerate's FSDP1 (fsdp_config version 1) flattens and shards every "
            "parameter, experts included, which differ per EP rank; use FSDP2: "
            "TrainingArguments(fsdp='full_shard auto_wrap', fsdp_config={'version': 2, ...})"
        )
    if getattr(plugin, "cpu_ram_efficient_loading", False):
        raise ValueError(
            "prepare_trainer(trainer): fsdp_config cpu_ram_efficient_loading=True makes accelerate move the model "
            "to meta and broadcast rank 0's full state dict to every rank, which would overwrite each EP rank's "
            "experts with rank 0's; set it to False (and FSDP_CPU_RAM_EFFICIENT_LOADING unset): each EP rank "
            "already loads only its own experts with epmoe.from_pretrained"
        )
    model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    experts = expert_parameters(model)
    if any(is_dtensor(p) for p in experts):
        raise ValueError(
            "prepare_trainer(trainer): the model is already sharded by FSDP with its expert parameters inside; "
            "call prepare_trainer before trainer.train()"
        )
    keep_experts_out(plugin, model, experts)
    split_groups_of_created_optimizer(trainer, split_expert_param_groups)


def split_expert_param_groups(optimizer: Any, caller: str) -> None:
    """Move the expert parameters of ``optimizer`` into param groups of their own, each group's
    options kept. Trainer builds its optimizer before accelerate shards the model and swaps the other
    parameters for FSDP2's DTensors; a group mixing them with the plain expert tensors fails in
    torch's fused / foreach kernels. Per-element updates are the same in either grouping."""
    split_param_groups(optimizer, lambda group, p: {} if is_expert_parameter(p) else None, caller)


def keep_experts_out(plugin: Any, model: nn.Module, experts: list[nn.Parameter]) -> None:
    """Make ``plugin.ignored_modules`` name exactly ``experts`` (set it when unset; check it when set)."""
    wanted = {id(p) for p in experts}
    if plugin.ignored_modules is None:
        owners = [m for m in model.modules() if any(id(p) in wanted for p in m.parameters(recurse=False))]
        ignored = {id(p) for m in owners for p in m.parameters()}
        if ignored != wanted:  # a module holding experts also holds (or contains) replicated weights
            names = [n for n, p in model.named_parameters() if id(p) in ignored - wanted]
            raise ValueError(
                f"prepare_trainer(trainer): accelerate's FSDP2 plugin ignores whole modules, and the modules "
                f"holding the expert parameters also hold replicated parameters ({', '.join(names[:4])}); "
                f"shard by hand with fully_shard(..., ignored_params=set(epmoe.expert_parameters(model)))"
            )
        plugin.ignored_modules = owners
        return
    ignored = {id(p) for p in _parameters_of(plugin.ignored_modules, model)}
    if ignored != wanted:
        missing = [n for n, p in model.named_parameters() if id(p) in wanted - ignored]
        extra = [n for n, p in model.named_parameters() if id(p) in ignored - wanted]
        raise ValueError(
            f"prepare_trainer(trainer): the FSDP plugin's ignored_modules (FSDP_IGNORED_MODULES) must name exactly "
            f"the expert parameters: FSDP would shard experts ({', '.join(missing[:4]) or 'none'}) and leave "
            f"replicated parameters unsynchronised ({', '.join(extra[:4]) or 'none'}); leave it unset and "
            f"prepare_trainer sets it"
        )


def _parameters_of(modules: Any, model: nn.Module) -> list[nn.Parameter]:
    """The parameters accelerate's ``get_parameters_from_modules`` ignores for ``modules`` (a regex
    matched in full against module names, or modules), without moving anything."""
    if isinstance(modules, str):
        pattern = re.compile(modules)
        modules = [m for name, m in model.named_modules() if pattern.fullmatch(name)]
    return [p for m in modules for p in m.parameters()]


def without_fsdp_branch(trainer: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
    """``method(*args, **kwargs)`` (Trainer's own ``save_model`` or ``_save_optimizer_and_scheduler``)
    through its non-FSDP branch: for ``save_model`` every rank joins the EP model's
    ``save_pretrained``, which gathers FSDP2's shards and every rank's experts itself; for the
    optimizer, Trainer's plain file (epmoe's DCP state is what resumes) and the scheduler."""
    trainer.is_fsdp_enabled = False
    try:
        return method(*args, **kwargs)
    finally:
        trainer.is_fsdp_enabled = True


def shard_dense(model: nn.Module, mesh: Any) -> nn.Module:
    """epmoe's FSDP2 recipe on an EP model: ``fully_shard`` each block of the classes the model names
    unsplittable (``_no_split_modules``: its decoder layers, as accelerate's auto-wrap picks them),
    then the root, over ``mesh``, the expert parameters left out (``ignored_params``): they stay
    this rank's local tensors, their gradients reduced by epmoe. A module whose own trainable
    parameters keep another dtype than the model's (a router kept in float32,
    ``_keep_in_fp32_modules_strict``) is sharded on its own first: FSDP2 wants one dtype per unit."""
    from torch.distributed.fsdp import fully_shard

    experts = set(expert_parameters(model))
    dense = [p for p in model.parameters() if p not in experts and p.requires_grad]
    dtypes = Counter()
    for p in dense:
        dtypes[p.dtype] += p.numel()
    main = dtypes.most_common(1)[0][0] if dtypes else None
    own_dtype = [
        m
        for m in model.modules()
        if any(p.dtype != main and p.requires_grad and p not in experts for p in m.parameters(recurse=False))
    ]
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    units = [*reversed(own_dtype), *(m for m in model.modules() if type(m).__name__ in blocks and m not in own_dtype)]
    for module in (m for m in units if m is not model):  # inner units first, each once; the root last
        fully_shard(module, mesh=mesh, ignored_params=experts)
    return fully_shard(model, mesh=mesh, ignored_params=experts)


def is_dtensor(p: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(p, DTensor)
