"""The package's layers import one way. :data:`LAYERS` lists them, lowest first, and every
module of smcspec lies in exactly one; no module imports one of a higher layer (lazy imports
inside functions and imports for type checking included), and ``docs/architecture.md`` draws
the same layers. Inside that order, models (loading files, picking a backend) sit above the
backends, which never import them; and no module of smcspec reaches itself through its
imports (lazy ones inside functions included; imports for type checking only are not imports
at run time)."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

import smcspec.backends

# The layers, lowest first: a module imports only modules of its own layer and of the layers
# below it. "name/" is a package with every module in it (new ones included), "name.py" one
# module, "__init__.py" the package smcspec itself. docs/architecture.md draws them, one line
# a layer, highest first.
LAYERS: list[tuple[str, ...]] = [
    ("errors.py", "input_files.py"),
    ("backends/",),
    ("models/",),
    ("sampling/", "potentials.py", "aggregate.py", "sandbox.py", "code_extraction.py"),
    ("config.py", "tool_calls/", "rewards/"),
    ("decoding/", "chat.py"),
    ("engine.py", "scheduler.py", "chunked_prefill.py", "metrics.py"),
    ("cli/", "server/", "eval/", "tuning/", "distill/"),
    ("__init__.py", "__main__.py"),
]

ARCHITECTURE = Path(__file__).parents[1] / "docs" / "architecture.md"


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


def _runtime_imports(
    path: Path, module: str, is_package: bool, type_checking: bool = False
) -> set[str]:
    """Absolute names of what ``path`` imports, lazy imports included and ``if
    TYPE_CHECKING:`` blocks left out unless ``type_checking``; relative imports resolved
    against ``module``."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        guarded = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        if guarded and not type_checking:
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


def package_modules() -> dict[str, Path]:
    """Every module of smcspec (dotted name, a package by its own name) -> its file."""
    root = Path(smcspec.backends.__file__).parents[1]
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """smcspec module -> the smcspec modules it imports (a name imported from a module
    counts as that module); imports for type checking only with ``type_checking``."""
    modules = package_modules()
    graph = {}
    for name, path in modules.items():
        deps = set()
        for n in _runtime_imports(path, name, path.name == "__init__.py", type_checking):
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


def test_the_request_object_is_on_no_cycle_even_for_type_checking():
    """``decoding/job.py``, the request a decoder's program is given, sits below every
    decoder and the table (``decoding/registry.py``) that imports them: it imports none of
    them, not even for type checking (the check above leaves those imports out, so it did
    not see ``Job.decoder``'s ``Decoder`` type close a circle job -> registry -> decoders ->
    job). Broken variant caught: ``if TYPE_CHECKING: from smcspec.decoding.registry import
    Decoder`` in job.py (a cycle of ten modules)."""
    graph = import_graph(type_checking=True)
    assert "smcspec.decoding.job" in graph["smcspec.decoding.ar.program"]  # decoders import it
    on_cycles = {m for comp in cycles(graph) for m in comp}
    assert "smcspec.decoding.job" not in on_cycles


def test_the_cycle_finder_finds_a_cycle():
    """The check above can fail: a planted two-module and three-module cycle are found,
    and a chain is not a cycle."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert cycles(graph) == [["a", "b"], ["c", "d", "e"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def unit_of(path: Path) -> str:
    """The entry of :data:`LAYERS` a file of smcspec belongs to: ``"name/"`` for a file in
    package ``name``, its file name for a top-level module."""
    parts = path.relative_to(Path(smcspec.backends.__file__).parents[1]).parts
    return f"{parts[0]}/" if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]], layer_of: Callable[[str], int]) -> list[str]:
    """Each import of ``graph`` from a module into a module of a higher layer, as text."""
    return sorted(
        f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
        for m, deps in graph.items()
        for d in deps
        if layer_of(d) > layer_of(m)
    )


def test_every_module_is_in_one_layer():
    names = [name for layer in LAYERS for name in layer]
    assert len(names) == len(set(names)), "a name is in two layers"
    units = {unit_of(path) for path in package_modules().values()}
    assert units - set(names) == set(), "modules in no layer of LAYERS"
    assert set(names) - units == set(), "names in LAYERS that are no module of smcspec"


def test_no_module_imports_a_higher_layer():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    files = package_modules()
    graph = import_graph(type_checking=True)
    assert len(graph) > 50 and "smcspec.rewards.code" in graph
    assert upward_imports(graph, lambda m: layer[unit_of(files[m])]) == []


def test_the_layer_check_finds_an_upward_import():
    """The check above can fail: an import of a higher layer is found, one of the same or a
    lower layer is not."""
    layers = {"low": 0, "low2": 0, "high": 1}
    graph = {"low": {"low2", "high"}, "low2": set(), "high": {"low"}}
    assert upward_imports(graph, layers.__getitem__) == ["low (layer 0) imports high (layer 1)"]


def _drawing() -> list[str]:
    """The lines of the first fenced block of docs/architecture.md (the layer drawing)."""
    text = ARCHITECTURE.read_text()
    match = re.search(r"^```[^\n]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
    assert match, "docs/architecture.md has no drawing"
    return match.group(1).splitlines()


def test_the_architecture_doc_draws_the_layers():
    """Each layer of :data:`LAYERS` is one line of the drawing, highest on top, and each name
    is drawn once."""
    lines = _drawing()
    rows = []
    for names in LAYERS:
        at = set()
        for name in names:
            pattern = rf"(?<![\w./]){re.escape(name)}(?![\w./])"
            found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
            assert len(found) == 1, f"{name} is drawn on {len(found)} lines, not 1"
            at |= set(found)
        assert len(at) == 1, f"the layer {names} is drawn on {len(at)} lines, not 1"
        rows.append(at.pop())
    assert rows == sorted(rows, reverse=True), "the drawing's layers are not in LAYERS' order"


def _defines(path: Path, name: str) -> bool:
    """``path``'s module defines ``name`` at its top level (a function, class or name)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                return True
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def missing_references(text: str, src: Path) -> list[str]:
    """The files (``dir/name.py``, or a bare ``name.py`` anywhere in the package) and the
    names in them (``dir/name.py:function``) that ``text`` mentions and ``src`` (a copy of
    ``src/smcspec``) lacks; ``name.py`` and ``file.py`` are the page's notation, not files."""
    repo = src.parents[1]
    missing = []
    for m in re.finditer(r"(?<![\w./])((?:[\w-]+/)*\w+\.py)(?::(\w+))?", text):
        rel, name = m.group(1), m.group(2)
        if rel in ("name.py", "file.py"):
            continue
        if "/" in rel:
            where = [p for p in (repo / rel, src.parent / rel, src / rel) if p.is_file()]
        else:
            where = sorted(src.rglob(rel))
        if not where:
            missing.append(rel)
        elif name is not None and not any(_defines(p, name) for p in where):
            missing.append(f"{rel}:{name}")
    return sorted(set(missing))


