"""The decoder table: which decoder runs a request is decided in one place."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import smcspec
from smcspec import GenerationConfig
from smcspec.decoding.registry import DECODERS, decoder_for

SRC = Path(smcspec.__file__).parent


def _config_method_comparisons(path: Path) -> list[int]:
    """Lines of ``path`` comparing a request config's method (``cfg.method``,
    ``config.method``, ``<x>.config.method``) with anything."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            if not (isinstance(side, ast.Attribute) and side.attr == "method"):
                continue
            owner = side.value
            if (isinstance(owner, ast.Name) and owner.id in ("cfg", "config")) or (
                isinstance(owner, ast.Attribute) and owner.attr == "config"
            ):
                lines.append(node.lineno)
    return lines


def test_the_method_is_compared_in_the_registry_only():
    found = {
        str(p.relative_to(SRC)): lines
        for p in sorted(SRC.rglob("*.py"))
        if (lines := _config_method_comparisons(p))
    }
    assert set(found) == {"decoding/registry.py"}, found


def test_the_scan_sees_a_comparison():
    """The check above can fail: each spelling it looks for is found."""
    tree = "a = cfg.method == 'ar'\nb = job.config.method != 'sd'\nc = 'smc' in config.method\n"
    path = Path(__file__).parent / "_scan_probe.py"
    try:
        path.write_text(tree)
        assert _config_method_comparisons(path) == [1, 2, 3]
    finally:
        path.unlink()


@pytest.mark.parametrize(
    "kwargs, name, stats",
    [
        ({"method": "ar"}, "ar", {}),
        ({"method": "sd", "draft_tokens": 3}, "sd", {}),
        ({"method": "sd", "draft": "ngram", "draft_tokens": 5}, "ngram-sd", {}),
        ({"method": "smc", "particles": 6, "draft_tokens": 2}, "smc", {}),
        # greedy smc runs as greedy sd, and says so
        ({"method": "smc", "temperature": 0.0, "draft_tokens": 2}, "sd", {"ran_as": "sd"}),
        ({"method": "sd", "temperature": 0.0}, "sd", {}),
        ({"method": "ar", "temperature": 0.0}, "ar", {}),
    ],
)
def test_each_request_gets_its_decoder(kwargs, name, stats):
    """The decoder, and what the result's stats add to its own (N and K are in its typed
    stats, :mod:`smcspec.decoding.stats`)."""
    cfg = GenerationConfig(**kwargs).validate()
    decoder = decoder_for(cfg)
    assert decoder is DECODERS[name]
    assert decoder.stats(cfg) == stats
    assert decoder.draft_model == (name in ("sd", "smc"))
    assert decoder.draft_tokens == (name != "ar")
