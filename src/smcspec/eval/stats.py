"""Statistics for comparing decoding methods: intervals, paired tests, distribution distances.

All probabilities are plain floats in [0, 1]; logarithms are natural (KL in nats).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np
from scipy import stats
from scipy.special import rel_entr

__all__ = [
    "empirical",
    "kl_divergence",
    "margin_verdict",
    "mcnemar_pvalue",
    "paired_bootstrap_diff",
    "paired_exact_interval",
    "pairs_for_half_width",
    "total_variation",
    "wilcoxon_pvalue",
    "wilson_interval",
]

_SUM_TOL = 1e-6


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927, JASA 22:209).

    ``p = k/n``, ``z`` the ``(1+confidence)/2`` normal quantile; bounds are
    ``(p + z^2/(2n) -+ z*sqrt(p(1-p)/n + z^2/(4n^2))) / (1 + z^2/n)``. Computed with
    ``scipy.stats.binomtest(k, n).proportion_ci(method="wilson")``. ``n == 0`` gives (0, 1).

    Raises:
        ValueError: if ``n < 0``, ``successes`` is outside ``[0, n]`` or ``confidence`` is
            outside (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return (0.0, 1.0)
    ci = stats.binomtest(int(successes), int(n)).proportion_ci(
        confidence_level=confidence, method="wilson"
    )
    return (float(ci.low), float(ci.high))


def _paired(a: Sequence[bool | float], b: Sequence[bool | float]) -> tuple[np.ndarray, ...]:
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"a and b must be 1-D and of equal length, got {x.shape} and {y.shape}")
    if x.size == 0:
        raise ValueError("need at least one pair")
    return x, y


def paired_bootstrap_diff(
    a: Sequence[bool | float],
    b: Sequence[bool | float],
    n_boot: int = 10000,
    seed: int = 0,
    confidence: float = 0.95,
) -> tuple[float, float, float]:
    """Mean paired difference ``mean(b - a)`` with a percentile bootstrap interval.

    Items are resampled with replacement as pairs (Efron & Tibshirani 1993, "An Introduction
    to the Bootstrap", ch. 13, percentile interval); the interval is the
    ``(1-confidence)/2`` and ``(1+confidence)/2`` quantiles of the ``n_boot`` resampled means.
    Uses ``scipy.stats.bootstrap`` (vectorised numpy, batched to bound memory) with a
    ``numpy.random.default_rng(seed)`` generator, so results are reproducible per seed.
    Booleans count as 0/1, so for accuracies the result is in accuracy units (e.g. 0.10 =
    10 percentage points).

    Returns:
        ``(mean_diff, low, high)``; ``low == high == mean_diff`` if all differences are equal.

    Raises:
        ValueError: on unequal lengths, empty input, ``n_boot < 1`` or ``confidence`` outside
            (0, 1).
    """
    x, y = _paired(a, b)
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    d = y - x
    mean = float(d.mean())
    if np.all(d == d[0]):
        return (mean, mean, mean)
    res = stats.bootstrap(
        (d,),
        np.mean,
        n_resamples=n_boot,
        batch=max(1, 2_000_000 // d.size),
        vectorized=True,
        confidence_level=confidence,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    return (mean, float(res.confidence_interval.low), float(res.confidence_interval.high))


def mcnemar_pvalue(a: Sequence[bool], b: Sequence[bool]) -> float:
    """Two-sided exact McNemar test of paired binary outcomes (McNemar 1947, Psychometrika 12).

    With ``n01`` = #items wrong in ``a`` and right in ``b`` and ``n10`` the reverse, the p-value
    is ``scipy.stats.binomtest(n01, n01 + n10, 0.5).pvalue`` (two-sided). No discordant pairs
    gives 1.0.

    Raises:
        ValueError: on unequal lengths, empty input, or values other than 0/1/True/False.
    """
    x, y = _paired(a, b)
    if not (np.isin(x, (0.0, 1.0)).all() and np.isin(y, (0.0, 1.0)).all()):
        raise ValueError("mcnemar_pvalue needs binary outcomes (bool or 0/1)")
    n01 = int(np.sum((x == 0) & (y == 1)))
    n10 = int(np.sum((x == 1) & (y == 0)))
    if n01 + n10 == 0:
        return 1.0
    return float(stats.binomtest(n01, n01 + n10, 0.5, alternative="two-sided").pvalue)


def paired_exact_interval(
    lost: int, gained: int, n: int, confidence: float = 0.95
) -> tuple[float, float]:
    """Exact interval for a paired accuracy difference ``(gained - lost) / n``, conditional
    on the ``lost + gained`` discordant pairs, as McNemar's exact test conditions on them.

    Given ``d = lost + gained``, ``gained ~ Binomial(d, pi)`` and the difference is
    ``d (2 pi - 1) / n``; the Clopper-Pearson interval for ``pi`` (Clopper & Pearson 1934,
    Biometrika 26:404; ``scipy.stats.binomtest(gained, d).proportion_ci(method="exact")``) is
    mapped through it. Unlike the paired bootstrap it crosses 0 when every discordant pair
    goes one way and there are few of them (the bootstrap's resamples then never do).

    Returns:
        ``(low, high)`` in accuracy units; ``(0.0, 0.0)`` when ``d == 0``.

    Raises:
        ValueError: if a count is negative, ``lost + gained > n``, or ``confidence`` is
            outside (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if min(lost, gained) < 0 or lost + gained > n or n < 1:
        raise ValueError(
            f"need 0 <= lost, gained and lost + gained <= n, got {lost}, {gained}, {n}"
        )
    d = lost + gained
    if d == 0:
        return (0.0, 0.0)
    ci = stats.binomtest(int(gained), int(d)).proportion_ci(
        confidence_level=confidence, method="exact"
    )
    return (d * (2 * float(ci.low) - 1) / n, d * (2 * float(ci.high) - 1) / n)


def wilcoxon_pvalue(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided Wilcoxon signed-rank test of paired values (Wilcoxon 1945, Biometrics
    Bulletin 1:80): do the differences ``b - a`` centre on zero? ``scipy.stats.wilcoxon``
    (zero differences dropped, Wilcoxon's rule; exact or normal-approximated as scipy
    chooses for the sample size). All differences zero gives 1.0.

    Raises:
        ValueError: on unequal lengths or empty input.
    """
    x, y = _paired(a, b)
    if np.all(y == x):
        return 1.0
    return float(stats.wilcoxon(y, x, zero_method="wilcox").pvalue)


def pairs_for_half_width(
    a: Sequence[bool | float],
    b: Sequence[bool | float],
    half_width: float,
    confidence: float = 0.95,
) -> int:
    """How many pairs a normal-approximation interval for ``mean(b - a)`` needs to be
    ``+-half_width`` wide, at the spread of the differences observed: ``ceil((z s / h)^2)``
    with ``s`` the sample standard deviation of ``b - a`` and ``z`` the normal quantile.

    For binary outcomes ``s^2 ~ d - diff^2`` (``d`` the discordant fraction), so this is the
    usual sample size of a paired-proportion (McNemar) interval. A planning figure: with few
    pairs ``s`` itself is uncertain. No spread (fewer than 2 pairs, or all equal) gives the
    number of pairs already at hand.

    Raises:
        ValueError: on unequal lengths, empty input, ``half_width <= 0`` or ``confidence``
            outside (0, 1).
    """
    x, y = _paired(a, b)
    if not half_width > 0:
        raise ValueError(f"half_width must be > 0, got {half_width}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    d = y - x
    if d.size < 2 or np.all(d == d[0]):
        return int(d.size)
    z = float(stats.norm.ppf((1 + confidence) / 2))
    return int(np.ceil((z * float(d.std(ddof=1)) / half_width) ** 2))


def margin_verdict(low: float, high: float, margin: float) -> str:
    """A claim "``b`` is within ``margin`` of ``a``" (a non-inferiority margin, as the SMC-SD
    paper's "within 3% of the target's accuracy") judged on an interval ``[low, high]`` for
    ``b - a``: ``"met"`` when ``low >= -margin``, ``"not met"`` when ``high < -margin``,
    otherwise ``"not decidable"`` (the interval straddles ``-margin``).

    Raises:
        ValueError: if ``low > high`` or ``margin < 0``.
    """
    if low > high or margin < 0:
        raise ValueError(f"need low <= high and margin >= 0, got {low}, {high}, {margin}")
    if low >= -margin:
        return "met"
    if high < -margin:
        return "not met"
    return "not decidable"


def _aligned(
    p: Mapping[Hashable, float], q: Mapping[Hashable, float]
) -> tuple[np.ndarray, np.ndarray]:
    keys = list(dict.fromkeys([*p, *q]))
    pv = np.array([float(p.get(k, 0.0)) for k in keys], dtype=np.float64)
    qv = np.array([float(q.get(k, 0.0)) for k in keys], dtype=np.float64)
    for name, v in (("p", pv), ("q", qv)):
        if v.size == 0 or (v < 0).any() or not np.isfinite(v).all():
            raise ValueError(f"{name} must be a non-empty distribution of finite probabilities")
        if abs(v.sum() - 1.0) > _SUM_TOL:
            raise ValueError(f"{name} sums to {v.sum()}, expected 1 (tolerance {_SUM_TOL})")
    return pv, qv


def total_variation(p: Mapping[Hashable, float], q: Mapping[Hashable, float]) -> float:
    """Total variation distance ``0.5 * sum_x |p(x) - q(x)|`` in [0, 1].

    Outcomes missing from one dict have probability 0 there.

    Raises:
        ValueError: if either is empty, has negative/non-finite entries, or does not sum to 1
            within 1e-6.
    """
    pv, qv = _aligned(p, q)
    return float(0.5 * np.abs(pv - qv).sum())


def kl_divergence(
    p: Mapping[Hashable, float], q: Mapping[Hashable, float], eps: float = 1e-12
) -> float:
    """Kullback-Leibler divergence ``KL(p || q) = sum_x p(x) ln(p(x)/q(x))`` in nats.

    Zero mass: terms with ``p(x) = 0`` contribute 0. ``q`` is smoothed additively over the
    union ``K`` of outcomes of both dicts, ``q'(x) = (q(x) + eps) / (1 + eps*|K|)``, so an
    outcome with ``p(x) > 0`` but ``q(x) = 0`` gives a large finite term (about
    ``p(x) ln(p(x)/eps)``) instead of infinity. With ``eps=0`` there is no smoothing and such
    an outcome gives ``inf``. Computed with ``scipy.special.rel_entr``.

    Raises:
        ValueError: as :func:`total_variation`, or if ``eps < 0``.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    pv, qv = _aligned(p, q)
    qs = (qv + eps) / (1.0 + eps * qv.size)
    return float(rel_entr(pv, qs).sum())


def empirical(counts: Mapping[Hashable, int]) -> dict[Hashable, float]:
    """Empirical distribution ``count / total`` from outcome counts (same keys, same order).

    Raises:
        ValueError: if any count is negative or the total is not positive.
    """
    if any(c < 0 for c in counts.values()):
        raise ValueError("counts must be non-negative")
    total = sum(counts.values())
    if total <= 0:
        raise ValueError("counts must have a positive total")
    return {k: c / total for k, c in counts.items()}
