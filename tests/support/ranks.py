"""The suite's one way to start ranks: :func:`start_ranks` (also the ``ranks`` fixture of conftest.py).

:func:`epmoe.launch.run_ranks` on ranks forked from one server that imported epmoe once (the suite
sets ``EPMOE_START_METHOD=forkserver``; a test that needs a fresh interpreter passes
``start_method="spawn"``), each call bounded by a timeout. Multi-rank checks are batched: a module
puts many checks in one rank function and asks for its results from several tests with
``once=True``, which starts the ranks once per session for that function, world size and arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from epmoe.launch import run_ranks

DEFAULT_TIMEOUT_S = 300.0
_RUNS: dict[tuple, list[Any] | Exception] = {}  # once=True: (function, world, arguments) -> outcome


def start_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, once: bool = False, **options
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` new ranks of a fresh gloo group; its results by rank.
    ``once``: the first call's outcome for every later call with the same function, world and
    arguments (a run that raised raises the same error again, without running: each test that needs
    it reports it)."""
    key = (fn.__module__, fn.__qualname__, world, repr(args), repr(sorted(options.items())))
    if not once:
        return run_ranks(fn, world, *args, timeout=timeout, **options)
    if key not in _RUNS:
        try:
            _RUNS[key] = run_ranks(fn, world, *args, timeout=timeout, **options)
        except Exception as exc:  # noqa: BLE001 - kept, raised to every test that needs the run
            _RUNS[key] = exc
    if isinstance(_RUNS[key], Exception):
        raise _RUNS[key]
    return _RUNS[key]
