"""The house's shape, read from the source as a newcomer reads it (no processes, no torch): the packages in layers,
each importing only those below it (:data:`LAYERS`: type-checking and deferred imports included), no module
importing another that imports it back (a circle there is a circle for the reader), and torchft's private
attributes touched in one module only."""

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


def imported(node: ast.stmt, package: str, known: dict[str, Path]) -> set[str]:
    """The package's modules an ``import`` statement of a module of ``package`` names (none for another statement):
    a module itself, or the module a name is imported from."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    found = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
    return {m for m in found if m in known}


def package_name(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports at its top level (under ``if TYPE_CHECKING:`` too; not
    inside functions)."""
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
            else:
                found.update(imported(node, package_name(name, path), known))

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


LIGHTNING_PRIVATE = {"_batches_that_stepped", "_combined_loader", "_data_source", "_device_mesh", "_trainer",
                     "_current_fx_name", "_logger_connector", "_optimizer", "_on_before_batch_transfer",
                     "_apply_batch_transfer_handler"}
"""The private attributes of Lightning's objects that ddp_plugin uses (on objects other than its own ``self``)."""


def lightning_privates(path: Path) -> list[str]:
    """What ``path`` touches of Lightning's private names: names imported from a ``lightning`` module that start
    with ``_``, and :data:`LIGHTNING_PRIVATE` attributes read or set (``getattr`` by name included) on other
    objects than ``self``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning":
            found += [f"import {a.name}" for a in node.names if a.name.startswith("_")]
        elif (isinstance(node, ast.Attribute) and node.attr in LIGHTNING_PRIVATE
              and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
            found.append(f".{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in LIGHTNING_PRIVATE):
            found.append(f"{node.func.id} {node.args[1].value}")
    return found


def test_lightnings_private_names_are_used_in_its_adapter_only(tmp_path):
    adapter = PACKAGE / "runtime" / "lightning_adapter.py"
    users = {path.relative_to(ROOT).as_posix(): lightning_privates(path) for path in PACKAGE.rglob("*.py")}
    assert {name: found for name, found in users.items() if found} == {
        adapter.relative_to(ROOT).as_posix(): users[adapter.relative_to(ROOT).as_posix()]}
    sample = tmp_path / "sample.py"
    sample.write_text("from lightning.fabric.utilities.types import _PATH\n"
                      "def f(trainer, o):\n    trainer.fit_loop._combined_loader = None\n"
                      "    return getattr(o, '_optimizer', o), self._trainer\n")
    assert lightning_privates(sample) == ["import _PATH", "._combined_loader", "getattr _optimizer"]


def test_fault_tolerance_extends_other_packages_through_their_protocols_not_by_subclassing():
    """No class in ``fault_tolerance/`` subclasses a class another package of ddp_plugin defines, and no module of
    it touches a private name another package defines (an attribute set as ``self._x`` or a method ``_x`` there)
    on an object other than its own ``self``: it implements the protocols the plugins own (the reducers'
    ``CrossStage``, the sync's ``SyncTransport``) and the hook contract."""
    others_classes: set[str] = set()
    others_private: set[str] = set()
    for name, path in modules().items():
        if name.startswith(("ddp_plugin.fault_tolerance", "ddp_plugin.testing")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                others_classes.add(node.name)
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) and inner.name.startswith("_") \
                            and not inner.name.startswith("__"):
                        others_private.add(inner.name)
                    elif (isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name)
                          and inner.value.id == "self" and inner.attr.startswith("_") and not inner.attr.startswith("__")):
                        others_private.add(inner.attr)
    assert {"OuterSync", "HierarchicalReducer"} <= others_classes and {"_padded", "_topology"} <= others_private
    subclassing, touching = [], []
    for path in (PACKAGE / "fault_tolerance").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                subclassing += [f"{path.stem}.{node.name}({ast.unparse(b)})" for b in node.bases
                                if ast.unparse(b).split(".")[-1] in others_classes]
            elif (isinstance(node, ast.Attribute) and node.attr in others_private
                  and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                touching.append(f"{path.stem}: {ast.unparse(node)}")
    assert subclassing == []
    assert touching == []


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
    assembly hands its plugins to the session; the package's top knows the group launcher's process, which it keeps
    free of torch)."""
    import re

    known = modules()
    allowed = {"ddp_plugin", "ddp_plugin.strategy.config", "ddp_plugin.strategy.assembly",
               "ddp_plugin.strategy.environment", "ddp_plugin.strategy.hierarchical_zero"}
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


LAYERS = [
    ("ddp_plugin.hookspecs", "ddp_plugin.health"),
    ("ddp_plugin.runtime",),
    ("ddp_plugin.gradients",),
    ("ddp_plugin.codecs",),
    ("ddp_plugin.checkpoints",),
    ("ddp_plugin.parallel",),
    ("ddp_plugin.plugins",),
    ("ddp_plugin.zero",),
    ("ddp_plugin.sync",),
    ("ddp_plugin.fault_tolerance",),
    ("ddp_plugin.strategy",),
]
"""The packages bottom to top: a module imports from its own package and from packages of earlier rows only
(docs/design.md, "Where things live"). The contract and the failure diagnosis import none; the runtime (the
communicator, topology, streams, clocks, checks) is what every layer may use; the engine and the cost model; the
codecs; checkpoint files; model parallelism's mechanics; the plugins (reducers, ZeRO, sync modes); fault
tolerance, whose plugins extend those through the hook contract and the protocols the plugins own; and on top the
strategy with the assembly of a fit's plugins. The test helpers (``ddp_plugin.testing``) and the package's top
(``ddp_plugin``, its re-exports) sit above them all."""

ABOVE_ALL = ("ddp_plugin.testing", "ddp_plugin", *(f"ddp_plugin.{name}" for name in sorted(RELEASED_PATHS)))


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def every_import(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports anywhere: at the top, under ``if TYPE_CHECKING:`` and
    inside functions (an import deferred into a function is still a dependency a reader must know of)."""
    package = package_name(name, path)
    found = {m for node in ast.walk(ast.parse(path.read_text())) for m in imported(node, package, known)}
    return found - {name}


