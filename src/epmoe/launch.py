"""Run a function on N local ranks of a fresh process group, with bounded time and honest errors.

Used by ``epmoe demo`` and by the multi-rank tests. Each rank is a new process (spawned, or forked
from a server that imported epmoe once: :data:`START_METHODS`) that joins a process group over
127.0.0.1 on a free port; the first rank to fail ends every other rank, and its traceback is raised
in the parent as :class:`RankError`. A rank that dies without a word (killed
by a signal, ``os._exit``) is the one blamed, not the survivors whose collectives then fail
("Connection reset by peer"). Nothing waits forever: collectives carry the group's timeout and the
parent gives up after ``timeout`` seconds.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank raised; the message carries its rank and traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# How ranks start. "spawn": a fresh interpreter each, which imports torch, transformers and epmoe
# again (seconds per rank). "forkserver": forked from one server process started at the first such
# call with epmoe imported, kept for this process's lifetime; a rank gets the caller's environment
# variables as they are at the call, but what a process reads only when it starts (glibc's MALLOC_*
# variables, OpenMP's) it has from when the server started. EPMOE_START_METHOD sets the default.
START_METHODS = ("spawn", "forkserver")
FORKSERVER_PRELOAD = ["epmoe"]


def _worker(fn, rank, world_size, port, backend, timeout, threads, results, args, env) -> None:
    if env is not None:  # forked from the server: the caller's environment, not the server's
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    try:
        if threads:
            torch.set_num_threads(threads)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        pickle.dumps(result)  # an unpicklable result would be dropped by the queue's feeder thread
        results.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            gc.collect()  # DDP reducers in reference cycles must go before their process group does
            dist.destroy_process_group()


# After a rank fails, how long to keep listening: for a rank that died silently (the usual cause of
# a peer's "Connection reset by peer"), and for the peers' own errors once a rank died.
FAILURE_GRACE_S = 3.0
DEATH_GRACE_S = 10.0
EXIT_GRACE_S = 1.0  # a rank that exited with code 0: how long its result may still be on the way


def _report(deaths: dict[int, int], failures: dict[int, str]) -> str:
    """The dead ranks first (the cause), then the first traceback (what a survivor saw)."""
    lines = [_died(rank, code) for rank, code in deaths.items()]
    if failures:
        rank, trace = next(iter(failures.items()))
        others = sorted(set(failures) - {rank})
        also = f" (ranks {others} failed too)" if others else ""
        lines.append(f"{'then ' if deaths else ''}rank {rank} failed{also}:\n{trace}")
    return "; ".join(lines)


def _died(rank: int, exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"rank {rank} died, killed by {name} (exit code {exitcode})"
    return f"rank {rank} died with exit code {exitcode} without reporting an error"


def _start_ranks(
    fn: Callable[..., Any], world_size: int, args: tuple, backend: str, timeout: float, threads: int, start_method: str
) -> tuple[list, Any]:
    """``(processes, results queue)``: ``world_size`` ranks running :func:`_worker` on a free port."""
    ctx = mp.get_context(start_method)
    env = None
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        env = dict(os.environ)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            daemon=True,
            args=(fn, rank, world_size, port, backend, timeout, threads, results, args, env),
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    return procs, results


def _note_deaths(
    procs: list, reported: set[int], deaths: dict[int, int], exited_quietly: dict[int, float], now: float
) -> bool:
    """Add to ``deaths`` (rank -> exit code) the ranks that exited without reporting: a non-zero exit
    code at once, exit code 0 once what it sent last had time to arrive (``exited_quietly``: rank ->
    when it was first seen exited). Whether any rank was added."""
    added = False
    for r, proc in enumerate(procs):
        if r in reported or r in deaths or proc.exitcode is None:
            continue
        quiet_since = exited_quietly.setdefault(r, now)
        if proc.exitcode != 0 or now - quiet_since > EXIT_GRACE_S:
            deaths[r] = proc.exitcode
            added = True
    return added


def _collect(procs: list, results: Any, outputs: dict[int, Any], timeout: float) -> None:
    """Fill ``outputs`` (rank -> result) from the ranks' queue until every rank reported; raise
    :class:`RankError` once a rank failed or died (after a grace for the others' reports), or
    ``TimeoutError`` after ``timeout`` seconds."""
    world_size = len(procs)
    failures: dict[int, str] = {}  # rank -> traceback, in the order they arrived
    deaths: dict[int, int] = {}  # rank -> exit code, for ranks that exited without reporting
    exited_quietly: dict[int, float] = {}  # rank -> when it was seen exited with code 0, no result yet
    deadline = time.monotonic() + timeout
    trouble_since = None
    while len(outputs) + len(failures) + len(deaths) < world_size:
        now = time.monotonic()
        if trouble_since is not None and now - trouble_since > (DEATH_GRACE_S if deaths else FAILURE_GRACE_S):
            break  # the others are stuck in collectives with the failed rank: stop waiting for them
        if now >= deadline:
            if trouble_since is not None:
                break
            missing = sorted(set(range(world_size)) - set(outputs))
            raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s")
        try:
            rank, ok, value = results.get(timeout=0.2 if trouble_since is not None else min(deadline - now, 1.0))
        except queue.Empty:
            if _note_deaths(procs, {*outputs, *failures}, deaths, exited_quietly, now):
                trouble_since = trouble_since or time.monotonic()
            continue
        if ok:
            outputs[rank] = value
        else:
            failures[rank] = value
            trouble_since = trouble_since or time.monotonic()
    if deaths or failures:
        raise RankError(_report(deaths, failures))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    threads_per_rank: int | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return results by rank.

    ``fn`` must be importable (module level). ``threads_per_rank`` defaults to an even share of the
    machine's cores. ``start_method`` (one of :data:`START_METHODS`; default ``EPMOE_START_METHOD``,
    else ``"spawn"``): ``"forkserver"`` saves each rank the imports, for callers that start ranks
    many times; a measurement of what a fresh process holds needs ``"spawn"``. Raises
    :class:`RankError` naming the ranks that died without a word (signal or exit code) and the first
    failing rank's traceback, or ``TimeoutError`` after ``timeout`` seconds; either way every rank
    is stopped.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_ranks(world_size): expected a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"run_ranks(timeout): expected a positive number of seconds, got {timeout!r}")
    start_method = start_method or os.environ.get("EPMOE_START_METHOD") or "spawn"
    if start_method not in START_METHODS:
        raise ValueError(
            f"run_ranks(start_method) (or EPMOE_START_METHOD): expected one of {START_METHODS}, got {start_method!r}"
        )
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    procs, results = _start_ranks(fn, world_size, args, backend, timeout, threads, start_method)
    outputs: dict[int, Any] = {}
    try:
        _collect(procs, results, outputs, timeout)
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(outputs) == world_size else 0.1)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    return [outputs[rank] for rank in range(world_size)]
