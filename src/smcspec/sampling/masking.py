"""Masked distributions: the token masks of a constraint applied to log-probabilities.

Pure tensor functions (the constraint's masks come from :mod:`smcspec.potentials`). Source:
the SMC-SD notes' masked draft ``q'`` and masked power target (``docs/constraints.md``).
"""

from __future__ import annotations

import math

import torch


def mask_log_probs(log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The locally-masked distribution ``log q'(v) = log q(v) + log m(v) - log sum_u q(u) m(u)``.

    Args:
        log_probs: float32 ``[..., V]`` normalised log-probs.
        mask: bool ``[..., V]``; a row with no allowed token of positive mass gives NaN (the
            caller treats it as a dead end first).
    Returns float32 ``[..., V]`` (``-inf`` where masked). Source: the notes' masked draft ``q'``.
    """
    return torch.log_softmax(log_probs.masked_fill(~mask, -math.inf), dim=-1)


def masked_power_log_probs(
    log_probs: torch.Tensor, alpha: float, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked power target ``r(v) ∝ p~(v)^alpha m(v)`` and the bonus log-weight ``log Z``.

    ``log Z = logsumexp_v(alpha * log p~(v) + log m(v))``; with ``p~ = softmax(l / T_t)`` this
    is ``logsumexp_v(alpha*l_v/T_t + log m(v)) - alpha*logsumexp_v(l_v/T_t)`` (the notes'
    bonus term; it generalises the alpha bonus normaliser and is non-zero at alpha = 1).

    Args:
        log_probs: ``[..., V]`` normalised ``log p~``. mask: bool ``[..., V]``.
    Returns:
        ``(log_r, log_z)``: float32 ``[..., V]`` and float64 ``[...]`` (``-inf`` for a row
        with nothing allowed; its ``log_r`` is NaN and must not be sampled).
    """
    scaled = (alpha * log_probs.double()).masked_fill(~mask, -math.inf)
    log_z = torch.logsumexp(scaled, -1)
    return (scaled - log_z[..., None]).float(), log_z