def test_the_architecture_doc_names_files_and_functions_that_exist():
    """Every file ``docs/architecture.md`` names exists, and every ``file.py:name`` is
    defined there (where the decoder is picked, where a method is resolved, ...); the
    ``job.<field>`` it names are fields of :class:`~smcspec.decoding.job.Job`. Broken
    variants caught: the doc naming ``cli/options.py:resolve_method`` (a function that
    does not exist) or ``job.decoder`` (a field dropped)."""
    from dataclasses import fields

    from smcspec.decoding.job import Job

    text = ARCHITECTURE.read_text()
    src = Path(smcspec.backends.__file__).parents[1]
    assert len(re.findall(r"\.py:\w+", text)) >= 5
    assert missing_references(text, src) == []
    assert missing_references("`cli/options.py:resolve_method` `decoding/nope.py`", src) == [
        "cli/options.py:resolve_method",
        "decoding/nope.py",
    ]
    named = set(re.findall(r"(?<![\w/])job\.(?!py\b)(\w+)", text))
    assert named and named <= {f.name for f in fields(Job)}, named


def private_names(root: Path) -> dict[str, list[str]]:
    """Each private name (one leading underscore, not a dunder) that a ``def`` or ``class``
    anywhere in a module under ``root`` defines (methods and nested functions included) ->
    the modules (paths relative to ``root``) that define it, where more than one does."""
    where: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            kinds = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
            if isinstance(node, kinds) and re.fullmatch(r"_[^_]\w*|_", node.name):
                where.setdefault(node.name, set()).add(str(path.relative_to(root)))
    return {name: sorted(files) for name, files in sorted(where.items()) if len(files) > 1}


def test_no_two_decoding_modules_define_one_private_name():
    """A private function or class of ``decoding/`` is named once in the package: a reader who
    meets ``_sd_rounds`` finds one. Fails on b882fc0 (before the decoders' folders) with
    ``_smc_rounds`` (smc.py and fused.py), ``_sd_rounds`` (sd.py and fused.py),
    ``_multi_sd_rounds``, ``_draft_block``, ``_advance``, ``_draft_pending``,
    ``_masked_draft`` and ``_round_steps``."""
    root = Path(smcspec.backends.__file__).parents[1] / "decoding"
    assert len(list(root.rglob("*.py"))) > 20
    assert private_names(root) == {}


def test_the_private_name_check_finds_a_repeat(tmp_path):
    """The check above can fail: a private name in two modules is found (a function in one, a
    method in the other), one in a single module or a dunder is not."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "a.py").write_text("def _step():\n    pass\n\ndef __init__():\n    pass\n")
    (tmp_path / "pkg" / "b.py").write_text(
        "class C:\n    def _step(self):\n        pass\n\n    def __init__(self):\n        pass\n"
    )
    (tmp_path / "c.py").write_text("def _once():\n    pass\n")
    assert private_names(tmp_path) == {"_step": ["a.py", "pkg/b.py"]}


DECODER_FOLDERS = ("ar", "sd", "smc")
"""The decoders' folders of ``decoding/``: each imports no other."""

