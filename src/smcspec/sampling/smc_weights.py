"""Incremental importance weights of SMC speculative decoding.

Emara et al. 2026, "Faster LLM Inference via Sequential Monte Carlo" (arXiv:2604.15672);
see ``docs/smc-sd.md`` steps 3c and 4. The sequence-level target is
``pi(x) ∝ prod_t p_T(x_t | x_<t)^alpha`` and the proposal is the draft at temperature T_d
for K tokens followed by the bonus token from ``softmax(alpha * l / T_t)``.

With top-k / top-p / min-p (``docs/sampling.md``) every ``p_T`` and ``q_T`` above becomes the
truncated, renormalised ``p~`` and ``q~``: the target is ``prod_t p~(x_t | x_<t)^alpha``,
the drafted tokens come from ``q~`` and the bonus from ``∝ p~^alpha``
(:func:`power_log_probs`).
"""

from __future__ import annotations

import math

import torch

from smcspec.sampling.distributions import tempered_log_probs
from smcspec.sampling.resampling import normalized_weights
from smcspec.sampling.truncation import truncate_log_probs, truncation_active


def bonus_log_normalizer(
    target_logits: torch.Tensor, temperature: float, alpha: float
) -> torch.Tensor:
    """``logsumexp(alpha * l / T) - alpha * logsumexp(l / T)`` over the vocabulary.

    The log-weight of a bonus token drawn from the power distribution; 0 when alpha == 1.
    Equal to ``log sum_v p_T(v)^alpha`` (``p_T = softmax(l / T)``), i.e. the second output of
    :func:`power_log_probs` without truncation.
    ``target_logits``: ``[..., V]``; returns float64 ``[...]``.

    Computed with each row's maximum shifted to 0 (both terms shift by ``alpha * max``),
    so that a tiny temperature or a huge alpha cannot overflow: the result is then the log
    of the number of tied most likely tokens minus ``alpha * log(1 + rest)``, finite or
    ``-inf``, never NaN.
    """
    logits = target_logits.double()
    shifted = logits - logits.amax(-1, keepdim=True)
    scaled = torch.where(shifted == 0, 0.0, shifted / temperature)
    return torch.logsumexp(alpha * scaled, -1) - alpha * torch.logsumexp(scaled, -1)