def layer_violations(graph: dict[str, set[str]], layers: list[tuple[str, ...]], above_all: tuple[str, ...]
                     ) -> list[str]:
    """Each import of a module from a package of the same or a later row than its own's (``a -> b``), a package
    in no row included."""
    row = {package: i for i, packages in enumerate(layers) for package in packages}
    top = len(layers)
    row.update({package: top for package in above_all})
    found = []
    for name, targets in sorted(graph.items()):
        mine = package_of(name) if name != "ddp_plugin" else "ddp_plugin"
        if mine not in row:
            found.append(f"{name}: its package {mine} is in no row of LAYERS")
            continue
        for target in sorted(targets):
            theirs = package_of(target)
            if theirs != mine and row.get(theirs, top + 1) >= row[mine] and mine not in above_all:
                found.append(f"{name} -> {target}")
    return found


def test_packages_import_only_the_layers_below_them():
    known = modules()
    graph = {name: every_import(name, path, known) for name, path in known.items()}
    assert "ddp_plugin.strategy.plugin_manager" in graph["ddp_plugin.strategy.session"]  # (the reading sees imports)
    assert layer_violations(graph, LAYERS, ABOVE_ALL) == []
    packages = {package_of(name) for name in known if name != "ddp_plugin"}
    assert packages == {p for row in LAYERS for p in row} | set(ABOVE_ALL) - {"ddp_plugin"}


def test_the_package_graph_has_no_cycle():
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        graph.setdefault(package_of(name), set()).update(
            package_of(m) for m in every_import(name, path, known) if package_of(m) != package_of(name))
    graph = {p: {q for q in targets if q in graph} for p, targets in graph.items()}
    assert circles(graph) == []


def test_the_layer_check_finds_an_upward_import():
    graph = {"ddp_plugin.runtime.comm": {"ddp_plugin.gradients.engine"}, "ddp_plugin.gradients.engine": set(),
             "ddp_plugin.sync.plugin": {"ddp_plugin.runtime.comm", "ddp_plugin.sync.parts"}}
    layers = [("ddp_plugin.runtime",), ("ddp_plugin.gradients",), ("ddp_plugin.sync",)]
    assert layer_violations(graph, layers, ()) == ["ddp_plugin.runtime.comm -> ddp_plugin.gradients.engine"]
