"""Answers aggregated over particles: the weighted vote (``--aggregate vote``).

SMC-SD ends with N weighted particles (the banked ones, or the running ones under the
``keep`` rule) whose weights estimate the target's distribution over whole answers. The
single drawn answer is one sample of it; the weighted vote returns its *mode* over an answer
extracted from each particle (the number of a maths answer, the behaviour of code on its
examples): ``argmax_a sum_i w_i 1[a(x_i) = a]``, the particle-filter form of
self-consistency (Wang et al. 2023, "Self-Consistency Improves Chain of Thought Reasoning";
Puri et al. 2025, arXiv:2502.01618, weighted majority over particles).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from smcspec.errors import ConfigError

__all__ = ["NUMBER_PATTERN", "Vote", "VoteResult", "weighted_vote"]

AGGREGATES = ("none", "vote")
MATCH_TIMEOUT_S = 0.25
"""The longest one answer regex may run on one particle's text (seconds)."""
NUMBER_PATTERN = r"-?\d[\d,]*(?:\.\d+)?"
"""The default answer of ``Vote.regex()``: the last number in the text (commas dropped)."""


@dataclass(frozen=True)
class VoteResult:
    """The winner of a weighted vote.

    Attributes:
        answer: the winning extracted answer.
        share: its share of the voting weight, in (0, 1] (the weight of particles with no
            answer is left out).
        index: the particle that carries it with the largest weight (its text is returned).
        answers: how many distinct answers received weight.
    """

    answer: Hashable
    share: float
    index: int
    answers: int


def weighted_vote(
    answers: Sequence[Hashable | None], weights: Sequence[float]
) -> VoteResult | None:
    """The weighted mode of ``answers``: the answer whose particles carry the most weight.

    Args:
        answers: one extracted answer per particle; None for a particle without one.
        weights: the particles' normalised (or any non-negative, finite) weights.

    Returns:
        The winner (ties go to the answer whose first particle with positive weight comes
        first), or None when no particle with positive weight has an answer.

    Raises:
        ValueError: lengths differ, or a weight is negative or not finite.
    """
    if len(answers) != len(weights):
        raise ValueError(f"{len(answers)} answers for {len(weights)} weights")
    totals: dict[Hashable, float] = {}
    best: dict[Hashable, int] = {}
    for i, (a, w) in enumerate(zip(answers, weights, strict=True)):
        if not (math.isfinite(w) and w >= 0):
            raise ValueError(f"weights must be finite and >= 0, got {w}")
        if a is None or w == 0:
            continue
        totals[a] = totals.get(a, 0.0) + w
        if a not in best or w > weights[best[a]]:
            best[a] = i
    if not totals:
        return None
    winner = max(totals, key=totals.__getitem__)  # first maximum in insertion order
    return VoteResult(winner, totals[winner] / sum(totals.values()), best[winner], len(totals))


@dataclass(frozen=True)
class Vote:
    """Ask for the weighted vote over a request's particles (smc only).

    Attributes:
        answer_fn: the answer of one particle's text (None: it has none).
        description: what the answer is, for reports (e.g. the regex).
    Build it with :meth:`regex` for a text answer.
    """

    answer_fn: Callable[[str], Hashable | None]
    description: str = "custom"

    @classmethod
    def regex(cls, pattern: str = NUMBER_PATTERN, timeout_s: float = MATCH_TIMEOUT_S) -> Vote:
        """The answer is the last match of ``pattern`` (its first group if it has one),
        stripped, with thousands separators dropped when it is a number.

        The pattern may come from a remote client (the server's ``smc.answer_regex``), so it
        runs in the ``regex`` package, which guards against catastrophic backtracking, under
        a time limit per text: a text whose match runs past ``timeout_s`` has no answer,
        instead of stalling the worker that decodes every request.

        Raises:
            ConfigError: ``pattern`` is not a valid regular expression (Python's syntax).
        """
        import regex

        try:
            compiled = regex.compile(pattern)
        except (regex.error, TypeError) as e:
            raise ConfigError(f"invalid answer_regex: {e}") from e

        def last_match(text: str) -> str | None:
            try:
                found = list(compiled.finditer(text, timeout=timeout_s))
            except TimeoutError:
                return None
            if not found:
                return None
            m = found[-1]
            answer = (m.group(1) if compiled.groups else m.group(0)) or ""
            answer = answer.strip()
            if re.fullmatch(NUMBER_PATTERN, answer):
                answer = answer.replace(",", "")
            return answer or None

        return cls(last_match, f"regex {pattern}")

    def tally(self, texts: Sequence[str], weights: Sequence[float]) -> VoteResult | None:
        """:func:`weighted_vote` over ``answer_fn`` of each text."""
        return weighted_vote([self.answer_fn(t) for t in texts], weights)
