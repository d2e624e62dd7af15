"""An axolotl plugin of tests/training/test_axolotl.py's (``plugins: [axolotl_cpu_ranks.CpuRanks]``): DDP over
CPU ranks. axolotl 0.19 has no CPU setting for a multi-process run: it loads each rank's model on the device
of its ``LOCAL_RANK`` (``device_map={"": LOCAL_RANK}``, an accelerator) and starts accelerate's state
without ``cpu``, resetting it when its Trainer builds the accelerator (each rank would then train alone).
It also seeds torch before the LoRA factors are drawn (axolotl's Trainer seeds only after: two runs would
start from different adapters). Imported in the ranks only, in .venv-axolotl."""

import os

import torch
from accelerate import PartialState
from axolotl.integrations.base import BasePlugin
from axolotl.loaders.model import ModelLoader


class CpuRanks(BasePlugin):
    def register(self, cfg):
        os.environ["ACCELERATE_USE_CPU"] = "true"  # the Trainer's accelerator: MULTI_CPU (gloo), DDP
        PartialState(cpu=True)  # and the state axolotl starts before it (its barriers), the same
        set_device_map = ModelLoader._set_device_map_config

        def on_cpu(loader):
            set_device_map(loader)
            loader.model_kwargs["device_map"] = "cpu"

        ModelLoader._set_device_map_config = on_cpu

    def pre_lora_load(self, cfg, model):
        torch.manual_seed(cfg.seed)  # one LoRA initialisation for every run of the test
