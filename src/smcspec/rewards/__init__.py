"""Rewards that steer SMC-SD's particles (``exp(beta * R(x))``, :class:`smcspec.potentials.Reward`):
an execution reward on the examples a code prompt gives (:mod:`smcspec.rewards.code`)."""

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
    "code_of_prompt",
    "examples_from_prompt",
    "examples_from_tests",
]
