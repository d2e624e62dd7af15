import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# ranks forked from one server that imported epmoe once, not a fresh interpreter per spawn (seconds
# each, over some seventy spawns); what needs a fresh process passes start_method="spawn"
os.environ.setdefault("EPMOE_START_METHOD", "forkserver")


@pytest.fixture(autouse=True)
def _seed_and_env(monkeypatch):
    torch.manual_seed(0)
    monkeypatch.delenv("EPMOE_GMM_BACKEND", raising=False)
