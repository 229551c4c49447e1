"""Every package module imports with ``megatron`` and ``vllm`` blocked (docs/architecture.md: imports point down).

Heavy imports stay at the edges: the modules that use Megatron or vLLM import them inside functions, so the
plugin-facing package root, the config, the planner, the trainer and even the adapter modules load without them.
Runs in a fresh interpreter so the rest of the suite (which may import megatron) cannot mask a violation.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.import_graph import package_modules

REPO_ROOT = Path(__file__).resolve().parents[1]

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
    return subprocess.run(
        [sys.executable, "-c", _PROBE.format(modules=modules)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_module_imports_without_megatron_or_vllm():
    modules = sorted(package_modules(REPO_ROOT))
    assert "gtpo_megatron" in modules and len(modules) > 50
    result = _probe(modules)
    assert result.returncode == 0, result.stderr[-2000:]


def test_probe_detects_a_violation():
    result = _probe(["gtpo_megatron.ops", "megatron.core"])
    assert result.returncode != 0 and "importing megatron.core needs megatron/vllm" in result.stderr
