"""The decoder table: which decoder runs a request is decided in one place."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import smcspec
from smcspec import GenerationConfig
from smcspec.decoding.registry import DECODERS, decoder_for

SRC = Path(smcspec.__file__).parent


def _method_comparisons(path: Path) -> list[int]:
    """Lines of ``path`` comparing a method with anything: a variable named ``method`` or a
    ``.method`` attribute (``cfg.method``, ``args.method``, ``setting.method``, ...) on either
    side of a comparison (``==``, ``!=``, ``in``, ...)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            if (isinstance(side, ast.Attribute) and side.attr == "method") or (
                isinstance(side, ast.Name) and side.id == "method"
            ):
                lines.append(node.lineno)
    return lines


def test_methods_are_compared_in_the_registry_only():
    """Everything that differs between methods is the decoder table's
    (``decoding/registry.py``): elsewhere code asks the table (a decoder's traits, its
    round, its name), never a method's name."""
    found = {
        str(p.relative_to(SRC)): lines
        for p in sorted(SRC.rglob("*.py"))
        if (lines := _method_comparisons(p))
    }
    assert set(found) == {"decoding/registry.py"}, found


def test_the_scan_sees_a_comparison():
    """The check above can fail: each spelling it looks for is found."""
    tree = (
        "a = cfg.method == 'ar'\nb = job.config.method != 'sd'\nc = 'smc' in config.method\n"
        "d = method == 'auto'\ne = args.method in ('smc', 'auto')\nf = setting.method != 'ar'\n"
        "g = cfg.method\n"
    )
    path = Path(__file__).parent / "_scan_probe.py"
    try:
        path.write_text(tree)
        assert _method_comparisons(path) == [1, 2, 3, 4, 5, 6]
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
    stats, :mod:`smcspec.decoding.decoder_stats`)."""
    cfg = GenerationConfig(**kwargs).validate()
    decoder = decoder_for(cfg)
    assert decoder is DECODERS[name]
    assert decoder.stats(cfg) == stats
    assert decoder.draft_model == (name in ("sd", "smc"))
    assert decoder.draft_tokens == (name != "ar")
