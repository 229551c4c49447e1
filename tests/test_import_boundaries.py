"""Light modules import with ``megatron`` and ``vllm`` blocked (STYLE section 2 dependency direction).

Runs in a fresh interpreter so the rest of the suite (which may import megatron) cannot mask a violation.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LIGHT_MODULES = [
    "gtpo_megatron", "gtpo_megatron.ops", "gtpo_megatron.parallel", "gtpo_megatron.rollout.types",
    "gtpo_megatron.builtin_models", "gtpo_megatron.config", "gtpo_megatron.trainer", "gtpo_megatron.train",
    "gtpo_megatron.build", "gtpo_megatron.algorithm", "gtpo_megatron.rollout.batch", "gtpo_megatron.logging", "gtpo_megatron.rollout.collector",
    "gtpo_megatron.rewards", "gtpo_megatron.data", "gtpo_megatron.plan.cli", "gtpo_megatron.evaluation.metrics",
]

_PROBE = """
import importlib, sys
for blocked in ("megatron", "megatron.core", "vllm"):
    sys.modules[blocked] = None  # any import of these now raises ImportError
for module in {modules!r}:
    try:
        importlib.import_module(module)
    except ImportError as err:
        sys.exit(f"importing {{module}} needs megatron/vllm: {{err}}")
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("megatron", "vllm") and sys.modules[m] is not None)
    assert not leaked, (module, leaked)
"""


def _probe(modules: list[str]) -> subprocess.CompletedProcess:
    """Import ``modules`` in order in one fresh interpreter with megatron and vllm blocked."""
    return subprocess.run([sys.executable, "-c", _PROBE.format(modules=modules)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=180)


def test_light_modules_import_without_megatron_or_vllm():
    result = _probe(LIGHT_MODULES)
    assert result.returncode == 0, result.stderr[-2000:]


def test_probe_detects_a_violation():
    result = _probe(["gtpo_megatron.ops", "megatron.core"])
    assert result.returncode != 0 and "importing megatron.core needs megatron/vllm" in result.stderr
