"""The SMC-SD round as the roofline sees it (:mod:`smcspec.decoding.rounds`): K draft
forwards of N rows (the first with 2 tokens a row: the deferred bonus), one target forward of
N x (K+1) tokens; a round yields K+1 tokens (Emara et al. 2026, arXiv:2604.15672). With
distinct rows a forward computes only the fraction ``distinct`` of its rows, priced by
interpolating the measured seconds in the rows
(:func:`~smcspec.decoding.rounds.seconds_for_rows`)."""

from __future__ import annotations

from smcspec.decoding.rounds import RoundCosts, Shape, seconds_for_rows


def smc_shapes(n: int, k: int) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
    """Target and draft forwards of an SMC-SD round of N particles and K drafts."""
    return ((n, k + 1),), ((n, 1), (n, 2))


def smc_cost(n: int, k: int, c: RoundCosts, distinct: float = 1.0) -> tuple[float, float]:
    """Tokens (K+1) and seconds of an SMC-SD round whose forwards compute the fraction
    ``distinct`` of their rows (at most what every row costs)."""
    d, t = c.draft, c.target
    every = (k - 1) * d[(n, 1)] + d[(n, 2)] + t[(n, k + 1)]
    if distinct == 1.0:
        return float(k + 1), every
    seconds = (
        (k - 1) * seconds_for_rows(d, distinct * n)
        + seconds_for_rows(d, 2 * distinct * n)
        + seconds_for_rows(t, distinct * n * (k + 1))
    )
    return float(k + 1), min(seconds, every)
