"""Truncated sampling: top-k, top-p (nucleus) and min-p applied to next-token log-probs.

Each filter keeps a set of tokens; the processed distribution is the input restricted to
the tokens every set filter keeps, renormalised. Sources: top-k, Fan, Lewis & Dauphin
2018, "Hierarchical Neural Story Generation"; top-p, Holtzman et al. 2020, "The Curious
Case of Neural Text Degeneration"; min-p, Nguyen et al. 2024, "Turning Up the Heat:
Min-p Sampling for Creative and Coherent LLM Outputs". Conventions and order as vLLM's v1
sampler (temperature, then min-p, then top-k, then top-p on the renormalised result); see
``docs/sampling.md``.
"""

from __future__ import annotations

import math

import torch

_TOP_P_BOUND = 1024  # top-p first looks for its cut among this many most likely tokens


def truncation_active(top_k: int, top_p: float, min_p: float) -> bool:
    """True when at least one filter is on (``top_k`` not 0/-1, ``top_p < 1``, ``min_p > 0``)."""
    return top_k > 0 or top_p < 1 or min_p > 0


def truncate_log_probs(
    log_probs: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """Restrict each row to its kept set and renormalise (log space).

    Args:
        log_probs: float32 ``[..., V]`` log-probabilities, e.g. from
            :func:`~smcspec.sampling.distributions.tempered_log_probs` (only ratios are used,
            so an unnormalised row gives the same result). Each row needs a finite maximum.
        top_k: keep the tokens whose probability is at least the k-th largest (tokens tied
            with the k-th are all kept, so a row may keep more than k); ``0`` or ``-1``: off;
            ``k >= V`` keeps every token.
        top_p: in (0, 1]; keep token v iff the mass of the tokens strictly more likely than
            v is below ``top_p``, i.e. the smallest set of most likely tokens whose mass
            reaches ``top_p``, with every token tied at the boundary kept. The top token is
            always kept. ``1``: off.
        min_p: in [0, 1]; keep tokens with ``p(v) >= min_p * max_u p(u)``. ``0``: off.
    Filters applied (vLLM v1's order): min-p, then top-k, then top-p on the distribution
    renormalised over the tokens min-p and top-k kept. min-p and top-k depend only on
    probability ratios, so they commute; top-p alone depends on what was removed before it.

    Returns:
        float32 ``[..., V]``: ``log_probs`` renormalised over the kept set, ``-inf``
        elsewhere. When every filter is off the input tensor itself is returned (no work).
    Parameter values are checked by :meth:`smcspec.config.GenerationConfig.validate`, not
    here.
    """
    if not truncation_active(top_k, top_p, min_p):
        return log_probs
    lp = log_probs.float()
    keep: torch.Tensor | None = None
    if min_p > 0:
        top = lp.amax(-1, keepdim=True)
        keep = lp >= top + math.log(min_p)
    if 0 < top_k < lp.shape[-1]:
        kth = torch.topk(lp, top_k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
        k_keep = lp >= kth
        keep = k_keep if keep is None else keep & k_keep
    if keep is not None:
        lp = lp.masked_fill(~keep, -math.inf)
    if top_p < 1:
        lp = lp.masked_fill(lp < _top_p_threshold(lp, top_p), -math.inf)
    return torch.log_softmax(lp, dim=-1)


def _top_p_threshold(lp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Smallest kept log-prob ``[..., 1]`` of the top-p rule on ``lp`` ``[..., V]``.

    With ``s_0 >= s_1 >= ...`` the row sorted and ``c_i = sum_{j<i} p(s_j) / Z`` the mass
    before position i, the kept positions are ``i < L`` with ``L = #{i : c_i < top_p}``
    (``L >= 1`` since ``c_0 = 0``) and the threshold is ``s_{L-1}``; a token tied with it
    sits in a group whose first position has ``c < top_p``, so it is kept as well. Only the
    ``_TOP_P_BOUND`` largest values are sorted when they already hold ``top_p`` of the mass
    (every row, checked); otherwise the whole row is. Masses in float64.
    """
    v = lp.shape[-1]
    top = lp.amax(-1, keepdim=True)
    total = (lp - top).double().exp().sum(-1, keepdim=True)  # Z / exp(top)
    m = min(v, _TOP_P_BOUND)
    s = torch.topk(lp, m, dim=-1).values  # sorted, descending
    mass = (s - top).double().exp().cumsum(-1) / total
    if m < v and not bool((mass[..., -1] >= top_p).all()):
        s = torch.sort(lp, dim=-1, descending=True).values
        mass = (s - top).double().exp().cumsum(-1) / total
    before = torch.cat((torch.zeros_like(mass[..., :1]), mass[..., :-1]), -1)  # c_i
    n_kept = (before < top_p).sum(-1, keepdim=True)  # L >= 1
    return s.gather(-1, n_kept - 1)
