"""Resumable JSONL result file: one JSON object per finished item, appended as items finish.

An interrupted run resumes by skipping :meth:`ResultFile.done_ids`. Durability: each
:meth:`ResultFile.append` writes one complete line with a single ``write`` call, then flushes
and ``fsync``s, so after a crash the file holds every acknowledged record plus at most one
truncated last line, which :meth:`ResultFile.records` ignores and the next append removes.
Assumes a single writer process per file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["ResultFile"]


class ResultFile:
    """A JSONL file of result records, each a JSON object with a string ``"id"``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Bind to ``path``; the file (and its parent directories) is created on first append."""
        self.path = Path(path)

    def _lines(self) -> tuple[list[bytes], bytes]:
        """Complete lines and the trailing partial line (b"" if the file ends with newline)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return [], b""
        *complete, partial = data.split(b"\n")
        return complete, partial

    def records(self) -> list[dict[str, Any]]:
        """All records, keeping the last one written for each id.

        Records are ordered by the first appearance of their id. A truncated last line (no
        final newline and not valid JSON, from an interrupted write) is ignored; a final line
        without newline that is valid JSON is kept. A missing file gives ``[]``.

        Raises:
            ValueError: if a complete (newline-terminated) line is not a JSON object with a
                string "id" (corruption not explained by an interrupted append).
        """
        complete, partial = self._lines()
        by_id: dict[str, dict[str, Any]] = {}
        for lineno, line in enumerate(complete, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:  # JSONDecodeError or bad UTF-8
                raise ValueError(f"{self.path}:{lineno}: corrupt record: {exc}") from exc
            if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
                raise ValueError(f"{self.path}:{lineno}: record is not an object with str id")
            by_id[rec["id"]] = rec
        if partial.strip():
            try:
                rec = json.loads(partial)
            except ValueError:
                rec = None  # truncated by an interrupted write
            if isinstance(rec, dict) and isinstance(rec.get("id"), str):
                by_id[rec["id"]] = rec
        return list(by_id.values())

    def done_ids(self) -> set[str]:
        """Ids of all records (see :meth:`records`)."""
        return {rec["id"] for rec in self.records()}

    def _ends_with_newline(self) -> bool:
        try:
            with open(self.path, "rb") as fh:
                if fh.seek(0, os.SEEK_END) == 0:
                    return True
                fh.seek(-1, os.SEEK_END)
                return fh.read(1) == b"\n"
        except FileNotFoundError:
            return True

    def _repair_tail(self) -> None:
        """Make the file end with a newline: drop a truncated last line, or terminate a last
        line that is a valid record, so the next append starts on a fresh line."""
        if self._ends_with_newline():
            return
        complete, partial = self._lines()
        if partial:
            try:
                valid = isinstance(json.loads(partial), dict)
            except ValueError:
                valid = False
            with open(self.path, "r+b") as fh:
                if valid:
                    fh.seek(0, os.SEEK_END)
                    fh.write(b"\n")
                else:
                    fh.truncate(sum(len(line) + 1 for line in complete))
                fh.flush()
                os.fsync(fh.fileno())

    def append(self, record: dict[str, Any]) -> None:
        """Append one record as a JSON line, then flush and ``fsync``.

        Raises:
            ValueError: if ``record`` has no string "id" or is not JSON-serialisable (nothing
                is written then).
        """
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            raise ValueError("record must be a dict with a str 'id'")
        try:
            line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"record is not JSON-serialisable: {exc}") from exc
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair_tail()
        with open(self.path, "ab") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())
