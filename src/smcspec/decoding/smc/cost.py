"""The SMC-SD round as the roofline sees it (:mod:`smcspec.decoding.rounds`): K draft
forwards of N rows (the first with 2 tokens a row: the deferred bonus), one target forward of
N x (K+1) tokens, the round every decoder drafting on N rows issues
(:func:`~smcspec.decoding.rounds.drafted_rows_shapes`); a round yields K+1 tokens (Emara et al.
2026, arXiv:2604.15672). With distinct rows a forward computes only the fraction ``distinct``
of its rows (:func:`~smcspec.decoding.rounds.drafted_rows_seconds`)."""

from __future__ import annotations

from smcspec.decoding.rounds import RoundCosts, Shape, drafted_rows_seconds, drafted_rows_shapes


def smc_shapes(n: int, k: int) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
    """Target and draft forwards of an SMC-SD round of N particles and K drafts."""
    return drafted_rows_shapes(n, k)


def smc_cost(n: int, k: int, c: RoundCosts, distinct: float = 1.0) -> tuple[float, float]:
    """Tokens (K+1) and seconds of an SMC-SD round whose forwards compute the fraction
    ``distinct`` of their rows (at most what every row costs)."""
    return float(k + 1), drafted_rows_seconds(n, k, c, distinct)
