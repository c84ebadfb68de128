"""Each decoder's round as the roofline sees it: the forwards it issues and what they cost.

Written once, for the tuner's predictions (:mod:`smcspec.tuning.predict`) and the roofline
beside every benchmark (:mod:`smcspec.eval.roofline`); the decoder table
(:mod:`smcspec.decoding.registry`) hands each decoder its own. A round, in the forwards the
decoders issue:

* ``ar``: one target forward of 1 token (1 row); 1 token a round.
* ``sd`` (K): K draft forwards of 1 row, the first of them with 2 tokens when the previous
  round accepted every draft (deferred feeding, :mod:`smcspec.decoding.sd.chain`) and 1 token
  otherwise, then one target forward of K+1 tokens. Expected tokens a round with per-token
  acceptance probability ``alpha`` (Leviathan et al. 2023, "Fast Inference from
  Transformers via Speculative Decoding", eq. 1): ``(1 - alpha^(K+1)) / (1 - alpha)``; the
  first draft forward has 2 tokens with probability ``alpha^K``.
* ``sd`` with n-gram drafts (K; no draft model): priced *at its gate's threshold*: one drafted
  token accepted with probability ``p_min``, ``1 + p_min`` tokens for a 2-token target
  forward (:mod:`smcspec.tuning.predict`'s notes say why).
* ``sd`` with N >= 2 chains (multi-draft): SMC-SD's forwards; its tokens a round (the
  accepted depth plus one) are measured, not modelled (:func:`multi_sd_cost`).
* ``smc`` (N, K): K draft forwards of N rows (the first with 2 tokens a row: the deferred
  bonus), one target forward of N x (K+1) tokens; a round yields K+1 tokens (Emara et al.
  2026, arXiv:2604.15672). With distinct rows a forward computes only the fraction
  ``distinct`` of its rows, priced by interpolating the measured seconds in the rows
  (:func:`seconds_for_rows`).

Costs are given as ``{(rows, tokens): seconds}`` maps of measured decode forwards, one for
the target and one for the draft (:class:`RoundCosts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from smcspec.errors import ConfigError

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


def sd_tokens_per_round(alpha: float, k: int) -> float:
    """Expected tokens of one sd round, ``(1 - alpha^(K+1)) / (1 - alpha)`` (K+1 at alpha 1).

    Leviathan et al. 2023, eq. 1: accepted drafts plus the target's own token.
    """
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


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


# ------------------------------------------------------------------ the decoders
def ar_shapes(n: int, k: int) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
    """Target and draft forwards of an ``ar`` round."""
    return ((1, 1),), ()


def ar_cost(n: int, k: int, c: RoundCosts, distinct: float = 1.0) -> tuple[float, float]:
    """Tokens and seconds of an ``ar`` round: one token, one target forward."""
    return 1.0, c.target[(1, 1)]


def sd_shapes(n: int, k: int) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
    """Target and draft forwards of an ``sd`` round of K drafts."""
    return ((1, k + 1),), ((1, 1), (1, 2))


def sd_cost(n: int, k: int, c: RoundCosts, distinct: float = 1.0) -> tuple[float, float]:
    """Expected tokens and seconds of an ``sd`` round at the measured ``alpha``.

    Raises:
        ConfigError: ``alpha`` was not measured.
    """
    if c.alpha is None:
        raise ConfigError("an sd prediction needs the measured acceptance alpha")
    all_accepted = c.alpha**k  # the next round's first draft forward has 2 tokens
    first = all_accepted * c.draft[(1, 2)] + (1 - all_accepted) * c.draft[(1, 1)]
    seconds = (k - 1) * c.draft[(1, 1)] + first + c.target[(1, k + 1)]
    return sd_tokens_per_round(c.alpha, k), seconds


def ngram_shapes(n: int, k: int) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
    """The one- and two-row target forwards that price n-gram sd's gate; no draft model."""
    return ((1, 1), (1, 2)), ()


def ngram_cost(n: int, k: int, c: RoundCosts, distinct: float = 1.0) -> tuple[float, float]:
    """n-gram sd at its gate's threshold: one drafted token accepted with probability
    ``p_min``, ``1 + p_min`` tokens for a two-token target forward."""
    return 1.0 + c.p_min, c.target[(1, 2)]


def multi_sd_cost(n: int, k: int, c: RoundCosts, distinct: float = 1.0) -> tuple[float, float]:
    """Tokens and seconds of a multi-draft sd round of N chains and K drafts: its forwards
    are SMC-SD's (:func:`smc_cost`: the tree's distinct rows at the fraction ``distinct``);
    its tokens a round, accepted depth plus one, are the measured ``c.multi_tokens[(n, k)]``
    (recursive rejection's acceptance depends on how the draft's and the target's
    distributions overlap at every node, which the chain ``alpha`` does not give).

    Raises:
        ConfigError: that setting's tokens a round were not measured.
    """
    if (n, k) not in c.multi_tokens:
        raise ConfigError(
            f"a multi-draft sd prediction (N={n} K={k}) needs its measured tokens a round"
        )
    return c.multi_tokens[(n, k)], smc_cost(n, k, c, distinct)[1]


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
