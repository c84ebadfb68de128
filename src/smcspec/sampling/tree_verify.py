"""Exact verification of N drafted chains from one prefix: recursive rejection over a token tree.

The N chains of K tokens that a draft model samples independently from one prefix form a
token tree. At a node (the accepted path so far) the chains that pass through it propose
their next tokens ``x_1..x_m`` (in chain order, duplicates included); these are i.i.d. draws
from the draft's ``q(.|node)``, whatever happened at other nodes, because a chain's next token
depends on its own prefix only. Recursive rejection sampling (SpecInfer, Miao et al. 2024,
"SpecInfer: Accelerating Large Language Model Serving with Tree-based Speculative Inference
and Verification", section 4.2; SpecTr's k-sequential selection, Sun et al. 2023) then draws
exactly from the target ``p(.|node)``:

    r_0 = p
    for i = 1..m:  accept x_i with probability min(1, r_{i-1}(x_i) / q(x_i))
                   and descend to that child; on rejection r_i = norm(max(r_{i-1} - q, 0))
    all rejected:  draw the next token from r_m; the round ends there.

A node no chain continues (every chain through it ends there: depth K, or a chain cut short
by a constraint) is a leaf: the next token is drawn from ``p`` at it (the bonus token). Where
``r_{i-1} - q`` has no positive mass (``r = q`` up to rounding, where a rejection has
probability zero) ``r`` is kept, as :func:`~smcspec.sampling.speculative.speculative_verify`
keeps ``p``. With one chain this is that function's rule, draw for draw. ``p`` and ``q`` are
the distributions the tokens are sampled from (after temperature, truncation and masks), so
the output is exactly the processed target's, step by step.

Pure tensor work, without a host read (what a graph-captured round runs), batched over ``B``
independent trees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from smcspec.sampling.distributions import categorical_from_uniforms


@dataclass
class TreeVerdict:
    """What :func:`multi_draft_verify` decided for each of ``B`` trees.

    Attributes:
        accepted: int64 ``[B]``: drafted tokens accepted (the depth of the accepted path,
            ``0..K``).
        chain: int64 ``[B]``: a chain whose first ``accepted`` tokens are the accepted path
            (the first such chain).
        token: int64 ``[B]``: the target's token after the path (a residual draw, or the
            bonus token at a leaf).
        tried: int64 ``[B, K]``: candidates examined at each depth (0 past the last).
        valid: bool ``[B]``: False where the final distribution had no finite positive mass
            (NaN logits; ``token`` is then meaningless).
    """

    accepted: torch.Tensor
    chain: torch.Tensor
    token: torch.Tensor
    tried: torch.Tensor
    valid: torch.Tensor


def multi_draft_verify(
    drafted: torch.Tensor,
    lengths: torch.Tensor | None,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_next: torch.Tensor,
) -> TreeVerdict:
    """Verify ``B`` trees of ``N`` drafted chains each (module docstring).

    Args:
        drafted: int64 ``[B, N, K]``: chain ``i``'s tokens.
        lengths: int64 ``[B, N]``: how many of them are drafted (``<= K``; a constraint can
            end a chain early), or None: all ``K``.
        draft_probs: float ``[B, N, K, V]``: the distribution ``drafted[b, i, j]`` was drawn
            from (chain ``i``'s draft after its first ``j`` tokens).
        target_probs: float ``[B, N, K+1, V]``: the target's distribution after chain ``i``'s
            first ``j`` tokens (the rows of the target's forward over ``[v, d_1..d_K]``).
        u_accept: float ``[B, K, N]`` uniforms in [0, 1): the test of chain ``i`` at depth
            ``j`` is ``u * q(x) < r(x)``.
        u_next: float64 ``[B, 1]`` uniforms for the final draw
            (:func:`~smcspec.sampling.distributions.categorical_from_uniforms`).

    Returns:
        A :class:`TreeVerdict`. Chains through one node hold the same prefix, so their
        distributions at it are equal; the first chain's are read.
    """
    b, n, k = drafted.shape
    dev = drafted.device
    rows = torch.arange(b, device=dev)
    if lengths is None:
        lengths = torch.full((b, n), k, dtype=torch.long, device=dev)
    alive = torch.ones(b, n, dtype=torch.bool, device=dev)  # chains through the node
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    accepted = torch.full((b,), k, dtype=torch.long, device=dev)
    chain = torch.zeros(b, dtype=torch.long, device=dev)
    final = torch.zeros_like(target_probs[:, 0, 0])
    tried = torch.zeros(b, k, dtype=torch.long, device=dev)
    for j in range(k):
        candidates = alive & (lengths > j) & ~done[:, None]
        # the first chain through the node (one that drafted past it, where any did)
        rep = torch.where(candidates.any(1), candidates.int().argmax(1), alive.int().argmax(1))
        r, q = target_probs[rows, rep, j], draft_probs[rows, rep, j]
        took = torch.zeros(b, dtype=torch.bool, device=dev)
        token = torch.zeros(b, dtype=torch.long, device=dev)
        for i in range(n):
            cand = candidates[:, i] & ~took
            x = drafted[:, i, j, None]
            test = u_accept[:, j, i] * q.gather(1, x)[:, 0] < r.gather(1, x)[:, 0]
            took, token = took | (cand & test), torch.where(cand & test, x[:, 0], token)
            tried[:, j] += cand.long()
            r = torch.where((cand & ~test)[:, None], _residual(r, q), r)
        stop = ~done & ~took  # every candidate rejected, or a leaf (r is still p)
        final = torch.where(stop[:, None], r, final)
        accepted = torch.where(stop, j, accepted)
        chain = torch.where(stop, rep, chain)
        done = done | stop
        alive = alive & (lengths > j) & (drafted[:, :, j] == token[:, None])
    leaf = alive.int().argmax(1)
    final = torch.where(done[:, None], final, target_probs[rows, leaf, k])
    chain = torch.where(done, chain, leaf)
    nxt, valid = categorical_from_uniforms(final, u_next)
    return TreeVerdict(accepted, chain, nxt, tried, valid & ~torch.isnan(final[:, 0]))


def _residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(r - q, 0))`` per row (``[B, V]``), ``r`` itself where that has no mass."""
    res = (r - q).clamp_min(0)
    mass = res.sum(-1, keepdim=True)
    return torch.where(mass > 0, res / mass.clamp_min(torch.finfo(res.dtype).tiny), r)
