"""GSM8K: loading, zero-shot chat prompt, answer extraction and scoring.

Data format (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems",
https://github.com/openai/grade-school-math): one JSON object per line with "question" and
"answer"; the gold number follows ``#### `` on the last line of "answer". The test split
(1319 problems) ships in this package as ``smcspec/eval/data/gsm8k/test.jsonl`` beside its
MIT licence (``LICENSE``, Copyright (c) 2021 OpenAI); :func:`load_gsm8k` reads it by default.

Scoring is exact match of canonical number strings (see :func:`normalize_number`), which is
the usual GSM8K metric; it is also numeric equality because the canonical form is unique per
decimal value.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from importlib import resources
from pathlib import Path

from smcspec.errors import ConfigError
from smcspec.input_files import loads_bounded, read_text_file

__all__ = [
    "Gsm8kItem",
    "build_messages",
    "extract_answer",
    "is_correct",
    "load_gsm8k",
    "normalize_number",
    "packaged_test_path",
    "seeded_subset",
]

# A number as written in model output. The look-behind stops a match from starting inside a
# word or another number ("x2", "16-3" -> "3" is positive, "1.5" is not read as ".5").
# Thousands separators must be strict groups of three ("1,234,567"); "1, 2" is two numbers.
# An optional sign (ASCII or Unicode minus), directly attached, may precede or follow a "$".
_NUMBER_RE = re.compile(
    r"(?<![\w.])"
    r"(?P<sign>[-+\u2212])?(?:\$\s?)?(?P<sign2>[-\u2212])?"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
_HASH_RE = re.compile(r"####([^\n]*)")
_BOXED_RE = re.compile(r"\\boxed\s*\{([^{}]*)\}")
_CANONICAL_INPUT_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
ANSWER_RULE = (  # what extract_answer and the scorer do, for reports
    "the first number on the last `####` line that has one, else the last number inside a "
    "`\\boxed{}`, else the last number in the answer; thousands separators, `$`, units and a "
    "trailing period dropped; compared to the reference as normalised numbers."
)

PROMPT_TEMPLATE = (
    "Solve the following grade-school math problem. Reason step by step, showing your "
    "calculations. Then give the final answer on the last line in the form\n"
    "#### <number>\n"
    "where <number> is only the number, without units or commas.\n\n"
    "Question: {question}"
)


@dataclass(frozen=True)
class Gsm8kItem:
    """One GSM8K problem.

    Attributes:
        id: stable identifier ``"gsm8k-<i>"``, ``i`` the 0-based index of the record among the
            non-blank lines of the source file.
        question: the problem text.
        answer: the gold final answer, canonicalised with :func:`normalize_number`.
    """

    id: str
    question: str
    answer: str


def seeded_subset(n: int, limit: int | None, seed: int) -> list[int]:
    """Indices ``0..n-1`` or a seeded random subset of ``limit`` of them, in ascending order.

    The same ``(n, limit, seed)`` always gives the same subset (``random.Random(seed).sample``).
    ``limit=None`` or ``limit >= n`` returns all indices.

    Raises:
        ValueError: if ``limit`` is negative.
    """
    if limit is None or limit >= n:
        return list(range(n))
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    return sorted(random.Random(seed).sample(range(n), limit))


def _gold_from_solution(solution: str) -> str:
    last = solution.strip().splitlines()[-1] if solution.strip() else ""
    if not last.startswith("####"):
        raise ValueError(f"GSM8K answer has no '#### <number>' last line: {last!r}")
    return normalize_number(last[4:].strip())


def packaged_test_path() -> Path:
    """Path of the GSM8K test split shipped in this package (1319 problems, MIT licence in
    the ``LICENSE`` file beside it).

    Raises:
        FileNotFoundError: if the file is missing (a broken install) or the package is not
            installed as plain files (e.g. imported from a zip archive).
    """
    res = resources.files("smcspec.eval").joinpath("data", "gsm8k", "test.jsonl")
    if not isinstance(res, Path) or not res.is_file():
        raise FileNotFoundError(f"packaged GSM8K test split not found: {res}")
    return res


def load_gsm8k(
    path: str | Path | None = None, limit: int | None = None, seed: int = 0
) -> list[Gsm8kItem]:
    """Load GSM8K from a JSONL file (default: the packaged test split).

    Args:
        path: JSONL file with "question" and "answer" per line (blank lines are skipped and do
            not count towards the index used in the item id); None reads
            :func:`packaged_test_path`.
        limit: if given, a seeded random subset of this many items (see :func:`seeded_subset`),
            returned in original file order.
        seed: seed for the subset; ignored when ``limit`` is None.

    Raises:
        ConfigError: ``path`` cannot be read with bounds (missing, not a regular file,
            larger than 64 MiB, not UTF-8 text: :func:`smcspec.input_files.read_text_file`),
            or a malformed line (bad JSON, missing keys, no ``####`` gold line).
        ValueError: a negative ``limit``.
    """
    if path is None:
        path = packaged_test_path()
    rows: list[tuple[str, str]] = []
    text = read_text_file(path, "the GSM8K data")
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = loads_bounded(line, f"{path}:{lineno}")
            rows.append((obj["question"], _gold_from_solution(obj["answer"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}:{lineno}: malformed GSM8K record: {exc}") from exc
    return [
        Gsm8kItem(id=f"gsm8k-{i}", question=rows[i][0], answer=rows[i][1])
        for i in seeded_subset(len(rows), limit, seed)
    ]


def build_messages(question: str) -> list[dict[str, str]]:
    """Zero-shot chat prompt: one user message asking for step-by-step reasoning and a final
    ``#### <number>`` line (a single user turn, so it works with templates without a system
    role)."""
    return [{"role": "user", "content": PROMPT_TEMPLATE.format(question=question.strip())}]


def _numbers(text: str) -> list[str]:
    out = []
    for m in _NUMBER_RE.finditer(text):
        negative = (m["sign"] in ("-", "\u2212")) or m["sign2"] is not None
        out.append(("-" if negative else "") + m["num"].replace(",", ""))
    return out


def extract_answer(text: str) -> str | None:
    """The model's final numeric answer as a raw number string, or None.

    Priority: (1) the first number on the last ``####`` line that contains a number;
    (2) the last number inside a ``\\boxed{...}``; (3) the last number anywhere in the text.
    Thousands separators and "$" are removed, units/percent signs and a trailing period are
    ignored ("$1,234." -> "1234", "18%" -> "18"), a leading "-" or Unicode minus gives a
    negative number. The result is not canonicalised; pass it to :func:`normalize_number` or
    :func:`is_correct`.
    """
    for segment in reversed(_HASH_RE.findall(text)):
        nums = _numbers(segment)
        if nums:
            return nums[0]
    for content in reversed(_BOXED_RE.findall(text)):
        nums = _numbers(content)
        if nums:
            return nums[-1]
    nums = _numbers(text)
    return nums[-1] if nums else None


def normalize_number(s: str) -> str:
    """Canonical decimal string of a number.

    Strips whitespace, "$", "%", thousands commas, a leading "+" and a trailing ".";
    maps a Unicode minus to "-". The value is then printed without exponent, leading zeros or
    trailing fractional zeros: "018" -> "18", "18.50" -> "18.5", "18.00" -> "18", ".5" -> "0.5",
    "-0" -> "0". Two strings have the same canonical form iff they denote the same decimal.

    Raises:
        ValueError: if ``s`` is not a plain decimal number after stripping (e.g. "abc", "1e5",
            "nan", "1/2").
    """
    t = s.strip().replace("\u2212", "-").replace(",", "").replace("$", "").replace("%", "")
    t = t.replace(" ", "").rstrip(".")
    if not _CANONICAL_INPUT_RE.fullmatch(t):
        raise ValueError(f"not a number: {s!r}")
    try:
        d = Decimal(t)
    except InvalidOperation as exc:  # pragma: no cover - guarded by the regex
        raise ValueError(f"not a number: {s!r}") from exc
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def is_correct(pred: str | None, gold: str) -> bool:
    """True iff ``pred`` and ``gold`` denote the same decimal number (exact, no tolerance).

    ``pred`` None or not a number gives False. Both sides go through :func:`normalize_number`,
    so "2.50" matches "2.5", ".5" matches "0.5" and "1,234" matches "1234".

    Raises:
        ValueError: if ``gold`` is not a number (a data error, not a model error).
    """
    gold_n = normalize_number(gold)
    if pred is None:
        return False
    try:
        return normalize_number(pred) == gold_n
    except ValueError:
        return False
