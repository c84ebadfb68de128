"""A token-level automaton constraint for models without a tokenizer (the enumerable ones).

:class:`NextTokenAutomaton` implements :class:`smcspec.potentials.TokenConstraint` with a
table ``last token -> allowed next tokens`` (a DFA whose state is the last token). The
decoders only see that interface, so it stands in for the llguidance-backed constraints in
the exact fidelity evaluation (:mod:`smcspec.eval.fidelity`) and the statistical tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from smcspec.potentials import ConstraintState, DeadEndError, TokenConstraint

__all__ = ["NextTokenAutomaton"]


class NextTokenAutomaton(TokenConstraint):
    """A DFA over token ids whose state is the last generated token.

    Args:
        table: ``table[None]``: the allowed first tokens; ``table[t]``: the tokens allowed
            after ``t``. Every state accepts (the language is prefix-closed); a state with
            no allowed token is a dead end.
        vocab_size: masks are bool ``[vocab_size]``.
        refused: pairs ``(last, token)`` the mask allows but :meth:`_State.consume` refuses
            with :class:`DeadEndError` (an inexact mask, as a grammar library's can be).

    Attributes:
        masks: ``last -> bool [vocab_size]`` (CPU), built once from ``table``.
        calls: how many masks were computed (``allowed()`` calls), to measure their cost.
    """

    def __init__(
        self,
        table: dict[int | None, set[int]],
        vocab_size: int,
        refused: frozenset[tuple[int | None, int]] = frozenset(),
    ) -> None:
        self.table, self.vocab_size, self.refused = table, vocab_size, refused
        self.masks = {
            key: torch.tensor([v in allowed for v in range(vocab_size)], dtype=torch.bool)
            for key, allowed in table.items()
        }
        self.calls = 0

    def start(self) -> ConstraintState:
        """The state before any generated token (a fresh history)."""
        return _State(self, [])

    def allows(self, seq: Sequence[int]) -> bool:
        """Whether every token of ``seq`` is allowed after its prefix (``seq`` in A).

        Pairs in ``refused`` count as allowed here (the mask's view, not the matcher's).
        """
        return all(t in self.table[seq[i - 1] if i else None] for i, t in enumerate(seq))


class _State(ConstraintState):
    """One particle's history in a :class:`NextTokenAutomaton`."""

    def __init__(self, dfa: NextTokenAutomaton, history: list[int]) -> None:
        self.dfa, self.history = dfa, history

    def allowed(self) -> torch.Tensor:
        self.dfa.calls += 1
        return self.dfa.masks[self.history[-1] if self.history else None].clone()

    def consume(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            last = self.history[-1] if self.history else None
            if not bool(self.dfa.masks[last][t]) or (last, t) in self.dfa.refused:
                raise DeadEndError(f"token {t} not allowed after {self.history}")
            self.history.append(int(t))

    def rollback(self, n: int) -> None:
        if n > 0:
            del self.history[-n:]

    def copy(self) -> ConstraintState:
        return _State(self.dfa, list(self.history))

    def is_accepting(self) -> bool:
        return True
