"""The package's import graph read from its source (``ast``; nothing is imported), and the layer order it must keep.

An edge ``a -> b`` is an ``import``/``from ... import`` of package module ``b`` anywhere in module ``a`` (module
level or lazily inside a function); ``from pkg import name`` points at ``pkg.name`` when that is a module, else at
``pkg``. Imports under ``if TYPE_CHECKING:`` are annotations only and are kept apart (``Imports.type_only``);
imports inside a function body are also recorded in ``Imports.deferred`` (they run only when the function does).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "gtpo_megatron"

# Lowest layer first: a module may import its own layer and the layers below it. Each layer: a name, the module
# prefixes it holds (the longest matching prefix decides) and the third-party imports it may make.
# docs/architecture.md shows this table as ``render_layers()`` prints it (tests/test_import_graph.py compares them).
LAYERS: list[tuple[str, tuple[str, ...], str]] = [
    ("closed choices", ("gtpo_megatron.choices",), "stdlib"),
    ("collectives", ("gtpo_megatron.parallel.collectives",), "torch, torch.distributed; no package module"),
    ("the per-row record", ("gtpo_megatron.batch",), "torch"),
    ("ops", ("gtpo_megatron.ops",), "torch; the log-prob op's TP all-reduces go through `parallel.collectives`"),
    (
        "torch-free helpers",
        (
            "gtpo_megatron.builtin_models",
            "gtpo_megatron.node_local",
            "gtpo_megatron.run_dir",
            "gtpo_megatron.preemption",
            "gtpo_megatron.plan",
        ),
        "stdlib (transformers lazily, to build a built-in)",
    ),
    ("parallel", ("gtpo_megatron.parallel",), "torch.distributed; megatron only in `groups.py`"),
    ("rewards", ("gtpo_megatron.rewards",), "math-verify, no torch"),
    ("config", ("gtpo_megatron.config",), "PyYAML"),
    ("data", ("gtpo_megatron.data",), "torch (no torch.distributed), tokenizer"),
    (
        "edges",
        ("gtpo_megatron.rollout", "gtpo_megatron.megatron_adapter", "gtpo_megatron.policy", "gtpo_megatron.logging"),
        "vllm (only `rollout/vllm_engine.py`, `vllm_start.py`, `vllm_generation.py`, `vllm_async_engine.py`, "
        "`vllm_lora.py`), megatron-core, transformers, wandb",
    ),
    ("algorithm", ("gtpo_megatron.algorithm",), ""),
    ("plugin API", ("gtpo_megatron.plugin",), ""),
    ("run state", ("gtpo_megatron.initial_entropy", "gtpo_megatron.resume"), ""),
    (
        "trainer",
        ("gtpo_megatron.step_metrics", "gtpo_megatron.trainer", "gtpo_megatron.build", "gtpo_megatron.build_rollout"),
        "",
    ),
    (
        "entry points",
        ("gtpo_megatron.train", "gtpo_megatron.evaluation", "gtpo_megatron.plan_cli", "gtpo_megatron"),
        "",
    ),
]


def render_layers() -> str:
    """``LAYERS`` as the markdown table docs/architecture.md shows (lowest first)."""
    rows = ["| layer | modules | third-party imports |", "|---|---|---|"]
    for index, (name, prefixes, external) in enumerate(LAYERS):
        modules = ", ".join(
            f"`{p.removeprefix(PACKAGE + '.')}`" if p != PACKAGE else "the package root" for p in prefixes
        )
        rows.append(f"| {index} {name} | {modules} | {external} |")
    return "\n".join(rows)


@dataclass
class Imports:
    """What one module imports: third-party/stdlib module names and package modules (runtime and type-only).

    ``deferred``: the names of ``external`` and ``runtime`` imported only inside function bodies.
    """

    external: set[str] = field(default_factory=set)
    runtime: set[str] = field(default_factory=set)
    type_only: set[str] = field(default_factory=set)
    deferred: set[str] = field(default_factory=set)


def package_modules(root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module under ``root/gtpo_megatron`` (packages by ``__init__``)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids.update(id(sub) for child in node.body for sub in ast.walk(child))
    return ids


def _function_body_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            ids.update(id(sub) for child in node.body for sub in ast.walk(child))
    return ids


def _targets(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parent = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(parent[: len(parent) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def read_imports(root: Path) -> dict[str, Imports]:
    """Every module's imports.

    Raises:
        AssertionError: a module imports a package module that does not exist (a stale name after a move).
    """
    modules = package_modules(root)
    out = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        type_only, in_functions = _type_checking_nodes(tree), _function_body_nodes(tree)
        found = Imports()
        for node in ast.walk(tree):
            for target in _targets(node, name, path.name == "__init__.py", modules):
                if id(node) in in_functions:
                    found.deferred.add(target)
                if target.split(".")[0] != PACKAGE:
                    found.external.add(target)
                    continue
                assert target in modules, f"{name} imports {target}, which does not exist"
                if target != name:
                    (found.type_only if id(node) in type_only else found.runtime).add(target)
        out[name] = found
    return out


def layer_of(module: str) -> int:
    """Index in ``LAYERS`` of ``module``.

    Raises:
        AssertionError: ``module`` belongs to no layer (a new top-level module: add it to ``LAYERS``).
    """
    best, best_len = None, -1
    for index, (_, prefixes, _) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module == prefix or (prefix != PACKAGE and module.startswith(prefix + "."))
            if inside and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} belongs to no layer; add it to LAYERS in tests/helpers/import_graph.py"
    return best


def edges(imports: dict[str, Imports]) -> set[tuple[str, str]]:
    """Runtime edges ``(importer, imported)`` between package modules."""
    return {(a, b) for a, found in imports.items() for b in found.runtime}


def back_edges(imports: dict[str, Imports], *, include_type_only: bool = False) -> list[tuple[str, str]]:
    """Edges that point from a layer to a higher one."""
    pairs = edges(imports)
    if include_type_only:
        pairs |= {(a, b) for a, found in imports.items() for b in found.type_only}
    return sorted((a, b) for a, b in pairs if layer_of(b) > layer_of(a))


def room_of(module: str) -> str:
    """The room (folder, or top-level module) that holds ``module``; a layer made of one module is a room of its own."""
    for _, prefixes, _ in LAYERS:
        if prefixes == (module,) and module.count(".") > 1:
            return module
    parts = module.split(".")
    return ".".join(parts[:2])


def rooms(modules) -> dict[str, int]:
    """``{room: layer}``: a room is as high as the highest module it holds."""
    out: dict[str, int] = {}
    for module in modules:
        room = room_of(module)
        out[room] = max(out.get(room, -1), layer_of(module))
    return out


def room_arrows_up(imports: dict[str, Imports]) -> list[tuple[str, str]]:
    """Room-level arrows ``(importer's room, imported room)`` that point to a higher room (type-only ones included).

    A room that holds modules of two layers (the CLI beside the arithmetic it plans with) makes every room that
    imports the lower part point up at it.
    """
    layer = rooms(imports)
    pairs = {(room_of(a), room_of(b)) for a, found in imports.items() for b in found.runtime | found.type_only}
    return sorted((a, b) for a, b in pairs if a != b and layer[b] > layer[a])


def cycles(imports: dict[str, Imports]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph = {name: sorted(found.runtime) for name, found in imports.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def closure(imports: dict[str, Imports], start: str) -> set[str]:
    """``start`` and every package module it imports at runtime, transitively (``__init__`` of parents included).

    A module's lazy (function-body) imports count, since its functions may be called; a parent package contributes
    its module-level imports only, which are all that importing a submodule runs (the package root, for example,
    imports the plugin lazily in its ``__getattr__``).
    """
    full, parent_only, todo = set(), set(), [(start, False)]
    while todo:
        name, as_parent = todo.pop()
        if name in full or (as_parent and name in parent_only):
            continue
        (parent_only if as_parent else full).add(name)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += [(p, True) for p in parents if p in imports]
        followed = imports[name].runtime - imports[name].deferred if as_parent else imports[name].runtime
        todo += [(m, False) for m in sorted(followed)]
    return full | parent_only
