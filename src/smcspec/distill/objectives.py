"""Per-position divergences between the target's and the draft's next-token distributions,
the losses :mod:`smcspec.distill.training` minimises.

The target (teacher) is kept as its ``k`` most likely tokens' log-probabilities plus the
remaining mass ``r`` (:mod:`smcspec.distill.teacher`); the draft's full distribution is
folded onto the same ``k + 1`` buckets (its mass on the teacher's top ``k`` ids, and the rest
as one "other" bucket). Every divergence is then computed exactly on the buckets, no
sampling. On the full vocabulary the bucketed divergence is a lower bound of the true one
(the data-processing inequality: merging outcomes never raises an f-divergence or a Renyi
divergence), exact when the draft spreads its rest like the target does; the gap is measured
by ``benchmarks/distill_truncation.py``.

The divergences (``p`` the target, ``q`` the draft, both after temperature):

* ``d2``: Renyi order 2, ``D2(p||q) = log sum_x p(x)^2 / q(x) = log(1 + chi2(p||q))``: what
  blows up SMC-SD's importance weights (``E_q[(p/q)^2] = 1 + chi2``); the SMC-SD authors'
  objective (abdelfattah-lab/smcsd, docs/smc/proposal_results.md).
* ``kl``: forward ``KL(p||q) = sum_x p log(p/q)``, Renyi order 1.
* ``renyi(alpha)``: ``1/(alpha-1) log sum_x p^alpha q^(1-alpha)`` (order 1 is ``kl``); the
  ``anneal`` objective moves alpha from 1 to 2 over the run.
* ``reverse_kl``: ``KL(q||p)``, mode-seeking (the authors' baseline; it lost accuracy).
* ``tv``: total variation ``1/2 sum |p - q|``; chain speculative decoding accepts a drafted
  token with probability ``1 - TV`` (Leviathan et al. 2023, section 3.5).
"""

from __future__ import annotations

import math

import torch

OBJECTIVES = ("chi2", "kl", "anneal", "reverse-kl")
LOG_FLOOR = -1e4  # log of a mass that is zero (finite, so that 0 * log 0 terms stay 0)
# The target's rest mass is 1 - sum of its kept probabilities, stored to 6 decimals: below
# this it is rounding, not mass. There the target's rest is taken as the draft's, capped at
# this floor: what the rounding allows that adds least to any divergence (zero would make the
# reverse KL of a draft rest of 1e-4 about 1; a spurious 1e-7 against a draft rest of exactly
# zero would make D2 thousands).
REST_FLOOR = 2e-6


def bucket_logprobs(
    top_ids: torch.Tensor, top_logprobs: torch.Tensor, draft_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's and the draft's log-probabilities on the ``k + 1`` buckets.

    Args:
        top_ids: int64 ``[T, k]``: the target's ``k`` most likely token ids at each position
            (distinct within a row).
        top_logprobs: float ``[T, k]``: their log-probabilities under the target (nats).
        draft_logprobs: float ``[T, V]``: the draft's ``log_softmax`` at the same positions
            (after its temperature).
    Returns:
        ``(lp, lq)``, float32 ``[T, k + 1]``: bucket ``k`` is "every other token"; the
        target's rest mass is ``1 - sum exp(top_logprobs)`` (clamped at 0; a zero mass is
        :data:`LOG_FLOOR`; below :data:`REST_FLOOR`, rounding, it is the draft's rest
        capped at that floor), the draft's the logsumexp of its other tokens. The target's
        side carries no gradient.
    """
    lq_all = draft_logprobs.float()
    lq_top = lq_all.gather(-1, top_ids)
    lq_rest = lq_all.scatter(-1, top_ids, float("-inf")).logsumexp(-1, keepdim=True)
    lp_top = top_logprobs.float()
    rest = 1.0 - lp_top.exp().sum(-1, keepdim=True)
    rounding = lq_rest.detach().clamp(LOG_FLOOR, math.log(REST_FLOOR))
    lp_rest = torch.where(rest > REST_FLOOR, rest.clamp_min(REST_FLOOR).log(), rounding)
    lp = torch.cat([lp_top, lp_rest], -1).clamp_min(LOG_FLOOR)
    lq = torch.cat([lq_top, lq_rest], -1).clamp_min(LOG_FLOOR)
    return lp, lq


def d2(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """Renyi-2 divergence ``log sum_x p(x)^2 / q(x)`` per row: float ``[..., B]`` log-probs of
    the target ``lp`` and the draft ``lq`` in, ``[...]`` nats out (>= 0)."""
    return torch.logsumexp(2 * lp - lq, dim=-1)


def kl(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """Forward ``KL(p||q) = sum_x p (log p - log q)`` per row (nats; see :func:`d2`)."""
    return (lp.exp() * (lp - lq)).sum(-1)


def reverse_kl(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """Reverse ``KL(q||p) = sum_x q (log q - log p)`` per row (nats; see :func:`d2`)."""
    return kl(lq, lp)


def renyi(lp: torch.Tensor, lq: torch.Tensor, alpha: float) -> torch.Tensor:
    """Renyi divergence of order ``alpha`` (>= 1) per row: ``kl`` at 1, ``d2`` at 2 (nats).

    Raises:
        ValueError: ``alpha`` < 1.
    """
    if alpha < 1:
        raise ValueError(f"alpha must be >= 1, got {alpha}")
    if alpha == 1:
        return kl(lp, lq)
    return torch.logsumexp(alpha * lp + (1 - alpha) * lq, dim=-1) / (alpha - 1)


def tv(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """Total variation ``1/2 sum_x |p - q|`` per row, in [0, 1]."""
    return 0.5 * (lp.exp() - lq.exp()).abs().sum(-1)


def anneal_alpha(progress: float) -> float:
    """The ``anneal`` objective's Renyi order at ``progress`` in [0, 1] of the run: 1 to 2."""
    return 1.0 + min(max(progress, 0.0), 1.0)


def objective(name: str, lp: torch.Tensor, lq: torch.Tensor, progress: float = 0.0) -> torch.Tensor:
    """The per-row loss of objective ``name`` (one of :data:`OBJECTIVES`): ``chi2`` is
    :func:`d2`, ``kl`` :func:`kl`, ``anneal`` :func:`renyi` at :func:`anneal_alpha`
    (``progress``), ``reverse-kl`` :func:`reverse_kl`.

    Raises:
        ValueError: an unknown name.
    """
    if name == "chi2":
        return d2(lp, lq)
    if name == "kl":
        return kl(lp, lq)
    if name == "anneal":
        return renyi(lp, lq, anneal_alpha(progress))
    if name == "reverse-kl":
        return reverse_kl(lp, lq)
    raise ValueError(f"unknown objective {name!r}; choose from {', '.join(OBJECTIVES)}")


def divergences(lp: torch.Tensor, lq: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every validation figure per row: ``d2``, ``kl``, ``tv`` and ``acceptance`` (``1 - tv``,
    chain sd's per-token acceptance)."""
    t = tv(lp, lq)
    return {"d2": d2(lp, lq), "kl": kl(lp, lq), "tv": t, "acceptance": 1 - t}
