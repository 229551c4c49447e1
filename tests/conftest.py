"""Shared pytest setup: importable ``tests.helpers``, deterministic seeds, GPU tests skipped without CUDA.

Markers (declared in ``pytest.ini``): ``distributed`` (spawns gloo processes), ``integration`` (real vLLM loop on
CPU), ``slow`` (excluded from the default suite with ``-m "not slow"``), ``gpu`` (needs CUDA; skipped here when
CUDA is absent).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)  # ``from tests.helpers import ...`` also inside spawned workers


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same RNG state."""
    random.seed(0)
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run tests/gpu/run_gpu_checks.sh on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in keywords`: that also matches tests/gpu/
            item.add_marker(skip_gpu)
