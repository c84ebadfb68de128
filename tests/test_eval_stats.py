"""Statistics against hand-computed values (tolerances stated per check)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from smcspec.eval.stats import (
    empirical,
    kl_divergence,
    margin_verdict,
    mcnemar_pvalue,
    paired_bootstrap_diff,
    paired_exact_interval,
    pairs_for_half_width,
    total_variation,
    wilcoxon_pvalue,
    wilson_interval,
)


def test_wilson_known_value() -> None:
    # 8/10 at 95%: textbook Wilson interval (0.4902, 0.9433) (e.g. Newcombe 1998, method 3).
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4)
    assert high == pytest.approx(0.9433, abs=1e-4)
    # and the closed form with z = 1.959964 (tolerance 1e-9)
    z, n, p = 1.959963984540054, 10, 0.8
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    assert (low, high) == pytest.approx((centre - half, centre + half), abs=1e-9)


def test_wilson_edges() -> None:
    low, high = wilson_interval(0, 20)
    assert low == pytest.approx(0.0, abs=1e-12) and 0.0 < high < 0.2
    assert wilson_interval(0, 0) == (0.0, 1.0)
    w90 = wilson_interval(8, 10, confidence=0.90)
    w95 = wilson_interval(8, 10)
    assert w95[0] < w90[0] < w90[1] < w95[1]
    for bad in [(11, 10, 0.95), (-1, 10, 0.95), (5, 10, 1.0)]:
        with pytest.raises(ValueError):
            wilson_interval(*bad)


def test_paired_bootstrap_known_difference() -> None:
    # 200 items, a right on 100; b = a with 20 wrong items flipped to right -> +0.10 exactly.
    a = np.zeros(200, dtype=bool)
    a[::2] = True
    b = a.copy()
    b[np.flatnonzero(~a)[:20]] = True
    mean, low, high = paired_bootstrap_diff(a.tolist(), b.tolist(), n_boot=4000, seed=0)
    assert mean == pytest.approx(0.10, abs=1e-12)
    assert low < 0.10 < high
    assert low > 0.0  # 20 one-sided discordant pairs: clearly significant
    # SE of the mean is sqrt(0.1*0.9/200) = 0.0212; a 95% interval is about +-0.042 (tol 0.015)
    assert high - low == pytest.approx(2 * 1.96 * math.sqrt(0.09 / 200), abs=0.015)
    assert paired_bootstrap_diff(a, b, n_boot=4000, seed=0) == (mean, low, high)  # seeded


def test_paired_bootstrap_degenerate_and_errors() -> None:
    assert paired_bootstrap_diff([1, 0, 1], [1, 0, 1]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        paired_bootstrap_diff([1, 0], [1])
    with pytest.raises(ValueError):
        paired_bootstrap_diff([], [])


def test_mcnemar_hand_computed() -> None:
    # 8 pairs wrong->right, 2 right->wrong, 5 concordant: p = 2 * (1+10+45)/2^10 = 0.109375
    a = [False] * 8 + [True] * 2 + [True] * 3 + [False] * 2
    b = [True] * 8 + [False] * 2 + [True] * 3 + [False] * 2
    assert mcnemar_pvalue(a, b) == pytest.approx(112 / 1024, abs=1e-12)
    assert mcnemar_pvalue(b, a) == pytest.approx(112 / 1024, abs=1e-12)
    assert mcnemar_pvalue([True, False], [True, False]) == 1.0
    # 10 vs 0 discordant: p = 2 / 2^10
    assert mcnemar_pvalue([False] * 10, [True] * 10) == pytest.approx(2 / 1024, abs=1e-12)
    with pytest.raises(ValueError):
        mcnemar_pvalue([0.5], [1])


def test_tv_and_kl_hand_computed() -> None:
    p = {"a": 0.5, "b": 0.5}
    q = {"a": 0.25, "b": 0.75}
    assert total_variation(p, q) == pytest.approx(0.25, abs=1e-12)
    expected = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)  # 0.143841 nats
    assert kl_divergence(p, q) == pytest.approx(expected, abs=1e-9)
    assert kl_divergence(p, q, eps=0.0) == pytest.approx(expected, abs=1e-15)
    assert kl_divergence(p, p) == pytest.approx(0.0, abs=1e-12)


def test_tv_kl_missing_outcomes() -> None:
    p = {"a": 1.0}
    q = {"b": 1.0}
    assert total_variation(p, q) == pytest.approx(1.0, abs=1e-12)
    assert kl_divergence(p, q, eps=0.0) == math.inf
    # smoothed: q'(a) = eps / (1 + 2 eps) -> KL = ln((1 + 2 eps) / eps), finite (tol 1e-9)
    eps = 1e-6
    assert kl_divergence(p, q, eps=eps) == pytest.approx(math.log((1 + 2 * eps) / eps), abs=1e-9)
    # outcomes with p = 0 contribute nothing
    assert kl_divergence({"a": 1.0, "b": 0.0}, {"a": 1.0}, eps=0.0) == 0.0
    with pytest.raises(ValueError):
        total_variation({"a": 0.5}, {"a": 1.0})
    with pytest.raises(ValueError):
        kl_divergence(p, q, eps=-1.0)


def test_empirical() -> None:
    assert empirical({"x": 1, "y": 3}) == {"x": 0.25, "y": 0.75}
    with pytest.raises(ValueError):
        empirical({"x": 0})
    with pytest.raises(ValueError):
        empirical({"x": -1, "y": 2})


def test_wilcoxon_hand_computed() -> None:
    # five positive differences 1..5: the exact two-sided p is 2 / 2^5
    a = [0.0, 0.0, 0.0, 0.0, 0.0]
    b = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert wilcoxon_pvalue(a, b) == pytest.approx(2 / 32, abs=1e-12)
    assert wilcoxon_pvalue(b, a) == pytest.approx(2 / 32, abs=1e-12)
    # signs +1, -2, +3, -4, +5: W- = 6; 13 of the 32 sign patterns have a rank sum <= 6
    # (sums 0..6 of subsets of {1..5}: 1+1+1+2+2+3+3), so the two-sided p is 2 * 13/32
    assert wilcoxon_pvalue(a, [1.0, -2.0, 3.0, -4.0, 5.0]) == pytest.approx(26 / 32, abs=1e-12)
    assert wilcoxon_pvalue([0.1, 0.2], [0.1, 0.2]) == 1.0
    with pytest.raises(ValueError):
        wilcoxon_pvalue([1.0], [1.0, 2.0])


def test_pairs_for_half_width_gives_the_interval_it_promises() -> None:
    # 10% discordant pairs, all one way: s^2 = (d - diff^2) * n / (n - 1)
    a = np.zeros(200, dtype=bool)
    b = a.copy()
    b[:20] = True
    z = 1.959963984540054
    need = pairs_for_half_width(a, b, 0.03)
    assert need == math.ceil(z**2 * (0.10 - 0.01) * 200 / 199 / 0.03**2)  # 387
    # the same pattern at that many pairs: the bootstrap interval is about +-3 points wide
    reps = int(np.ceil(need / 200))
    big_a, big_b = np.tile(a, reps)[:need], np.tile(b, reps)[:need]
    _, low, high = paired_bootstrap_diff(big_a, big_b, n_boot=4000, seed=0)
    assert (high - low) / 2 == pytest.approx(0.03, rel=0.1)
    assert pairs_for_half_width([1, 1], [1, 1], 0.03) == 2  # no spread: nothing to plan from
    with pytest.raises(ValueError):
        pairs_for_half_width(a, b, 0.0)


def test_margin_verdict() -> None:
    assert margin_verdict(-0.02, 0.05, 0.03) == "met"
    assert margin_verdict(-0.03, 0.05, 0.03) == "met"  # the bound itself counts
    assert margin_verdict(-0.10, -0.04, 0.03) == "not met"
    assert margin_verdict(-0.10, 0.01, 0.03) == "not decidable"
    with pytest.raises(ValueError):
        margin_verdict(0.1, -0.1, 0.03)


def test_paired_exact_interval_hand_computed() -> None:
    """2 discordant pairs, both gained, 18 pairs: Clopper-Pearson for 2 of 2 is
    [0.025^(1/2), 1], so the difference lies in [2/18 (2 sqrt(0.025) - 1), 2/18]: it crosses
    0, where the paired bootstrap's interval is [0, 2/18 + ...] (no resample goes below 0)."""
    low, high = paired_exact_interval(0, 2, 18)
    assert low == pytest.approx(2 / 18 * (2 * math.sqrt(0.025) - 1))  # -0.0760
    assert high == pytest.approx(2 / 18)
    _, boot_low, _ = paired_bootstrap_diff([0] * 18, [1, 1] + [0] * 16)
    assert boot_low == 0.0 and low < -0.03
    # symmetric: 3 lost of 3 mirrors 3 gained of 3
    assert paired_exact_interval(3, 0, 50) == pytest.approx(
        tuple(-x for x in reversed(paired_exact_interval(0, 3, 50)))
    )
    assert paired_exact_interval(0, 0, 10) == (0.0, 0.0)
    with pytest.raises(ValueError):
        paired_exact_interval(5, 6, 10)
