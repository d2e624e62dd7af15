"""Run a function on N local ranks of a fresh process group, with bounded time and honest errors.

Used by ``epmoe demo`` and by the multi-rank tests. Each rank is a spawned process that joins a
process group over 127.0.0.1 on a free port; the first rank to fail ends every other rank, and its
traceback is raised in the parent as :class:`RankError`. Nothing waits forever: collectives carry
the group's timeout and the parent gives up after ``timeout`` seconds.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import queue
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


def _worker(fn, rank, world_size, port, backend, timeout, threads, results, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    try:
        if threads:
            torch.set_num_threads(threads)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
        result = fn(rank, world_size, *args)
        pickle.dumps(result)  # an unpicklable result would be dropped by the queue's feeder thread
        results.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            gc.collect()  # DDP reducers in reference cycles must go before their process group does
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    threads_per_rank: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results by rank.

    ``fn`` must be importable (module level). ``threads_per_rank`` defaults to an even share of the
    machine's cores. Raises :class:`RankError` with the first failing rank's traceback, or
    ``TimeoutError`` after ``timeout`` seconds; either way every rank is stopped.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_ranks(world_size): expected a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"run_ranks(timeout): expected a positive number of seconds, got {timeout!r}")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, backend, timeout, threads, results, args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    raise RankError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                continue
            if not ok:
                raise RankError(f"rank {rank} failed:\n{value}")
            outputs[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(outputs) == world_size else 0.1)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    return [outputs[rank] for rank in range(world_size)]
