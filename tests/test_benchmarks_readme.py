"""``benchmarks/README.md`` lists every script under ``benchmarks/`` (and
``benchmarks/studies/``) in its tables, and lists none that is gone. Reads files only.

Broken variant it catches: cb48c1a's README, which left out ``batch_bounds.py``."""

from __future__ import annotations

import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
ROW = re.compile(r"^\| `([^`]+\.(?:py|sh))` \|", re.MULTILINE)


def test_every_benchmark_script_has_a_row():
    listed = set(ROW.findall((BENCHMARKS / "README.md").read_text()))
    scripts = {p.name for d in (BENCHMARKS, BENCHMARKS / "studies") for p in d.glob("*.py")}
    scripts |= {p.name for p in BENCHMARKS.glob("*.sh")}
    assert scripts - listed == set(), "scripts without a row in benchmarks/README.md"
    assert listed - scripts == set(), "rows of benchmarks/README.md naming no script"
