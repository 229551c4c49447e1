"""The package's import graph (read from source): no cycles, and no import from a layer to a higher one.

The layer order is ``tests/helpers/import_graph.LAYERS`` (and ``docs/architecture.md``): ops < torch-free helpers
(builtin_models, run_dir, the planner's arithmetic) < parallel < rewards < config < data < rollout, megatron_adapter,
the policy contract, logging < algorithm < plugin < trainer, build < entry points (train, evaluation, plan.cli,
the package root).
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers import import_graph

ROOT = Path(__file__).resolve().parents[1]


def test_no_import_cycles():
    assert import_graph.cycles(import_graph.read_imports(ROOT)) == []


def test_no_import_points_up_the_layers():
    imports = import_graph.read_imports(ROOT)
    assert import_graph.back_edges(imports, include_type_only=True) == []


def test_every_module_has_a_layer():
    for module in import_graph.package_modules(ROOT):
        import_graph.layer_of(module)  # raises for a module no layer claims


def test_the_checks_can_fail(tmp_path):
    package = tmp_path / "gtpo_megatron"
    (package / "ops").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "trainer.py").write_text("from gtpo_megatron.ops import losses\n")
    (package / "ops" / "__init__.py").write_text("")
    (package / "ops" / "losses.py").write_text("def f():\n    from gtpo_megatron import trainer\n")
    imports = import_graph.read_imports(tmp_path)
    assert import_graph.cycles(imports) == [["gtpo_megatron.ops.losses", "gtpo_megatron.trainer"]]
    assert import_graph.back_edges(imports) == [("gtpo_megatron.ops.losses", "gtpo_megatron.trainer")]


def test_parents_contribute_their_module_level_imports_only(tmp_path):
    package = tmp_path / "gtpo_megatron"
    (package / "rewards").mkdir(parents=True)
    (package / "__init__.py").write_text("def __getattr__(name):\n    from gtpo_megatron import plugin\n")
    (package / "plugin.py").write_text("import torch\n")
    (package / "rewards" / "__init__.py").write_text("")
    (package / "rewards" / "pool.py").write_text("def f():\n    from gtpo_megatron import plugin\n")
    imports = import_graph.read_imports(tmp_path)
    assert imports["gtpo_megatron"].deferred == {"gtpo_megatron.plugin"}
    # the root's lazy import does not run when a submodule is imported; the module's own lazy import may
    assert import_graph.closure(imports, "gtpo_megatron.rewards") == {"gtpo_megatron", "gtpo_megatron.rewards"}
    assert "gtpo_megatron.plugin" in import_graph.closure(imports, "gtpo_megatron.rewards.pool")
