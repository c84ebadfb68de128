"""A decoder's round as the roofline sees it: the forwards it issues and what they cost.

Written once, for the tuner's predictions (:mod:`smcspec.tuning.predict`) and the roofline
beside every benchmark (:mod:`smcspec.eval.roofline`); the decoder table
(:mod:`smcspec.decoding.registry`) hands each decoder its own, which lies beside its program:
:mod:`smcspec.decoding.ar.cost` (one target forward a token),
:mod:`smcspec.decoding.sd.cost` (chain, n-gram and multi-draft sd) and
:mod:`smcspec.decoding.smc.cost` (SMC-SD). Each gives ``shapes(n, k)``, the ``(rows,
tokens)`` of a round's target and draft forwards, and ``cost(n, k, costs, distinct)``, its
tokens and seconds.

Costs are given as ``{(rows, tokens): seconds}`` maps of measured decode forwards, one for
the target and one for the draft (:class:`RoundCosts`); this module holds that shared
machinery, and the forwards of the round two decoders share: K tokens drafted on each of N
rows, then the target over all of them (SMC-SD's particles, multi-draft sd's chains;
:func:`drafted_rows_shapes`, :func:`drafted_rows_seconds`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

Shape = tuple[int, int]
"""``(rows, tokens)`` of one decode forward."""


@dataclass(frozen=True)
class RoundCosts:
    """What a round's price needs: median seconds of the measured forwards by shape, the
    draft's acceptance ``alpha`` (sd; None: not measured), the n-gram gate's ``p_min`` and
    multi-draft sd's measured tokens a round by ``(N, K)`` (``multi_tokens``; a setting not
    in it is not priced)."""

    target: Mapping[Shape, float]
    draft: Mapping[Shape, float]
    alpha: float | None = None
    p_min: float = 0.0
    multi_tokens: Mapping[Shape, float] = field(default_factory=dict)


def seconds_for_rows(costs: Mapping[Shape, float], rows: float) -> float:
    """Seconds of one forward of ``rows`` rows, interpolated (linearly, clamped at the ends)
    in the measured forwards of ``costs`` by their ``rows x tokens``; where several shapes
    have the same row count, their mean."""
    by_rows: dict[int, list[float]] = {}
    for (r, t), s in costs.items():
        by_rows.setdefault(r * t, []).append(s)
    xs = sorted(by_rows)
    ys = [sum(by_rows[x]) / len(by_rows[x]) for x in xs]
    return float(np.interp(rows, xs, ys))


def drafted_rows_shapes(n: int, k: int) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
    """Target and draft forwards of a round that drafts K tokens on each of N rows: K draft
    forwards of N rows, the first with 2 tokens a row (the token the previous round ended
    with fed late), then one target forward of N x (K+1) tokens. SMC-SD's round of N
    particles (Emara et al. 2026, arXiv:2604.15672) and multi-draft sd's of N chains."""
    return ((n, k + 1),), ((n, 1), (n, 2))


def drafted_rows_seconds(n: int, k: int, c: RoundCosts, distinct: float = 1.0) -> float:
    """Seconds of the forwards of :func:`drafted_rows_shapes` when each computes the fraction
    ``distinct`` of its rows (distinct rows, :mod:`smcspec.backends.shared_rows`), priced by
    :func:`seconds_for_rows`; at most what every row costs.

    Raises:
        KeyError: ``c`` lacks a measured shape of :func:`drafted_rows_shapes`.
    """
    d, t = c.draft, c.target
    every = (k - 1) * d[(n, 1)] + d[(n, 2)] + t[(n, k + 1)]
    if distinct == 1.0:
        return every
    seconds = (
        (k - 1) * seconds_for_rows(d, distinct * n)
        + seconds_for_rows(d, 2 * distinct * n)
        + seconds_for_rows(t, distinct * n * (k + 1))
    )
    return min(seconds, every)
