"""The package's layers import one way: models (loading files, picking a backend) sit above
the backends, which never import them, so neither side can import the other in a circle."""

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
