"""GSM8K answer extraction, normalisation, scoring and loading (exact string checks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from smcspec.eval.gsm8k import (
    build_messages,
    extract_answer,
    is_correct,
    load_gsm8k,
    normalize_number,
    packaged_test_path,
)

GSM8K_TEST = packaged_test_path()  # shipped in the package: no skip, no path outside the repo


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 1,234.", "1234"),
        ("She pays $18 in total.", "18"),
        ("So she makes 18 dollars.", "18"),
        ("The discount is 18%.", "18"),
        ("#### -5", "-5"),
        ("It drops to \u22125 degrees.", "-5"),
        ("16 - 3 - 4 = 9 eggs remain", "9"),
        ("Total: $1,234.56 overall", "1234.56"),
        ("#### 2.50", "2.50"),
        ("The answer is 18.", "18"),
        ("First try\n#### 12\nWait, recheck.\n#### 14", "14"),
        ("#### 7\nHmm\n#### none\n", "7"),  # last #### line without a number is skipped
        ("#### $1,000 dollars\nthen 5 more words with 3", "1000"),
        ("I computed 3 + 4 = 7, then doubled: 14 apples", "14"),
        ("Thus \\boxed{42} is the result, from 6 x 7 = 42 and 100", "42"),
        ("No idea, sorry.", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("1,234", "1234"),
        ("$18", "18"),
        ("18.0", "18"),
        ("18.00", "18"),
        ("18.50", "18.5"),
        ("+7", "7"),
        ("007", "7"),
        ("-0", "0"),
        ("-0.0", "0"),
        (".5", "0.5"),
        ("18.", "18"),
        (" -12 ", "-12"),
        ("1,450,000", "1450000"),
    ],
)
def test_normalize_number(raw: str, canonical: str) -> None:
    assert normalize_number(raw) == canonical


@pytest.mark.parametrize("bad", ["abc", "", "1e5", "nan", "1/2", "--3"])
def test_normalize_number_rejects_non_numbers(bad: str) -> None:
    with pytest.raises(ValueError):
        normalize_number(bad)


def test_is_correct() -> None:
    assert is_correct(extract_answer("#### 2.50"), "2.5")
    assert is_correct("0.5", ".5")
    assert is_correct(extract_answer("The answer is 1,234."), "1234")
    assert is_correct("18", "18.00")
    assert not is_correct("18", "18.5")
    assert not is_correct("-5", "5")
    assert not is_correct(None, "5")
    assert not is_correct("five", "5")
    with pytest.raises(ValueError):
        is_correct("5", "not a number")


def test_build_messages_asks_for_hash_line() -> None:
    msgs = build_messages("What is 2+2?")
    assert isinstance(msgs, list) and msgs[-1]["role"] == "user"
    assert "What is 2+2?" in msgs[-1]["content"]
    assert "#### <number>" in msgs[-1]["content"]
    assert "step by step" in msgs[-1]["content"]


def test_packaged_test_split_ships_with_its_licence() -> None:
    """The test split is package data (not a folder beside the checkout), licence beside it."""
    import smcspec.eval

    package_dir = Path(smcspec.eval.__file__).resolve().parent
    assert GSM8K_TEST.resolve() == package_dir / "data" / "gsm8k" / "test.jsonl"
    licence = (GSM8K_TEST.parent / "LICENSE").read_text()
    assert licence.startswith("MIT License") and "Copyright (c) 2021 OpenAI" in licence
    first = json.loads(GSM8K_TEST.read_text(encoding="utf-8").splitlines()[0])
    assert first["answer"].strip().splitlines()[-1] == "#### 18"
    default = load_gsm8k()  # no path: the packaged split
    assert len(default) == 1319 and default[0].answer == "18"


def test_load_gsm8k_real_file() -> None:
    items = load_gsm8k(GSM8K_TEST)
    assert len(items) == 1319
    assert items[0].id == "gsm8k-0"
    assert items[0].answer == "18"
    assert items[0].question.startswith("Janet")
    assert len({it.id for it in items}) == 1319
    # gold answers are canonical (e.g. "#### 2,125" -> "2125")
    assert all(normalize_number(it.answer) == it.answer for it in items)

    sub = load_gsm8k(GSM8K_TEST, limit=50, seed=3)
    assert [it.id for it in sub] == [it.id for it in load_gsm8k(GSM8K_TEST, limit=50, seed=3)]
    assert len(sub) == 50
    by_id = {it.id: it for it in items}
    assert all(by_id[it.id] == it for it in sub)  # a subset, same content
    idx = [int(it.id.split("-")[1]) for it in sub]
    assert idx == sorted(idx)  # original order
    other = load_gsm8k(GSM8K_TEST, limit=50, seed=4)
    assert [it.id for it in other] != [it.id for it in sub]


def test_load_gsm8k_small_file(tmp_path: Path) -> None:
    f = tmp_path / "g.jsonl"
    f.write_text(
        '{"question": "q0", "answer": "a\\n#### 1,000"}\n\n{"question": "q1", "answer": "#### 2"}\n'
    )
    items = load_gsm8k(f)
    assert [(it.id, it.answer) for it in items] == [("gsm8k-0", "1000"), ("gsm8k-1", "2")]
    assert load_gsm8k(f, limit=5) == items
    assert load_gsm8k(f, limit=0) == []
    with pytest.raises(ValueError):
        load_gsm8k(f, limit=-1)
    f.write_text('{"question": "q0", "answer": "no gold"}\n')
    with pytest.raises(ValueError):
        load_gsm8k(f)
