"""The arithmetic check of worked maths answers (smcspec.rewards.arithmetic): which equations
it checks, which it leaves alone, and its reward's prefix twist."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from smcspec.errors import ConfigError
from smcspec.rewards.arithmetic import arithmetic_reward, check_arithmetic, false_equations

HOLD = [
    "165 \\times 12 = 1980",
    "\\[ \\text{Teachers} = \\frac{180}{5} = 36 \\]",
    "Total cost = $2 + $3 + $4 = $9",
    "1,200 + 300 = 1,500",
    "\\( 10 / 3 = 3.33 \\)",  # rounded to its last written digit
    "2 \\text{ boxes} \\times 6 = 12 \\text{ boxes}",
    "- 840 \\text{ dollars} + 756 \\text{ dollars} = 1596 \\text{ dollars}",  # a bullet
    "\\frac{\\frac{1}{2}}{4} = 0.125",
    "3 \\cdot 4 - 2 \\div 2 = 11",
]
FALSE = [  # slips from the committed GSM8K records (docs/benchmarks/gsm8k-400)
    ("2100 \\times 52 = 107400", 109200.0, 107400.0),
    ("\\text{Total payment} = 165 \\times 12 = 2040 \\text{ dollars}", 1980.0, 2040.0),
    ("- Total people = \\( 12 + 3 + 24 = 49 \\)", 39.0, 49.0),
    ("\\frac{29}{8.50} = \\frac{2900}{850} = 3.3846", 3.411764705882353, 3.3846),
]
NOT_CHECKED = [
    "\\text{Corey's age} - 2 = 11 - 2",  # a variable beside the arithmetic
    "x = 5",
    "50\\% \\times 8 = 4",  # percent: not checked
    "4 \\text{ inches} = \\frac{4}{12} \\text{ feet}",  # a unit conversion
    "10 / 3 \\approx 3",  # approximately
    "if 2 + 2 == 4:",
    "2^{10} = 1024",  # a power is not checked
    "1 / 0 = 5",
    "\\frac{1}{2} \\left( 3 + 5 \\right) = 4 < 5",
]


@pytest.mark.parametrize("line", HOLD)
def test_equations_that_hold(line: str) -> None:
    found = check_arithmetic(line)
    assert found and all(e.holds for e in found), found
    assert false_equations(line) == 0


@pytest.mark.parametrize(("line", "left", "right"), FALSE)
def test_slips_are_found(line: str, left: float, right: float) -> None:
    bad = [e for e in check_arithmetic(line) if not e.holds]
    assert [(e.left, e.right) for e in bad] == [pytest.approx((left, right))]


@pytest.mark.parametrize("line", NOT_CHECKED)
def test_what_is_not_arithmetic_is_not_checked(line: str) -> None:
    assert check_arithmetic(line) == []


def test_code_fences_and_unfinished_lines_are_skipped() -> None:
    text = "```python\nx = 2 + 2 = 5\n```\n2 + 2 = 4\n3 + 3 = 7"
    assert false_equations(text) == 1
    assert false_equations(text, complete_lines_only=True) == 0  # "3 + 3 = 7" still running
    assert false_equations(text + "\n", complete_lines_only=True) == 1


@settings(max_examples=300, deadline=None)
@given(
    st.integers(-(10**6), 10**6),
    st.integers(-(10**6), 10**6),
    st.sampled_from(["+", "-", "\\times", "*"]),
    st.integers(1, 1000),
)
def test_integer_steps_hold_and_off_by_k_is_false(a: int, b: int, op: str, k: int) -> None:
    value = a + b if op == "+" else a - b if op == "-" else a * b
    line = f"{a} {op} ({b}) = {value}"
    assert [e.holds for e in check_arithmetic(line)] == [True]
    assert [e.holds for e in check_arithmetic(f"{a} {op} ({b}) = {value + k}")] == [False]


def test_reward_counts_slips_and_twists_on_finished_lines() -> None:
    reward = arithmetic_reward(beta=2.0)
    texts = ["2 + 2 = 5\n3 + 3 = 7", "2 + 2 = 4\n", "no numbers here"]
    assert list(reward.fn(texts)) == [-2.0, 0.0, 0.0]
    assert list(reward.prefix_fn(texts)) == [-1.0, 0.0, 0.0]
    assert reward.beta == 2.0
    with pytest.raises(ConfigError):
        arithmetic_reward(beta=float("inf"))


def test_long_or_deep_pieces_are_not_evaluated() -> None:
    assert check_arithmetic("(" * 150 + "1" + ")" * 150 + " = 1") == []  # over 200 chars
    assert check_arithmetic("9" * 400 + " = 1") == []
