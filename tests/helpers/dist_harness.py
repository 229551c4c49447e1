"""Run a function in N spawned CPU processes joined by a gloo process group.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes with ``torch.multiprocessing.spawn``,
initialises ``torch.distributed`` with the gloo backend through a TCP store the caller holds and calls
``fn(rank, world_size, *args)`` in each. ``fn`` must be a module-level (picklable) function. Any exception in a
worker is re-raised in the caller as ``RuntimeError`` carrying the worker's rank and full traceback.
Each spawn costs a few seconds (imports): run several checks inside one ``fn``. The caller's store listens on a
port the OS picks as it binds (port 0), so concurrent runs cannot race for one (a port found free beforehand can be
taken before the workers bind it: EADDRINUSE).

A worker whose ``fn`` returned destroys its group, runs the ``atexit`` hooks (multiprocessing's among them: it
shuts down the managers and daemonic children the worker started, such as the forked server of the checkpoint's
write queue) and leaves with ``os._exit(0)``. The interpreter's own finalisation can abort in gloo's teardown
(``terminate called without an active exception``, SIGABRT; the class of fault pytorch/pytorch#179291 describes)
after every check has passed, which read as a failed test. The hooks must run first: a process the worker forked
inherits the pipe ``mp.spawn`` waits on, so one left running keeps the caller waiting for ever.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_TIMEOUT = timedelta(seconds=120)


class _WorkerError(Exception):
    """Carries a worker's formatted traceback across the process boundary."""


def _entry(rank: int, fn, world_size: int, port: int, threads: int, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=_TIMEOUT)
    dist.barrier()  # a rank's init can end before its peers' handshakes do: none leaves before every mesh is up
    try:
        fn(rank, world_size, *args)
    except BaseException as exc:  # re-raised with the traceback text, which pickling would otherwise drop
        dist.destroy_process_group()
        raise _WorkerError(f"rank {rank} failed:\n{traceback.format_exc()}") from exc
    dist.destroy_process_group()
    atexit._run_exitfuncs()  # what a normal exit runs before finalisation; it stops the processes the worker started
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args, threads_per_rank: int = 1) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise RuntimeError if any rank fails.

    Args:
        fn: module-level function (picklable); its return value is ignored, so it asserts inside.
        world_size: number of processes.
        *args: picklable extra arguments.
        threads_per_rank: torch intra-op threads per process (1 keeps a 2-core machine responsive).

    Raises:
        RuntimeError: with the failing rank's traceback.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=_TIMEOUT, wait_for_workers=False)
    try:
        mp.spawn(_entry, args=(fn, world_size, store.port, threads_per_rank, args), nprocs=world_size, join=True)
    except mp.ProcessRaisedException as exc:
        raise RuntimeError(f"distributed test failed:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise RuntimeError(f"a distributed worker died without a Python exception: {exc}") from None
