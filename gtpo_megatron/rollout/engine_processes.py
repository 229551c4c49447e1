"""An engine's processes as the operating system sees them: alive, stopped, killed (``psutil``; no vLLM import).

A vLLM engine runs in processes of its own (the engine core, and its workers under it). Fault tolerance
(``rollout/fault_tolerance.py``) probes them between the waits of a call (:func:`check_processes`) and kills a
failed engine's whole tree before it restarts (:func:`kill_processes`): a stopped (SIGSTOP) process ignores the
SIGTERM of a clean shutdown.
"""

from __future__ import annotations

import contextlib

import psutil

_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
_STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def _tree(pids: list[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants (those that still exist)."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            found += [root, *root.children(recursive=True)]
    return found


def check_processes(pids: list[int]) -> None:
    """Raise ``RuntimeError`` naming the first of ``pids`` that is gone, or of their tree that is stopped.

    A descendant that exited (a zombie not reaped yet) is no failure: engines start short-lived helpers.

    Raises:
        RuntimeError: an empty ``pids`` (the engine has no process left), a missing or zombie root, or a stopped
            process in the tree.
    """
    if not pids:
        raise RuntimeError("the engine has no process")
    for process in _tree(pids):
        try:
            status = process.status()
        except psutil.NoSuchProcess:
            status = psutil.STATUS_DEAD
        if status in _STOPPED or (status in _GONE and process.pid in pids):
            raise RuntimeError(f"engine process {process.pid} is {status}")
    for pid in pids:
        if not psutil.pid_exists(pid):
            raise RuntimeError(f"engine process {pid} is gone")


def kill_processes(pids: list[int]) -> None:
    """SIGKILL ``pids`` and their descendants (children first; processes already gone are skipped)."""
    for process in reversed(_tree(pids)):
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
