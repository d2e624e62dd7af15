"""What every test shares: the test folders on the import path, a fresh seed, and the one way to start ranks.

The tests sit in folders by floor or feature (``engine``: platform, grouped matmul and communication;
``ep``: the expert-parallel layer and model; ``models``: transformers' families; ``training``: the
lifecycle and launchers; ``project``: the repository's own promises: docs, style, benchmarks, CLI),
their shared helpers in ``support``. Every folder is on ``sys.path`` (a rank started by
:func:`ranks.start_ranks` imports its worker module by name, from whichever folder holds it).
"""

import os
import pathlib
import sys

import pytest
import torch

_HERE = pathlib.Path(__file__).resolve().parent
for _folder in sorted(p for p in _HERE.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
    sys.path.insert(0, str(_folder))
# ranks forked from one server that imported epmoe once, not a fresh interpreter per spawn (seconds
# each, over some seventy spawns); what needs a fresh process passes start_method="spawn"
os.environ.setdefault("EPMOE_START_METHOD", "forkserver")

from ranks import start_ranks  # noqa: E402 (the folders above make it importable)


@pytest.fixture(autouse=True)
def _seed_and_env(monkeypatch):
    torch.manual_seed(0)
    monkeypatch.delenv("EPMOE_GMM_BACKEND", raising=False)


@pytest.fixture(scope="session")
def ranks():
    """:func:`ranks.start_ranks`: ``ranks(fn, world, *args, timeout=..., once=False)``."""
    return start_ranks
