"""SMC-SD's rounds simulated on per-position next-token distributions: what a draft does to
the particles, without running the decoder.

Given the target's and the draft's distributions at the L positions of an answer (the
target's own, say), the answer is cut into blocks of K positions; N particles draw every
position's token from the draft, and each particle's block weight is
``w = prod_t p(x_t) / q(x_t)`` (``docs/smc-sd.md``, step 3c, with the target exponent 1).
From those weights: the round's ESS ``(sum w)^2 / sum w^2`` (what the engine records as
``mean_round_ess``), the particle a resampling step keeps (drawn in proportion to ``w``) and
its tokens' ``-log p``, and the ESS as N grows, ``N exp(-sum_t D2_t)``
(``E_q[w^2] = prod_t exp(D2(p_t||q_t))`` for independent positions).

Every position keeps the answer's prefix: within a real block the particles' prefixes differ
after the first drafted token, so this is the independent-positions model of a round. On the
default pair it ranks drafts as the engine's GSM8K runs did (round ESS and the answers' NLL:
``docs/benchmarks/distill/README.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from smcspec.distill.objectives import d2


@dataclass(frozen=True, slots=True)
class SimulatedRounds:
    """Means over blocks and repetitions (see :func:`simulate_rounds`).

    Attributes:
        blocks: whole blocks of K positions simulated.
        ess: the round's ESS, in particles (N when the draft is the target).
        ess_large_n: N times ``exp(-sum D2)`` of the block's positions: the ESS as N grows.
        kept_nll: nats a token of ``-log p`` of the particle kept by weight; tends to the
            target's entropy as N grows.
        draft_nll: the same over every drafted particle, before weighting.
    """

    blocks: int
    ess: float
    ess_large_n: float
    kept_nll: float
    draft_nll: float


def simulate_rounds(
    lp: torch.Tensor,
    lq: torch.Tensor,
    particles: int,
    draft_tokens: int,
    reps: int,
    generator: torch.Generator,
) -> SimulatedRounds | None:
    """Simulate SMC-SD rounds of N ``particles`` and K ``draft_tokens`` on one answer.

    Args:
        lp, lq: float ``[L, V]``: the target's and the draft's log-probabilities at the L
            positions (after their temperatures); positions past the last whole block of K
            are dropped.
        particles, draft_tokens: N and K.
        reps: simulated rounds per block.
        generator: the generator of the draws (CPU).
    Returns:
        The means (:class:`SimulatedRounds`), or None when L < K.
    Raises:
        ValueError: shapes that differ, or N, K or ``reps`` below 1.
    """
    if lp.shape != lq.shape or lp.dim() != 2:
        raise ValueError(f"lp and lq must be [L, V] of one shape, got {lp.shape}, {lq.shape}")
    if min(particles, draft_tokens, reps) < 1:
        raise ValueError("particles, draft_tokens and reps must be at least 1")
    n, k = particles, draft_tokens
    blocks = lp.shape[0] // k
    if blocks == 0:
        return None
    lp, lq = lp[: blocks * k].float(), lq[: blocks * k].float()
    x = torch.multinomial(lq.exp(), reps * n, replacement=True, generator=generator)  # [L, R*N]
    token_lp = lp.gather(1, x)
    logw = (token_lp - lq.gather(1, x)).view(blocks, k, reps, n).sum(1)  # [B, R, N]
    nll = (-token_lp).view(blocks, k, reps, n).mean(1)  # [B, R, N]
    ess = (2 * logw.logsumexp(-1) - (2 * logw).logsumexp(-1)).exp()
    kept = torch.multinomial(logw.softmax(-1).view(-1, n), 1, generator=generator)
    block_d2 = d2(lp, lq).view(blocks, k).sum(1)
    return SimulatedRounds(
        blocks=blocks,
        ess=ess.mean().item(),
        ess_large_n=n * (-block_d2).exp().mean().item(),
        kept_nll=nll.view(-1, n).gather(1, kept).mean().item(),
        draft_nll=nll.mean().item(),
    )
