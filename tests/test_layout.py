"""The house's shape, read from the source as a newcomer reads it (no processes, no torch): no module imports
another that imports it back (type-checking imports included: a circle there is a circle for the reader), and
torchft's private attributes are touched in one module only."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT

PACKAGE = ROOT / "ddp_plugin"
TORCHFT_PRIVATE = {"_client", "_quorum", "_quorum_id", "_server", "_init_sync", "_quorum_future"}
"""The private attributes of torchft's Manager, its client and its checkpoint transport that ddp_plugin uses."""


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (the hook contract as ``ddp_plugin.hookspecs``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in (ROOT / "hookspecs").glob("*.py"):
        found["ddp_plugin.hookspecs" + ("" if path.stem == "__init__" else f".{path.stem}")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports at its top level (under ``if TYPE_CHECKING:`` too; not
    inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in known)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    if f"{base}.{alias.name}" in known:
                        found.add(f"{base}.{alias.name}")
                    elif base in known:
                        found.add(base)

    visit(ast.parse(path.read_text()).body)
    found.discard(name)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_nothing_imports_in_a_circle():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert graph["ddp_plugin.parallel.pipeline"] >= {"ddp_plugin.parallel.ties"}  # (the reading sees imports)
    assert circles(graph) == []


def test_the_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_torchfts_private_attributes_are_used_in_its_adapter_only():
    adapter = PACKAGE / "fault_tolerance" / "torchft_adapter.py"
    users = {path.relative_to(ROOT).as_posix() for path in PACKAGE.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in TORCHFT_PRIVATE}
    assert users == {adapter.relative_to(ROOT).as_posix()}


MODULE_LINES = 400


def test_a_module_over_400_lines_says_why_at_its_top():
    """Over :data:`MODULE_LINES` lines, a module's docstring says why it stays one module ("(Over 400 lines: ...)",
    "(About 450 lines: ...)")."""
    import re

    def says_why(docstring: str) -> bool:
        return bool(re.search(r"\((?:[A-Za-z ]*)\d{3} lines\b[^)]*[:;]", docstring))

    assert says_why("Text.\n\n(Over 400 lines: the send and the apply read as one.)")
    assert not says_why("Text about 400 lines of code.")
    long = {name: says_why(ast.get_docstring(ast.parse(path.read_text())) or "")
            for name, path in modules().items() if path.read_text().count("\n") > MODULE_LINES}
    assert all(long.values()), [name for name, why in long.items() if not why]


def test_cutting_a_model_into_stages_is_entered_through_its_package_only():
    known = modules()
    inside = "ddp_plugin.parallel.stages."
    outside = {name: sorted(m for m in imports(name, path, known) if m.startswith(inside))
               for name, path in known.items() if not name.startswith(inside) and name != inside[:-1]}
    assert {name: found for name, found in outside.items() if found} == {}


def test_fault_tolerance_is_known_outside_its_package_by_its_plugins_only():
    """The fit's session, the plugin manager, the engine and the built-in plugins never name replica groups or
    torchft: fault tolerance is a set of plugins on the hook contract (its flag is read by the config, and the
    assembly hands its plugins to the session)."""
    import re

    known = modules()
    allowed = {"ddp_plugin.strategy.config", "ddp_plugin.strategy.assembly", "ddp_plugin.strategy.environment", "ddp_plugin.strategy.hierarchical_zero"}
    pattern = re.compile(r"replica group|ReplicaGroup|torchft|fault_tolerance\.", re.IGNORECASE)
    naming = sorted(name for name, path in known.items()
                    if not name.startswith(("ddp_plugin.fault_tolerance", "ddp_plugin.testing", "ddp_plugin.hookspecs"))
                    and name not in allowed and pattern.search(path.read_text()))
    assert naming == []
    importing = sorted(name for name, path in known.items() if not name.startswith("ddp_plugin.fault_tolerance")
                       and name not in allowed
                       and any(m.startswith("ddp_plugin.fault_tolerance") for m in imports(name, path, known)))
    assert importing == []


RELEASED_PATHS = {"sharded_checkpoint", "plugin_manager"}
"""Modules 0.1.0 documented at the package's top, kept there as re-exports of their new place."""


def test_the_package_top_holds_the_layers_folders():
    """The folders show the layers (docs/design.md): the Lightning side (``strategy``), the gradient path
    (``gradients`` and the plugin packages), ``checkpoints``, ``parallel``, ``fault_tolerance``, ``health``; at the
    top only the package's ``__init__`` and the re-exports of paths 0.1.0 documented, each a few lines."""
    modules_at_top = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules_at_top == RELEASED_PATHS
    for name in RELEASED_PATHS:
        tree = ast.parse((PACKAGE / f"{name}.py").read_text())
        assert all(isinstance(node, (ast.Expr, ast.ImportFrom, ast.Assign)) for node in tree.body), name


def runtime_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules ``path`` imports when it runs (top level, ``if TYPE_CHECKING:`` left out)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom) and inner.module and inner.level == 0:
                found.update(f"{inner.module}.{a.name}" if f"{inner.module}.{a.name}" in known else inner.module
                             for a in inner.names)
            elif isinstance(inner, ast.Import):
                found.update(a.name for a in inner.names)
    return {m for m in found if m in known}


def test_no_layer_below_the_strategy_imports_it_when_it_runs():
    """The Lightning side (``ddp_plugin.strategy``) sits on top: the gradient path, its plugins, checkpoints,
    parallelism, fault tolerance and health never import it when they run (types only)."""
    known = modules()
    upward = {name: sorted(m for m in runtime_imports(path, known) if m.startswith("ddp_plugin.strategy"))
              for name, path in known.items()
              if not name.startswith(("ddp_plugin.strategy", "ddp_plugin.testing")) and name != "ddp_plugin"}
    assert {name: found for name, found in upward.items() if found} == {}
