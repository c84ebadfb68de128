"""Exact speculative sampling: the accept/reject rule with residual resampling.

Leviathan, Kalman & Matias 2023 ("Fast Inference from Transformers via Speculative
Decoding", Algorithm 1) and Chen et al. 2023 ("Accelerating LLM Decoding with Speculative
Sampling"). Output tokens are distributed exactly as the target.
"""

from __future__ import annotations

import torch

from smcspec.sampling.distributions import sample_categorical


def speculative_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Verify one block of K drafted tokens against the target.

    Args:
        draft_tokens: int64 ``[K]``, the tokens the draft sampled.
        draft_probs: float ``[K, V]``, the draft distributions they were sampled from.
        target_probs: float ``[K+1, V]``, the target distributions at the same K positions
            plus the one after the last drafted token.
        generator: source of randomness.
    Returns:
        ``(n, token)``: the first ``n`` drafted tokens are accepted (``0 <= n <= K``) and
        ``token`` follows them: drawn from the residual ``norm(max(p - q, 0))`` at the
        first rejected position, or from ``target_probs[K]`` (bonus) if all K are accepted.
    """
    k = draft_tokens.shape[0]
    idx = torch.arange(k, device=draft_tokens.device)
    p = target_probs[idx, draft_tokens].float()
    q = draft_probs[idx, draft_tokens].float()
    u = torch.rand(k, generator=generator, device=draft_probs.device)
    # accept d_k with probability min(1, p/q); written as u * q < p to avoid division
    rejected = (u * q >= p).nonzero()
    if rejected.numel() == 0:
        return k, int(sample_categorical(target_probs[k], generator))
    n = int(rejected[0, 0])
    residual = (target_probs[n].float() - draft_probs[n].float()).clamp_min(0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: the residual is p itself
        residual = target_probs[n].float()
    return n, int(sample_categorical(residual, generator))
