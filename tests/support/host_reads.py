"""Counting host reads: every call that hands a tensor's values to Python (tests only)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@contextmanager
def counting_host_reads():
    """Yield a list that records the name of every ``Tensor.tolist/item/cpu/...`` call made inside."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name, original):
        def read(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
