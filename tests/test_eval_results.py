"""Resumable JSONL result file: append, interruption, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from smcspec.eval.results import ResultFile


def test_append_interrupt_resume(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "results.jsonl"
    rf = ResultFile(path)
    assert rf.records() == [] and rf.done_ids() == set()
    for i in range(3):
        rf.append({"id": f"q{i}", "correct": i % 2 == 0, "method": "smc"})
    # simulate an interrupted write: half a JSON line, no newline
    with open(path, "ab") as fh:
        fh.write(b'{"id": "q3", "corr')

    resumed = ResultFile(path)
    recs = resumed.records()
    assert [r["id"] for r in recs] == ["q0", "q1", "q2"]
    assert recs[1] == {"id": "q1", "correct": False, "method": "smc"}
    assert resumed.done_ids() == {"q0", "q1", "q2"}

    resumed.append({"id": "q3", "correct": True})
    resumed.append({"id": "q4", "correct": False})
    assert ResultFile(path).done_ids() == {"q0", "q1", "q2", "q3", "q4"}
    # the truncated line was removed, every line is valid JSON
    lines = path.read_text().splitlines()
    assert len(lines) == 5 and all(json.loads(line)["id"] for line in lines)


def test_last_record_per_id_wins(tmp_path: Path) -> None:
    rf = ResultFile(tmp_path / "r.jsonl")
    rf.append({"id": "a", "v": 1})
    rf.append({"id": "b", "v": 2})
    rf.append({"id": "a", "v": 3})
    assert rf.records() == [{"id": "a", "v": 3}, {"id": "b", "v": 2}]


def test_complete_last_line_without_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": "a", "v": 1}\n{"id": "b", "v": 2}')
    rf = ResultFile(path)
    assert rf.done_ids() == {"a", "b"}
    rf.append({"id": "c"})
    assert [r["id"] for r in rf.records()] == ["a", "b", "c"]


def test_rejects_bad_records_and_corruption(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    rf = ResultFile(path)
    with pytest.raises(ValueError):
        rf.append({"no_id": 1})
    with pytest.raises(ValueError):
        rf.append({"id": "x", "obj": object()})
    assert not path.exists()  # nothing written
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=":2:"):
        rf.records()
