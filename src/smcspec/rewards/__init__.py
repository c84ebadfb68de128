"""Rewards that steer SMC-SD's particles (``exp(beta * R(x))``, :class:`smcspec.potentials.Reward`):
an execution reward on the examples a code prompt gives (:mod:`smcspec.rewards.code`), and an
arithmetic check of worked maths answers (:mod:`smcspec.rewards.arithmetic`)."""

from smcspec.rewards.arithmetic import arithmetic_reward, check_arithmetic, false_equations
from smcspec.rewards.code import (
    CodeExamples,
    Example,
    code_of_prompt,
    examples_from_prompt,
    examples_from_tests,
)

__all__ = [
    "CodeExamples",
    "Example",
    "arithmetic_reward",
    "check_arithmetic",
    "code_of_prompt",
    "examples_from_prompt",
    "examples_from_tests",
    "false_equations",
]
