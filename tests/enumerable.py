"""Tiny enumerable models for the statistical tests (shared with the fidelity harness)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from smcspec.backends.torch.transformer import Transformer
from smcspec.eval.exact import sequence_log_probs, stopped_sequence_log_probs, tiny_transformer

__all__ = [
    "chisquare_p",
    "processed_sequence_log_probs",
    "reference_kept",
    "sequence_log_probs",
    "stopped_sequence_log_probs",
    "tiny_transformer",
    "total_variation",
]


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


def reference_kept(
    p: np.ndarray, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """Kept set (bool ``[V]``) of one distribution ``p`` (float64 ``[V]``), by brute force.

    Independent of :func:`smcspec.sampling.truncation.truncate_log_probs`: the documented
    rules one token at a time. min-p keeps ``p >= min_p * max p``; top-k keeps ``p >=`` the
    k-th largest; then top-p, on ``p`` renormalised over what is kept, keeps a token iff the
    mass of the tokens strictly more likely than it is below ``top_p - 1e-6`` (the
    implementation's tolerance), always keeping the most likely token(s).
    """
    keep = np.ones(p.shape, dtype=bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if 0 < top_k < p.size:
        keep &= p >= np.sort(p)[::-1][top_k - 1]
    if top_p < 1:
        q = np.where(keep, p, 0.0)
        q = q / q.sum()
        above = np.array([q[q > q[v]].sum() for v in range(p.size)])
        keep &= (above < top_p - 1e-6) | (q == q.max())
    return keep


def processed_sequence_log_probs(
    model: Transformer,
    prompt: list[int],
    length: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> dict[tuple[int, ...], float]:
    """Exact ``log prod_t p~(x_t | prompt, x_<t)`` of every sequence of ``length`` tokens.

    ``p~`` is the tempered next-token distribution restricted to its kept set
    (:func:`reference_kept`) and renormalised, step by step; a sequence with a token outside
    a kept set gets ``-inf``. With every filter off this equals :func:`sequence_log_probs`.
    """
    vocab = model.cfg.vocab_size
    out = {}
    with torch.inference_mode():
        for seq in itertools.product(range(vocab), repeat=length):
            cache = model.new_cache(1, length + 1)
            logits = model.prefill(torch.tensor(prompt), cache)[None]
            if length > 1:
                rest = model.decode(torch.tensor([seq[:-1]]), cache)[0]
                logits = torch.cat((logits, rest))
            probs = torch.softmax(logits.double() / temperature, -1).numpy()
            total = 0.0
            for t, tok in enumerate(seq):
                keep = reference_kept(probs[t], top_k, top_p, min_p)
                total += math.log(probs[t, tok] / probs[t, keep].sum()) if keep[tok] else -math.inf
            out[seq] = total
    return out