DECODER_TABLES = {"smcspec.decoding", "smcspec.decoding.registry"}
"""The modules of ``decoding/`` outside the folders that may import them: the package's public
names (``decoding/__init__.py``) and the decoder table (``decoding/registry.py``)."""


def decoder_folder(module: str) -> str | None:
    """The decoder folder (``"ar"``, ``"sd"``, ``"smc"``) holding ``module``; ``""`` for the
    shared floor (a module of ``decoding/`` outside them); None outside ``decoding/``."""
    parts = module.split(".")
    if parts[:2] != ["smcspec", "decoding"]:
        return None
    return parts[2] if len(parts) > 2 and parts[2] in DECODER_FOLDERS else ""


def wall_crossings(graph: dict[str, set[str]]) -> list[str]:
    """Each import of ``graph`` through a wall of ``decoding/``, as text: a module of one
    decoder folder importing a module of another, or a module of the shared floor (but
    :data:`DECODER_TABLES`) importing a module of any decoder folder."""
    found = []
    for m, deps in graph.items():
        here = decoder_folder(m)
        if here is None or m in DECODER_TABLES:
            continue
        for d in deps:
            there = decoder_folder(d)
            if there and there != here:
                side = f"decoding/{here}/" if here else "the shared floor"
                found.append(f"{m} ({side}) imports {d} (decoding/{there}/)")
    return sorted(found)


def test_no_decoder_folder_imports_another():
    """A module of ``decoding/ar/``, ``decoding/sd/`` or ``decoding/smc/`` imports no module of
    another decoder's folder (what two decoders share lies on the floor, ``decoding/*.py``), and
    the floor imports no decoder's folder, the table and the package's names aside (imports for
    type checking and inside functions included). Fails on 487c896 with ``sd/cost.py``
    importing ``smc/cost.py`` (the multi-draft round priced as SMC-SD's) and ``sd/multi_sd.py``
    importing ``smc/potential_hooks.py`` (the constraint's masks)."""
    graph = import_graph(type_checking=True)
    assert "smcspec.decoding.sd.multi_sd" in graph and "smcspec.decoding.smc.block" in graph
    assert wall_crossings(graph) == []


def test_the_wall_check_finds_a_crossing():
    """The check above can fail: a decoder folder importing another's module and the floor
    importing a decoder's are found; a folder importing its own modules or the floor, and the
    table importing every folder, are not."""
    graph = {
        "smcspec.decoding.sd.multi_sd": {"smcspec.decoding.smc.cost", "smcspec.decoding.sd.chain"},
        "smcspec.decoding.sd.chain": {"smcspec.decoding.fused", "smcspec.sampling.speculative"},
        "smcspec.decoding.fused": {"smcspec.decoding.ar.fused"},
        "smcspec.decoding.registry": {"smcspec.decoding.ar.program", "smcspec.decoding.smc.cost"},
        "smcspec.engine": {"smcspec.decoding.smc.program"},
    }
    assert wall_crossings(graph) == [
        "smcspec.decoding.fused (the shared floor) imports smcspec.decoding.ar.fused"
        " (decoding/ar/)",
        "smcspec.decoding.sd.multi_sd (decoding/sd/) imports smcspec.decoding.smc.cost"
        " (decoding/smc/)",
    ]


def _tying_tests(text: str) -> list[tuple[str, str]]:
    """The ``(tests/file.py, test_name)`` pairs a docstring names: each ``tests/file.py``
    followed by a parenthesis of ``test_name`` (an optional ``[id]`` after it)."""
    pairs = []
    for m in re.finditer(r"``(tests/\w+\.py)``\s*\(([^)]*)\)", text):
        pairs += [(m.group(1), t) for t in re.findall(r"``(test_\w+)(?:\[[\w-]+\])?``", m.group(2))]
    return pairs


def test_each_decoder_names_its_step_and_fused_pairs_and_their_tests():
    """Each decoder folder's ``__init__.py`` names every round function of its ``fused.py``
    (``*_round``, ``*_block``, ``*_joined``) beside the step round it repeats, and each test
    that ties a pair draw for draw: every test it names exists in the file it names."""
    import importlib

    root = Path(smcspec.backends.__file__).parents[1] / "decoding"
    repo = root.parents[2]
    for folder in DECODER_FOLDERS:
        doc = importlib.import_module(f"smcspec.decoding.{folder}").__doc__ or ""
        fused = ast.parse((root / folder / "fused.py").read_text())
        rounds = [
            n.name
            for n in fused.body
            if isinstance(n, ast.FunctionDef) and re.search(r"_(round|block|joined)$", n.name)
        ]
        assert rounds, folder
        for name in rounds:
            assert f":func:`.fused.{name}`" in doc, f"decoding/{folder}/__init__.py: {name}"
        tied = _tying_tests(doc)
        assert len(tied) >= len(rounds), (folder, tied)
        for file, test in tied:
            assert _defines(repo / file, test), f"decoding/{folder}/__init__.py: {file}::{test}"
