"""The execution reward on a prompt's own examples (smcspec.rewards.code).

Each scored answer starts one short sandboxed interpreter (~0.1 s)."""

from __future__ import annotations

import pytest

from smcspec.errors import ConfigError
from smcspec.rewards import CodeExamples, Example, examples_from_prompt, examples_from_tests
from smcspec.sandbox import Limits

PROMPT = '''def add(a: int, b: int) -> int:
    """Add two numbers.
    >>> add(2, 3)
    5
    >>> add(-1, 1)
    0
    """
'''

INLINE = '''def will_it_fly(q, w):
    """Example:
    will_it_fly([1, 2], 5) ➞ False
    will_it_fly([3], 5) ==> true
    will_it_fly([3, 2, 3], 9) should return True.
    will_it_fly(q) is explained above
    """
'''


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\nDone."


def test_doctest_and_inline_examples_are_parsed() -> None:
    assert examples_from_prompt(PROMPT) == [Example("add(2, 3)", "5"), Example("add(-1, 1)", "0")]
    assert examples_from_prompt(INLINE) == [
        Example("will_it_fly([1, 2], 5)", "False"),
        Example("will_it_fly([3], 5)", "True"),
        Example("will_it_fly([3, 2, 3], 9)", "True"),
    ]
    assert examples_from_prompt("def f(x):\n    return x\n") == []


def test_examples_from_a_tests_file() -> None:
    assert examples_from_tests("assert add(1, 2) == 3\nassert add(0, 0) in (0,)\n") == [
        Example("add(1, 2)", "3"),
        Example("add(0, 0) in (0,)", "True"),
    ]
    assert examples_from_tests(">>> add(1, 1)\n2\n") == [Example("add(1, 1)", "2")]
    with pytest.raises(ConfigError, match="no examples"):
        examples_from_tests("x = 1\n")
    with pytest.raises(ConfigError, match="neither"):
        examples_from_tests("def (\n")


def test_score_is_the_share_of_examples_passed() -> None:
    ce = CodeExamples.from_prompt(f"Complete this:\n```python\n{PROMPT}```")
    right = fenced("def add(a, b):\n    return a + b\n")
    half = fenced("def add(a, b):\n    return 5\n")  # passes add(2, 3) only
    body = fenced("    return a + b\n")  # a continuation of the prompt's stub
    broken = fenced("def add(a, b)\n    return a + b\n")
    assert ce.score([right, half, body, broken, "No code, sorry."]) == [1.0, 0.5, 1.0, 0.0, 0.0]
    assert ce.behaviour(right) == "5\n0" and ce.behaviour(half) == "5\n5"
    assert ce.behaviour("No code, sorry.") is None
    assert ce.behaviour(broken) == "not run\nnot run"  # the syntax error stops the program


def test_a_hanging_answer_scores_what_passed_before_the_limit() -> None:
    prompt = "def f(x):\n    '''\n    >>> f(1)\n    1\n    >>> f(2)\n    2\n    '''\n"
    ce = CodeExamples(examples_from_prompt(prompt), prompt, limits=Limits(timeout_s=1.0))
    hang = fenced("def f(x):\n    while x == 2:\n        pass\n    return x\n")
    assert ce.score([hang]) == [0.5]


def test_prefix_twist_flags_broken_code_only() -> None:
    ce = CodeExamples.from_prompt(PROMPT)
    assert ce.prefix_score(["Let me think", "```python\ndef add(a, b):\n    return (a +"]) == [
        0.5,
        0.5,
    ]
    broken = "```python\ndef add(a, b):\n    return a +\n    "
    cut_mid_token = "```python\ndef add(a, b):\n    ret"
    assert ce.prefix_score([broken, cut_mid_token]) == [0.0, 0.5]
    assert ce.prefix_score(["```python\n    return a + b\n"]) == [0.5]  # continues the stub


def test_reward_and_bad_settings() -> None:
    ce = CodeExamples.from_prompt(PROMPT)
    r = ce.reward(beta=4.0)
    assert r.beta == 4.0 and r.prefix_fn is not None and ce.reward(twist=False).prefix_fn is None
    with pytest.raises(ConfigError, match="no examples"):
        CodeExamples.from_prompt("Write a function.")
    with pytest.raises(ConfigError):
        CodeExamples([], "")
    with pytest.raises(ConfigError, match="beta"):
        ce.reward(beta=float("nan"))


def test_a_chat_prompt_with_fences_and_a_docstring_before_the_closing_fence() -> None:
    """A real prompt shape that once crashed: ``` in the instruction line, and a closing fence
    right after the docstring (doctest alone refuses its indentation)."""
    prompt = (
        "Reply with the whole function in one ```python code block.\n\n```python\n"
        "def running_max(xs):\n"
        '    """Running maximum.\n    >>> running_max([1, 3, 2])\n    [1, 3, 3]\n    """\n```\n'
    )
    ce = CodeExamples.from_prompt(prompt)
    assert ce.examples == [Example("running_max([1, 3, 2])", "[1, 3, 3]")]
    assert ce.prompt_code.startswith("def running_max(xs):")
    body = "    import itertools\n    return list(itertools.accumulate(xs, max))\n"
    right = fenced("def running_max(xs):\n" + body)
    assert ce.score([right]) == [1.0]
