"""Each test file's seconds in a pytest run, for the suite's scheduler.

Reads the report pytest prints with ``--durations=0`` (every test's setup, call and teardown,
``12.34s call     tests/test_x.py::test_y``) and writes ``{file: seconds}`` sorted by file,
rounded to 0.1 s. ``tests/conftest.py`` sends the files to the xdist workers longest first
from ``tests/file_durations.json``; remake it when files grow or shrink by much:

  .venv/bin/python -m pytest -q -n auto --dist loadgroup --durations=0 > run.log
  .venv/bin/python scripts/file_durations.py run.log > tests/file_durations.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict

LINE = re.compile(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(\S+?\.py)::")


def file_seconds(lines) -> dict[str, float]:
    """Seconds per test file from ``--durations`` report lines (other lines ignored)."""
    total: dict[str, float] = defaultdict(float)
    for line in lines:
        m = LINE.match(line)
        if m:
            total[m.group(2)] += float(m.group(1))
    return {f: round(s, 1) for f, s in sorted(total.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", type=argparse.FileType(encoding="utf-8"))
    args = ap.parse_args(argv)
    seconds = file_seconds(args.log)
    if not seconds:
        print("error: no --durations lines in the log", file=sys.stderr)
        return 2
    print(json.dumps(seconds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
