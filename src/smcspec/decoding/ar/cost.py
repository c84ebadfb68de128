"""The ``ar`` round as the roofline sees it (:mod:`smcspec.decoding.rounds`): one target
forward of 1 token (1 row); 1 token a round."""

from __future__ import annotations

from smcspec.decoding.rounds import RoundCosts, Shape


def ar_shapes(n: int, k: int) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
    """Target and draft forwards of an ``ar`` round."""
    return ((1, 1),), ()


def ar_cost(n: int, k: int, c: RoundCosts, distinct: float = 1.0) -> tuple[float, float]:
    """Tokens and seconds of an ``ar`` round: one token, one target forward."""
    return 1.0, c.target[(1, 1)]
