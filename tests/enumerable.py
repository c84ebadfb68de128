"""Tiny enumerable models for the statistical tests (shared with the fidelity harness)."""

from __future__ import annotations

import math

from smcspec.eval.fidelity import sequence_log_probs, tiny_transformer

__all__ = ["chisquare_p", "sequence_log_probs", "tiny_transformer", "total_variation"]


def total_variation(p: dict, counts: dict, n: int) -> float:
    """TV distance between an exact distribution ``p`` (log-probs) and empirical counts."""
    keys = set(p) | set(counts)
    return 0.5 * sum(abs(math.exp(p.get(k, -math.inf)) - counts.get(k, 0) / n) for k in keys)


def chisquare_p(exact: dict, counts, runs: int) -> float:
    """Chi-square goodness-of-fit p-value of ``counts`` against exact log-probs ``exact``."""
    from scipy.stats import chisquare

    keys = sorted(exact)
    expected = [math.exp(exact[k]) * runs for k in keys]
    observed = [counts.get(k, 0) for k in keys]
    scale = sum(observed) / sum(expected)  # exact probs sum to 1 up to rounding
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)