def power_log_probs(log_probs: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The power distribution ``r(v) = p~(v)^alpha / Z`` of processed log-probs, and ``log Z``.

    ``r`` is what x0 and the bonus token are drawn from when top-k / top-p / min-p are on;
    ``log Z = log sum_v p~(v)^alpha`` is the bonus token's log-weight: for a bonus ``b``
    drawn from ``r`` the importance weight against the power target is
    ``p~(b)^alpha / r(b) = Z``, whatever ``b`` is. Without truncation (``p~ = p_T``) this is
    :func:`bonus_log_normalizer`; at alpha = 1 it is ``log sum_v p~(v) = 0``.

    Args:
        log_probs: ``[..., V]`` ``log p~``, normalised, ``-inf`` outside the kept set (from
            :func:`~smcspec.sampling.truncation.truncate_log_probs`).
        alpha: power exponent (> 0).
    Returns:
        ``(log_r, log_z)``: float32 ``[..., V]`` (``-inf`` outside the kept set) and float64
        ``[...]``.
    """
    scaled = alpha * log_probs.double()
    log_z = torch.logsumexp(scaled, -1)
    return (scaled - log_z[..., None]).float(), log_z


def power_target_probs(
    logits: torch.Tensor,
    t_t: float,
    alpha: float,
    trunc: tuple[int, float, float],
    with_norm: bool = True,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities ``∝ p~(v)^alpha`` (float32 ``[..., V]``) that x0 and the bonus token are
    drawn from, and the bonus log-weight ``log sum_v p~(v)^alpha`` (float64 ``[...]``; None
    at alpha == 1, where it is 0, or without ``with_norm``).

    Args:
        logits: the target's ``[..., V]`` logits at the position drawn.
        t_t: target temperature (> 0). alpha: power exponent (> 0).
        trunc: ``(top_k, top_p, min_p)`` of the target (``docs/sampling.md``).
        check: raise on NaN logits (a host read; off inside a graph-captured round).
    All filters off: ``softmax(alpha * l / T_t)`` and :func:`bonus_log_normalizer`, the code
    path used before truncation existed.
    """
    if not truncation_active(*trunc):
        probs = tempered_log_probs(logits, t_t / alpha, check).exp()  # softmax(alpha * l / T_t)
        use_norm = with_norm and alpha != 1.0
        return probs, bonus_log_normalizer(logits, t_t, alpha) if use_norm else None
    lp = truncate_log_probs(tempered_log_probs(logits, t_t, check), *trunc)
    if alpha == 1.0:
        return lp.exp(), None
    log_r, log_z = power_log_probs(lp, alpha)
    return log_r.exp(), log_z


def incremental_log_weights(
    target_logp: torch.Tensor,
    draft_logp: torch.Tensor,
    alpha: float,
    bonus_log_norm: torch.Tensor | None,
    kept: torch.Tensor,
) -> torch.Tensor:
    """Incremental log-weight of each particle for one SMC-SD round.

    Args:
        target_logp: ``[N, K]`` ``log p_T(d_k)`` of the drafted tokens under the target
            (``log p~(d_k)`` with truncation; ``-inf`` for a token outside the target's kept
            set gives the particle weight zero).
        draft_logp: ``[N, K]`` ``log q_T(d_k)`` (or ``log q~(d_k)``) under the draft they
            were sampled from.
        alpha: power exponent.
        bonus_log_norm: ``[N]`` ``log sum_v p~(v)^alpha`` at position K+1 (from
            :func:`bonus_log_normalizer` without truncation, :func:`power_log_probs` with
            it), or None (alpha == 1, where it is 0).
        kept: int64 ``[N]``, how many of the K+1 new tokens the particle keeps (the block is
            cut after an EOS or at ``max_new_tokens``; 0 for a finished particle).
    Returns:
        float64 ``[N]``: ``sum_{k <= min(kept, K)} (alpha log p_T(d_k) - log q_T(d_k))``, plus
        the bonus term when ``kept == K + 1``.
    """
    n, k = target_logp.shape
    terms = alpha * target_logp.double() - draft_logp.double()
    pos = torch.arange(1, k + 1, device=terms.device)
    mask = pos[None, :] <= kept[:, None].to(terms.device)
    out = torch.where(mask, terms, torch.zeros_like(terms)).sum(-1)
    if bonus_log_norm is not None:
        full = kept.to(terms.device) == k + 1
        out = out + torch.where(full, bonus_log_norm.double(), torch.zeros_like(out))
    return out


def finished_shares(
    log_weights: torch.Tensor, finished: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Split one round's weight between the particles that ended in it and those running on.

    With alpha = 1 and no potential every prefix-target is normalised (the incremental
    weights have mean 1 under the draft), so the normalised weights at the end of a round
    estimate, for the particles that ended in it, each one's probability given that the
    sequence was still running at the last equal-weight point (the last resampling or
    banking, possibly several rounds back); the rest is the probability that it runs on.
    Banking the ended particles with these shares (and multiplying the running mass by its
    share) compares particles only against weights accumulated since that same point.
    Keeping them among the running
    ones instead compares a weight frozen when the particle ended with running weights whose
    logarithm drifts down by about the draft-target KL divergence per drafted token
    (their mean stays 1 but their median falls): at small N an early ending then wins almost
    always (measured on GSM8K: ``docs/benchmarks/finished-particles/``).

    Args:
        log_weights: float64 ``[N]`` log-weights since the last resampling (NaN: zero).
        finished: bool ``[N]``: the particles that ended this round.
    Returns:
        ``(log_shares, log_running)``: float64 ``[N]`` normalised log-weights (uniform if
        every weight is zero) and ``log`` of the running particles' total share (``-inf``
        when none runs on or all running weights are zero).
    """
    w, _ = normalized_weights(log_weights)
    log_shares = torch.log(w)
    running = w[~finished].sum()
    return log_shares, math.log(running) if running > 0 else -math.inf
