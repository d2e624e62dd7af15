"""What ``epmoe run`` does inside the processes of the user's command (its bootstrap,
``epmoe/cli/bootstrap/sitecustomize.py``, calls :func:`hook` once transformers has executed
``transformers.modeling_utils`` or ``transformers.trainer``; nothing here runs in a process that never
imports them, nor in any process ``epmoe run`` did not start).

* ``PreTrainedModel.from_pretrained`` (a classmethod: every ``AutoModel*.from_pretrained`` ends there):
  the loaded MoE model is made expert-parallel (:func:`~epmoe.compose.apply.apply_expert_parallel`)
  before the caller sees it, so before any adapter is added. Its process group is the default one,
  started here as torch would (the platform's backend, the launcher's environment) where the
  launcher's environment is present and nothing started it yet; ``EPMOE_RUN``'s ``ep`` below the
  world size makes it a ``("dp", "ep")`` mesh. A model with no experts is refused by name unless a MoE
  model was made expert-parallel before it in the process (then it is an auxiliary model: a reward
  model, a dense draft, left as loaded). A load in a single process without a launcher is refused.
* ``transformers.Trainer.__init__`` (and every subclass's own ``__init__``): once the outermost
  ``__init__`` returns, :func:`~epmoe.training.trainer.prepare_trainer` runs on the trainer; a trainer
  whose model is not expert-parallel is refused by name.
* axolotl's ``axolotl.train.save_trained_model`` (axolotl 0.19): under DDP it saves the final model from
  local rank 0 alone (``model.save_pretrained``, outside its Trainer); the other ranks join that save
  (``is_main_process=False``: they gather, rank 0 writes) once it has run on them.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import json
import multiprocessing
import os
import sys
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from epmoe import platform
from epmoe.checkpoint.save import SavePretrained
from epmoe.compose.apply import apply_expert_parallel
from epmoe.ep import ExpertParallelConfig
from epmoe.ep.adopt import find_experts_modules
from epmoe.ep.state import ep_states
from epmoe.training.trainer import prepare_trainer

ENV = "EPMOE_RUN"  # {"ep": int or null, "config": {ExpertParallelConfig fields}}
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_INIT_DEPTH = "_epmoe_run_init_depth"


class _State:
    loading = 0  # from_pretrained calls in progress (an override calling super() is one load)
    group: Any = None  # the EP group or ("dp", "ep") mesh every model of the process shares
    made: list[str] = []  # the classes made expert-parallel
    hooked: set[str] = set()


def settings() -> tuple[int | None, ExpertParallelConfig]:
    """``(ep, config)`` from ``EPMOE_RUN``."""
    values = json.loads(os.environ[ENV])
    return values.get("ep"), ExpertParallelConfig.from_any(values.get("config") or {})


def hook(name: str, module: Any) -> None:
    """Called by the bootstrap once ``transformers.<name>`` has executed, with the module."""
    if name in _State.hooked:
        return
    _State.hooked.add(name)
    if name == "transformers.modeling_utils":
        _hook_from_pretrained(module.PreTrainedModel)
        atexit.register(_report_at_exit)
    elif name == "transformers.trainer":
        _hook_trainer(module.Trainer)
    elif name == "axolotl.train":
        _hook_axolotl_save(module)


def _hook_from_pretrained(cls: type) -> None:
    load = cls.__dict__["from_pretrained"].__func__

    @functools.wraps(load)
    def from_pretrained(klass, *args, **kwargs):
        if _State.loading:
            return load(klass, *args, **kwargs)
        _State.loading += 1
        try:
            loaded = load(klass, *args, **kwargs)
        finally:
            _State.loading -= 1
        make_expert_parallel(loaded[0] if isinstance(loaded, tuple) else loaded)
        return loaded

    cls.from_pretrained = classmethod(from_pretrained)


def make_expert_parallel(model: Any) -> None:
    """Make a model ``from_pretrained`` just loaded expert-parallel, or refuse it (see the module)."""
    if not isinstance(model, nn.Module) or any(True for _ in ep_states(model)):
        return
    name = type(model).__name__
    if not find_experts_modules(model):
        if _State.made:
            return  # an auxiliary model beside the MoE one: left as loaded
        raise ValueError(
            f"epmoe run: {name} has no experts module epmoe can serve: `epmoe run` needs a MoE model "
            f"(a transformers MoE family, docs/models.md); run the command without `epmoe run`"
        )
    ep, config = settings()
    group = _ep_group(name, ep)
    apply_expert_parallel(model, group, config=config)
    _State.made.append(name)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        mesh = "the world group" if group is None else f"a ('dp', 'ep') mesh of {world // (ep or world)} x {ep}"
        print(
            f"epmoe run: {name} expert-parallel, EP size {ep or world} of {world} ranks, over {mesh}", file=sys.stderr
        )


def _ep_group(name: str, ep: int | None) -> Any:
    """The default group (started where the launcher's environment says so) or the ``("dp", "ep")`` mesh."""
    if _State.group is not None:
        return _State.group
    if not dist.is_initialized():
        missing = [key for key in LAUNCHER_ENV if key not in os.environ]
        if missing:
            raise ValueError(
                f"epmoe run: {name} was loaded in a single process with no process group (no {', '.join(missing)} "
                f"in the environment): launch the command with torchrun, accelerate launch or the framework's own "
                f"multi-process flag, e.g. `epmoe run -- torchrun --nproc-per-node 2 train.py`"
            )
        _init_process_group()
    world = dist.get_world_size()
    if ep is None or ep == world:
        return None
    if world % ep:
        raise ValueError(f"epmoe run --ep {ep}: the world size {world} is not a multiple of the EP size {ep}")
    _State.group = init_device_mesh(
        platform.device_type(), (world // ep, ep), mesh_dim_names=("dp", "ep")
    )  # ranks [k*ep, (k+1)*ep) hold one copy of the experts
    return _State.group


def _init_process_group() -> None:
    """The default group as a launcher's framework would start it: the platform's backend, the device of
    ``LOCAL_RANK``, the rank and world of the environment."""
    kind = platform.device_type()
    module = platform.device_module(kind)
    if kind != "cpu" and module is not None and hasattr(module, "set_device") and "LOCAL_RANK" in os.environ:
        module.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(platform.comm_backend(kind), timeout=datetime.timedelta(minutes=30))


def _hook_trainer(trainer_class: type) -> None:
    """Prepare each trainer once its outermost ``__init__`` returns (a subclass's, e.g. TRL's, sets
    what :func:`prepare_trainer` reads, its reference model, after ``Trainer.__init__``)."""
    trainer_class.__init__ = _prepared_after(trainer_class.__dict__["__init__"])
    previous = trainer_class.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(trainer_class, cls).__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _prepared_after(cls.__dict__["__init__"])

    trainer_class.__init_subclass__ = classmethod(__init_subclass__)


def _prepared_after(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        depth = self.__dict__.get(_INIT_DEPTH, 0)
        self.__dict__[_INIT_DEPTH] = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            self.__dict__[_INIT_DEPTH] = depth
        if depth == 0:
            del self.__dict__[_INIT_DEPTH]
            prepare(self)

    return __init__


def _hook_axolotl_save(module: Any) -> None:
    """axolotl's final save under DDP (neither FSDP nor DeepSpeed ZeRO-3) calls ``model.save_pretrained`` on
    local rank 0 only: an expert-parallel model's save needs every rank, so the others join it."""
    save_trained_model = module.save_trained_model

    @functools.wraps(save_trained_model)
    def save(cfg, trainer, model, *args, **kwargs):
        saved = save_trained_model(cfg, trainer, model, *args, **kwargs)
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        fsdp = getattr(trainer, "is_fsdp_enabled", False) or cfg.fsdp_config
        zero3 = cfg.deepspeed and is_deepspeed_zero3_enabled()
        rank_0_only = not (fsdp or zero3 or cfg.relora) and cfg.local_rank != 0  # its branches, 0.19's
        if rank_0_only and isinstance(getattr(model, "save_pretrained", None), SavePretrained):
            model.save_pretrained(cfg.output_dir, is_main_process=False)
        return saved

    module.save_trained_model = save


def prepare(trainer: Any) -> None:
    """:func:`prepare_trainer` on a trainer built on an expert-parallel model; refuse any other."""
    model = getattr(trainer, "model", None)
    if isinstance(model, nn.Module) and any(True for _ in ep_states(model)):
        prepare_trainer(trainer)
        return
    raise ValueError(
        f"epmoe run: {type(trainer).__name__}'s model ({type(model).__name__}) is not expert-parallel: `epmoe run` "
        f"makes a MoE model expert-parallel where from_pretrained loads it, and this one was built otherwise"
    )


def _report_at_exit() -> None:
    """One line on a launched rank 0 where no MoE model was made expert-parallel (the exit code stays the
    command's: the refusals that end a run are raised at the load and at the Trainer)."""
    launched_rank_0 = os.environ.get("RANK") == "0" and multiprocessing.parent_process() is None
    if not _State.made and launched_rank_0:
        print(
            "epmoe run: the command built no MoE model in this process: nothing was made expert-parallel",
            file=sys.stderr,
        )
