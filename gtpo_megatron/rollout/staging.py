"""The ``files`` weight sync's staging folders (``/dev/shm/gtpo-weights-<pid>-*``): they go with their run.

An engine's folder is named with its process's PID and locked by it (``flock`` on ``.owner``; the kernel drops the
lock when the process ends, however it ends); it is removed when the engine closes or the process exits. A process
killed before that (SIGKILL, a crash in C) leaves its folder behind; the next :func:`open_staging_dir` on the
machine removes every folder whose PID is not running and whose lock is free, so live runs' folders (of any PID
namespace: they hold their lock) are left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import weakref
from pathlib import Path

from gtpo_megatron.node_local import staging_root

PREFIX = "gtpo-weights-"
_LOCK = ".owner"


def open_staging_dir(owner: object, root: str | Path | None = None) -> tuple[Path, weakref.finalize]:
    """A new locked folder ``<root>/gtpo-weights-<pid>-*`` after sweeping those of dead owners under ``root``.

    Returns the folder and its remover (call it to remove the folder now; it also runs when ``owner`` is garbage
    collected and at interpreter exit). ``root``: default ``node_local.staging_root``.
    """
    root = Path(root or staging_root() or tempfile.gettempdir())
    sweep_staging_dirs(root)
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root))
    lock = os.open(path / _LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    return path, weakref.finalize(owner, _remove, path, lock)


def sweep_staging_dirs(root: str | Path) -> list[Path]:
    """Remove the staging folders under ``root`` whose owner process is gone; returns them."""
    swept = [path for path in Path(root).glob(f"{PREFIX}*") if path.is_dir() and not _owner_alive(path)]
    for path in swept:
        shutil.rmtree(path, ignore_errors=True)
    return swept


def _remove(path: Path, lock: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock)


def _owner_alive(path: Path) -> bool:
    """Whether the PID in the folder's name runs here, or a process (of any PID namespace) holds its lock.

    An older version's folder (no PID in its name) counts as alive.
    """
    pid = path.name.removeprefix(PREFIX).split("-")[0]
    if not pid.isdigit() or _pid_running(int(pid)):
        return True
    try:
        lock = os.open(path / _LOCK, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(lock)  # releases a lock just taken
    return False


def _pid_running(pid: int) -> bool:
    with contextlib.suppress(PermissionError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
    return True
