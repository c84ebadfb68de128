"""Tiny enumerable models for the statistical tests (shared with the fidelity harness)."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from smcspec.backends.torch.transformer import Transformer
from smcspec.eval.exact import sequence_log_probs, stopped_sequence_log_probs, tiny_transformer

__all__ = [
    "chisquare_p",
    "one_particle_log_probs",
    "until_decided",
    "processed_sequence_log_probs",
    "reference_kept",
    "sequence_log_probs",
    "stopped_sequence_log_probs",
    "tiny_transformer",
    "total_variation",
    "tv_lower_bound",
]


def total_variation(p: dict, counts: dict, n: int) -> float:
    """TV distance between an exact distribution ``p`` (log-probs) and empirical counts."""
    keys = set(p) | set(counts)
    return 0.5 * sum(abs(math.exp(p.get(k, -math.inf)) - counts.get(k, 0) / n) for k in keys)


def tv_lower_bound(p: dict, counts: dict, n: int, outcomes: int, delta: float = 1e-6) -> float:
    """A lower confidence bound, at level ``1 - delta``, on the TV distance between the
    distribution that drew ``counts`` (``n`` runs over at most ``outcomes`` outcomes) and the
    exact ``p`` (log-probs).

    ``TV(P, p) >= TV(P^, p) - TV(P^, P)`` (triangle inequality); ``E TV(P^, P) <= 0.5 sqrt(
    outcomes / n)`` (each outcome's mean absolute deviation is at most ``sqrt(P_k / n)``, then
    Cauchy-Schwarz over the outcomes); one run moves ``TV(P^, P)`` by at most ``1 / n``, so it
    exceeds its mean by ``t`` with probability at most ``exp(-2 n t^2)`` (McDiarmid).
    """
    spread = 0.5 * math.sqrt(outcomes / n) + math.sqrt(math.log(1 / delta) / (2 * n))
    return total_variation(p, counts, n) - spread


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


def one_particle_log_probs(
    target: Transformer,
    draft: Transformer,
    prompt: list[int],
    length: int,
    draft_tokens: int,
    t_t: float = 1.0,
    t_d: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> dict[tuple[int, ...], float]:
    """Exact log-probs of every output of ``length`` tokens of SMC-SD with one particle
    (N = 1, alpha = 1, no stop token): plain drafting, whatever the weights say.

    Position ``t`` comes from the processed target ``p~`` (tempered at ``t_t``, truncated by
    :func:`reference_kept` and renormalised) when ``t % (draft_tokens + 1) == 0`` (the first
    token, then each round's bonus), else from the draft ``q`` at ``t_d``, untruncated (SMC-SD
    drafts from ``q_T``): x0, then rounds of ``draft_tokens`` drafted tokens and a bonus, cut
    at ``length``. A particle whose weight is 0 is still the only one: its tokens stand. The
    probabilities sum to 1; a sequence with a bonus outside a kept set gets ``-inf``.
    """
    vocab = target.cfg.vocab_size
    out = {}
    with torch.inference_mode():
        for seq in itertools.product(range(vocab), repeat=length):
            rows = []
            for model, temp in ((target, t_t), (draft, t_d)):
                cache = model.new_cache(1, length + 1)
                logits = model.prefill(torch.tensor(prompt), cache)[None]
                if length > 1:
                    logits = torch.cat((logits, model.decode(torch.tensor([seq[:-1]]), cache)[0]))
                rows.append(torch.softmax(logits.double() / temp, -1).numpy())
            p, q = rows
            total = 0.0
            for t, tok in enumerate(seq):
                if t % (draft_tokens + 1) == 0:
                    keep = reference_kept(p[t], top_k, top_p, min_p)
                    total += math.log(p[t, tok] / p[t, keep].sum()) if keep[tok] else -math.inf
                else:
                    total += math.log(q[t, tok])
            out[seq] = total
    return out


def until_decided(
    sample: Callable[[int, int], Counter],
    decided: Callable[[Counter, int], bool],
    max_runs: int,
    first: int = 250,
) -> tuple[Counter, int]:
    """A sequential test: runs ``0, 1, ...`` in doubling blocks (``first``, ``2 first``, ...,
    at most ``max_runs`` in all) until ``decided(counts, runs)`` holds; ``sample(start, m)``
    counts the outputs of runs ``start .. start + m - 1`` (seeded by their index).

    Returns ``(counts, runs)`` at the first look that decided, or at ``max_runs``. Used for a
    broken variant that must fail an exactness test: ``decided`` is the failure (a chi-square
    p-value below 1e-6), so at most ``ceil(log2(max_runs / first)) + 1`` looks are taken, and
    a variant that is in fact exact is declared caught with probability below that many
    times 1e-6 (a union bound over the looks).
    """
    counts: Counter = Counter()
    runs, look = 0, min(first, max_runs)
    while True:
        counts.update(sample(runs, look - runs))
        runs = look
        if decided(counts, runs) or runs >= max_runs:
            return counts, runs
        look = min(2 * look, max_runs)
