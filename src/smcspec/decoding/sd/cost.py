"""sd's rounds as the roofline sees them (:mod:`smcspec.decoding.rounds`):

* chain sd (K): K draft forwards of 1 row, the first of them with 2 tokens when the previous
  round accepted every draft (deferred feeding, :mod:`smcspec.decoding.sd.chain`) and 1
  token otherwise, then one target forward of K+1 tokens. Expected tokens a round with
  per-token acceptance probability ``alpha`` (Leviathan et al. 2023, "Fast Inference from
  Transformers via Speculative Decoding", eq. 1): ``(1 - alpha^(K+1)) / (1 - alpha)``; the
  first draft forward has 2 tokens with probability ``alpha^K``.
* n-gram drafts (K; no draft model): priced *at its gate's threshold*: one drafted token
  accepted with probability ``p_min``, ``1 + p_min`` tokens for a 2-token target forward
  (:mod:`smcspec.tuning.predict`'s notes say why).
* N >= 2 chains (multi-draft): K tokens drafted on each of N rows, as SMC-SD drafts on its
  particles (:func:`smcspec.decoding.rounds.drafted_rows_shapes`); its tokens a round (the
  accepted depth plus one) are measured, not modelled (:func:`multi_sd_cost`).
"""

from __future__ import annotations

from smcspec.decoding.rounds import RoundCosts, Shape, drafted_rows_seconds, drafted_rows_shapes
from smcspec.errors import ConfigError


def sd_tokens_per_round(alpha: float, k: int) -> float:
    """Expected tokens of one sd round, ``(1 - alpha^(K+1)) / (1 - alpha)`` (K+1 at alpha 1).

    Leviathan et al. 2023, eq. 1: accepted drafts plus the target's own token.
    """
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


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


def multi_sd_shapes(n: int, k: int) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
    """Target and draft forwards of a multi-draft sd round of N chains and K drafts
    (:func:`~smcspec.decoding.rounds.drafted_rows_shapes`)."""
    return drafted_rows_shapes(n, k)


def multi_sd_cost(n: int, k: int, c: RoundCosts, distinct: float = 1.0) -> tuple[float, float]:
    """Tokens and seconds of a multi-draft sd round of N chains and K drafts: its forwards
    priced by :func:`~smcspec.decoding.rounds.drafted_rows_seconds` (the tree's distinct
    rows at the fraction ``distinct``); its tokens a round, accepted depth plus one, are the
    measured ``c.multi_tokens[(n, k)]`` (recursive rejection's acceptance depends on how the
    draft's and the target's distributions overlap at every node, which the chain ``alpha``
    does not give).

    Raises:
        ConfigError: that setting's tokens a round were not measured.
    """
    if (n, k) not in c.multi_tokens:
        raise ConfigError(
            f"a multi-draft sd prediction (N={n} K={k}) needs its measured tokens a round"
        )
    return c.multi_tokens[(n, k)], drafted_rows_seconds(n, k, c, distinct)
