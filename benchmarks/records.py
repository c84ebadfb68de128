"""The records of a resumable benchmark: one JSON object a line in a ``records.jsonl``,
appended as each is measured, read back to skip what is done and to build the report
(``epsilon_stop.py``, ``multi_draft_acceptance.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def read_records(path: Path) -> list[dict]:
    """Every record in ``path`` (none where it does not exist yet); blank lines skipped."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_record(path: Path, record: dict) -> None:
    """Append ``record`` as one line (written whole, so a stopped run loses at most it)."""
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def comma_list(text: str, kind: Callable[[str], T]) -> list[T]:
    """``"2,4,8"`` as ``[2, 4, 8]`` (``kind`` each item: ``int``, ``float``)."""
    return [kind(x) for x in text.split(",") if x]
