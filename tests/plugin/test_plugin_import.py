"""The plugin surface imports light: ``import gtpo_megatron.plugin`` loads no megatron or vllm module (measured with
``python -X importtime``, as the issue's acceptance asks), the package root loads not even torch, and the root
re-exports exactly ``plugin.__all__``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gtpo_megatron
from gtpo_megatron import plugin

REPO = Path(__file__).resolve().parents[2]


def _imported_modules(statement: str) -> set[str]:
    """Top-level names of every module ``python -X importtime -c statement`` imports (fresh interpreter)."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:") and "|" in line]
    assert len(lines) > 10, result.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in lines[1:]}  # lines[0] is the header


def test_plugin_imports_neither_megatron_nor_vllm():
    modules = _imported_modules("import gtpo_megatron.plugin")
    assert "torch" in modules and "gtpo_megatron" in modules  # the probe sees real imports
    assert not modules & {"megatron", "vllm", "transformer_engine"}, sorted(modules & {"megatron", "vllm"})


def test_root_and_light_subpackages_import_no_torch():
    for statement in ("import gtpo_megatron", "import gtpo_megatron.rewards.registry"):
        modules = _imported_modules(statement)
        assert not modules & {"torch", "megatron", "vllm"}, (statement, sorted(modules & {"torch", "megatron"}))


def test_root_reexports_exactly_the_plugin_api():
    assert gtpo_megatron._PLUGIN_NAMES == set(plugin.__all__)
    for name in plugin.__all__:
        assert getattr(gtpo_megatron, name) is getattr(plugin, name)
    assert set(plugin.__all__) <= set(dir(gtpo_megatron))
    try:
        gtpo_megatron.not_a_name  # noqa: B018
    except AttributeError as err:
        assert "not_a_name" in str(err)
    else:
        raise AssertionError("unknown names must raise AttributeError")
