"""Runs the recipes of the README and docs/ on spawned ranks: the snippets are written, as they are in
the pages, to a module that the ranks import (see tests/project/test_readme.py)."""

import importlib
import sys

import torch


def run_recipes(rank, world, module_dir, module_name, names):
    """Call each recipe function ``name(rank, world)`` in turn; return their results by name (tensors
    as lists: a tensor would travel back through shared memory the exiting rank takes with it)."""
    sys.path.insert(0, module_dir)
    recipes = importlib.import_module(module_name)
    results = {name: getattr(recipes, name)(rank, world) for name in names}
    return {name: value.tolist() if isinstance(value, torch.Tensor) else value for name, value in results.items()}
