"""Layering rules (docs/architecture.md) that a source scan can check (no module is imported).

* only ``parallel/groups.py`` reads Megatron's ``parallel_state`` (or ``mpu``);
* only the engine modules ``rollout/vllm_engine.py``, ``vllm_start.py``, ``vllm_generation.py``,
  ``vllm_async_engine.py`` and ``vllm_lora.py`` import vllm;
* ``ops`` imports torch and the standard library only, and no other package module than the collectives (the
  log-prob op's TP all-reduces); ``parallel/collectives.py`` imports no package module at all;
* ``rewards`` needs no torch at all, ``data`` no torch.distributed, megatron or vllm, transitively through the package
  modules they import.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.helpers import import_graph

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gtpo_megatron"


def _imports(path: Path) -> set[str]:
    """Every imported name, ``module.name`` for ``from module import name``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _offenders(rule, allowed: set[Path]) -> list[str]:
    return sorted(
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p not in allowed and any(rule(name) for name in _imports(p))
    )


def test_only_groups_module_touches_parallel_state():
    offenders = _offenders(lambda n: "parallel_state" in n or n.endswith(".mpu"), {PACKAGE / "parallel" / "groups.py"})
    assert offenders == [], f"import megatron.core.parallel_state only in parallel/groups.py: {offenders}"


def test_only_the_vllm_engines_import_vllm():
    engines = {
        PACKAGE / "rollout" / name
        for name in ("vllm_engine.py", "vllm_start.py", "vllm_generation.py", "vllm_async_engine.py", "vllm_lora.py")
    }
    offenders = _offenders(lambda n: n.split(".")[0] == "vllm", engines)
    assert offenders == [], f"import vllm only in {sorted(p.name for p in engines)}: {offenders}"


def test_ops_is_torch_math_only():
    imports = import_graph.read_imports(ROOT)
    collectives = "gtpo_megatron.parallel.collectives"
    for module, found in imports.items():
        if module.split(".")[:2] != ["gtpo_megatron", "ops"] and module != collectives:
            continue
        third_party = {n for n in found.external if n.split(".")[0] not in sys.stdlib_module_names}
        assert third_party <= {"torch", "torch.distributed"}, (module, third_party)
        # ops reads the per-row record (gtpo_megatron.batch: a dataclass of tensors, torch only) and the closed
        # choices' names (gtpo_megatron.choices: stdlib only)
        allowed = ("gtpo_megatron.ops", "gtpo_megatron.batch", "gtpo_megatron.choices", collectives)
        allowed = allowed if module != collectives else ()
        outside = {n for n in found.runtime | found.type_only if not n.startswith(allowed)}
        assert outside == set(), (module, outside)


def _heavy(found: import_graph.Imports, banned: tuple[str, ...]) -> set[str]:
    return {n for n in found.external if any(n == b or n.startswith(b + ".") for b in banned)}


def test_rewards_and_data_stay_light():
    imports = import_graph.read_imports(ROOT)
    for package, banned in (
        ("gtpo_megatron.rewards", ("torch", "megatron", "vllm")),
        ("gtpo_megatron.data", ("torch.distributed", "megatron", "vllm")),
    ):
        for module in (m for m in imports if m == package or m.startswith(package + ".")):
            heavy = {(m, n) for m in import_graph.closure(imports, module) for n in _heavy(imports[m], banned)}
            assert heavy == set(), f"{module} reaches {sorted(heavy)} through its imports"
