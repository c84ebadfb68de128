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
machinery.
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
