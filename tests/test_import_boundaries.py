"""Light modules import with ``megatron`` and ``vllm`` blocked (STYLE section 2 dependency direction).

Runs in a fresh interpreter so the rest of the suite (which may import megatron) cannot mask a violation.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LIGHT_MODULES = ["gtpo_megatron", "gtpo_megatron.ops", "gtpo_megatron.parallel", "gtpo_megatron.rollout.types",
                 "gtpo_megatron.assets"]

_PROBE = """
import sys
for blocked in ("megatron", "megatron.core", "vllm"):
    sys.modules[blocked] = None  # any import of these now raises ImportError
import importlib
importlib.import_module({module!r})
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("megatron", "vllm") and sys.modules[m] is not None)
assert not leaked, leaked
"""


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_imports_without_megatron_or_vllm(module):
    result = subprocess.run([sys.executable, "-c", _PROBE.format(module=module)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"importing {module} pulled in megatron/vllm:\n{result.stderr[-2000:]}"


def test_probe_detects_a_violation():
    result = subprocess.run([sys.executable, "-c", _PROBE.format(module="megatron.core")], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and ("ImportError" in result.stderr or "ModuleNotFoundError" in result.stderr)
