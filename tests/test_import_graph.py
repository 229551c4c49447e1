"""The package's import graph (read from source): no cycles, no import from a layer to a higher one, no room
(folder) pointing up at another, and docs/architecture.md showing the layer table of ``tests/helpers/import_graph``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers import import_graph

ROOT = Path(__file__).resolve().parents[1]


def test_no_import_cycles():
    assert import_graph.cycles(import_graph.read_imports(ROOT)) == []


def test_no_import_points_up_the_layers():
    imports = import_graph.read_imports(ROOT)
    assert import_graph.back_edges(imports, include_type_only=True) == []


def test_no_room_points_up_at_another():
    assert import_graph.room_arrows_up(import_graph.read_imports(ROOT)) == []


def test_architecture_doc_shows_the_layer_table():
    assert import_graph.render_layers() in (ROOT / "docs" / "architecture.md").read_text()


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


def test_a_room_holding_two_layers_points_up(tmp_path, monkeypatch):
    # the planner's CLI (an entry point) beside the arithmetic the config imports: config's room points up at plan's
    package = tmp_path / "gtpo_megatron"
    for folder in ("plan", "config"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "plan" / "layout.py").write_text("")
    (package / "config" / "sections.py").write_text("from gtpo_megatron.plan import layout\n")
    (package / "plan" / "cli.py").write_text("from gtpo_megatron.config import sections\n")
    imports = import_graph.read_imports(tmp_path)
    *lower, (name, prefixes, external) = import_graph.LAYERS
    monkeypatch.setattr(import_graph, "LAYERS", [*lower, (name, (*prefixes, "gtpo_megatron.plan.cli"), external)])
    assert import_graph.back_edges(imports) == []
    assert import_graph.room_arrows_up(imports) == [("gtpo_megatron.config", "gtpo_megatron.plan")]


def test_config_reads_no_disk_and_imports_only_yaml_the_planners_arithmetic_and_the_choices():
    imports = import_graph.read_imports(ROOT)
    config = {name: found for name, found in imports.items() if name.startswith("gtpo_megatron.config")}
    external = {m.split(".")[0] for found in config.values() for m in found.external}
    assert external - {"yaml"} <= set(sys.stdlib_module_names)
    package = {m for found in config.values() for m in found.runtime | found.type_only}
    own = ("gtpo_megatron.config", "gtpo_megatron.plan", "gtpo_megatron.choices")
    assert {m for m in package if not m.startswith(own)} == set()
    assert not {m for m in package if m.startswith("gtpo_megatron.plan.") and "cli" in m}
