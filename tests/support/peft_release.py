"""LoRA on expert-parallel packed experts under the peft a test environment holds.

peft >= 0.21 sizes the factors of a partitioned parameter from the whole shape epmoe marks on it; older
peft (0.18.1, what LLaMA-Factory pins beside transformers 5.6) sizes them from the rank's shard, which
epmoe refuses by name at the first forward, saying to add the adapter inside
``epmoe.ep.lora.whole_experts_for_peft(model)``. Tests that add such adapters do what that message says
where the peft installed needs it, so the same cases run in both environments."""

import contextlib
import importlib.metadata

from packaging.version import Version

from epmoe.ep.lora import whole_experts_for_peft

READS_WHOLE_SHAPE = Version(importlib.metadata.version("peft")) >= Version("0.21")


def expert_lora(model):
    """The context in which to add an adapter to ``model``'s EP experts under the installed peft."""
    return contextlib.nullcontext() if READS_WHOLE_SHAPE else whole_experts_for_peft(model)
