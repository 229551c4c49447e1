"""Layering rules of STYLE sections 2 and 4 for the Megatron side of the package (source scans, one subprocess)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gtpo_megatron"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_only_groups_module_touches_parallel_state():
    offenders = [
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
        if path != PACKAGE / "parallel" / "groups.py" and any("parallel_state" in name or name.endswith(".mpu")
                                            for name in _imports(path))
    ]
    assert offenders == [], f"import megatron.core.parallel_state only in parallel/groups.py: {offenders}"


def test_package_entry_points_do_not_import_megatron():
    code = (
        "import sys; import gtpo_megatron.megatron_adapter, gtpo_megatron.megatron_adapter.hf_stream, "
        "gtpo_megatron.parallel.groups, gtpo_megatron.megatron_adapter.checkpoint; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout
