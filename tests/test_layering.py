"""The package's layers import one way: models (loading files, picking a backend) sit above
the backends, which never import them, so neither side can import the other in a circle; and
no module of smcspec reaches itself through its imports (lazy ones inside functions
included; imports for type checking only are not imports at run time)."""

from __future__ import annotations

import ast
from pathlib import Path

import smcspec.backends


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names (lazy ones too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_backends_never_import_the_model_loaders():
    root = Path(smcspec.backends.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 5
    for path in files:
        bad = {n for n in imported_modules(path) if n.startswith("smcspec.models")}
        assert not bad, f"{path.relative_to(root)} imports {sorted(bad)}"


def test_loaded_model_is_one_class_for_both_layers():
    from smcspec.backends.base import LoadedModel
    from smcspec.models import LoadedModel as FromModels

    assert FromModels is LoadedModel


def _runtime_imports(path: Path, module: str, is_package: bool) -> set[str]:
    """Absolute names of what ``path`` imports, lazy imports included and ``if
    TYPE_CHECKING:`` blocks left out; relative imports resolved against ``module``."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: None if is_package else -1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    """smcspec module -> the smcspec modules it imports (a name imported from a module
    counts as that module)."""
    root = Path(smcspec.backends.__file__).parents[1]
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for n in _runtime_imports(path, name, path.name == "__init__.py"):
            while n and n not in modules:
                n = n.rpartition(".")[0]
            if n and n != name:
                deps.add(n)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    assert len(graph) > 50 and "smcspec.backends.llamacpp.model" in graph
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    """The check above can fail: a planted two-module and three-module cycle are found,
    and a chain is not a cycle."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert cycles(graph) == [["a", "b"], ["c", "d", "e"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
