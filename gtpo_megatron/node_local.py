"""Folders each node writes for itself, never shared between nodes (torch-free; the run folder is ``run_dir``'s).

Built-in models: ``builtin_models.cache_dir``, built once per node under a file lock. Weight staging:
:func:`staging_root`. Unix sockets (vLLM's IPC, the checkpoint queue manager): :func:`socket_dir`, as a socket path
holds at most 107 bytes and a Slurm job's ``TMPDIR`` can leave too little room.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

MAX_SOCKET_PATH = 107  # bytes of sockaddr_un.sun_path before its terminating NUL (Linux)
SOCKET_NAME_ROOM = 48  # a socket's name under its folder: "/" + a uuid4 (vLLM) or "/pymp-*/listener-*" (Python)
SHORT_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm")


def staging_root() -> str | None:
    """Parent of the weight staging folder: ``$GTPO_STAGING_DIR`` (created), else ``/dev/shm`` when writable.

    None: neither, so the temporary folder (``tempfile``'s default) is used.
    """
    chosen = os.environ.get("GTPO_STAGING_DIR")
    if chosen:
        Path(chosen).mkdir(parents=True, exist_ok=True)
        return chosen
    return "/dev/shm" if _writable("/dev/shm") else None


def socket_dir(candidates: tuple[str, ...] | None = None) -> str:
    """A writable folder whose socket paths fit ``AF_UNIX``: the temporary folder if short enough, else ``/tmp``...

    ``candidates``: folders tried in order (default: ``tempfile.gettempdir()``, then :data:`SHORT_FOLDERS`).
    Raises RuntimeError naming TMPDIR and the fix when none is writable and short enough.
    """
    candidates = candidates or (tempfile.gettempdir(), *SHORT_FOLDERS)
    limit = MAX_SOCKET_PATH - SOCKET_NAME_ROOM
    for folder in candidates:
        if len(os.fsencode(folder)) <= limit and _writable(folder):
            return folder
    raise RuntimeError(
        f"no folder for unix sockets: TMPDIR={tempfile.gettempdir()!r} is longer than {limit} bytes (sockets under "
        f"it would exceed {MAX_SOCKET_PATH}) and none of {list(candidates[1:])} is writable; set TMPDIR to a "
        "shorter writable folder"
    )


def socket_path(prefix: str) -> str:
    """A fresh socket path ``<socket_dir()>/<prefix>-<12 hex digits>`` (nothing is created)."""
    return os.path.join(socket_dir(), f"{prefix}-{uuid.uuid4().hex[:12]}")


def _writable(folder: str) -> bool:
    return os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)
