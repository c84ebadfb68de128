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
            v is below ``top_p`` (up to ``MASS_TOLERANCE`` = 1e-6: a mass within 1e-6 of
            ``top_p`` reaches it), i.e. the smallest set of most likely tokens whose mass
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
    shape, v = lp.shape, lp.shape[-1]
    lp = lp.reshape(-1, v)
    # every filter keeps the tokens at or above a per-row threshold: keep lp >= max of them
    thr: torch.Tensor | None = None
    if min_p > 0:
        thr = lp.amax(-1, keepdim=True) + math.log(min_p)
    if 0 < top_k < v:
        kth = torch.topk(lp, top_k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
        thr = kth if thr is None else torch.maximum(thr, kth)
    if top_p < 1:
        if thr is None:
            thr = _top_p_threshold(lp, top_p)
        else:  # on what min-p / top-k kept, renormalised
            thr = torch.maximum(thr, _top_p_threshold(torch.where(lp >= thr, lp, -math.inf), top_p))
    kept = lp if thr is None else torch.where(lp >= thr, lp, -math.inf)  # None: top_k >= V
    return torch.log_softmax(kept, dim=-1).view(shape)


_TOP_P_STAGES = (64, 1024)  # top-p looks for its cut among this many most likely tokens first
MASS_TOLERANCE = 1e-6  # a prefix mass within this of top_p counts as reaching it


def _top_p_threshold(lp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Smallest kept log-prob ``[R, 1]`` of the top-p rule on the rows of ``lp`` ``[R, V]``
    (``-inf`` marks tokens already removed; the rest is renormalised).

    With ``s_0 >= s_1 >= ...`` a row sorted and ``c_i = sum_{j<i} p(s_j) / Z`` the mass
    before position i, the kept positions are ``i < L`` with ``L = #{i : c_i < top_p}``
    (``L >= 1`` since ``c_0 = 0``) and the threshold is ``s_{L-1}``; a token tied with it
    sits in a group whose first position has ``c < top_p``, so it is kept as well. "Reaches"
    is up to :data:`MASS_TOLERANCE` (``c_i < top_p - 1e-6``, and at least one token), so that
    a mass equal to ``top_p`` on paper is not decided by float rounding. Each row
    is first cut among its 64 largest values (``torch.topk``), then 1024, and only if those
    hold less than ``top_p`` of the mass is it fully sorted. ``Z`` (a float32 logsumexp)
    and the prefix masses (float64 over the sorted values) are accurate to well within it.
    """
    r, v = lp.shape
    log_z = torch.logsumexp(lp, -1, keepdim=True).double()
    thr = torch.empty(r, 1, dtype=lp.dtype, device=lp.device)
    rows = torch.arange(r, device=lp.device)
    for m in (*_TOP_P_STAGES, v):
        part = lp if rows.numel() == r else lp[rows]
        if m < v:
            s = torch.topk(part, m, dim=-1).values  # sorted, descending
        else:
            s = torch.sort(part, dim=-1, descending=True).values
        mass = (s.double() - log_z[rows]).exp().cumsum(-1)  # c_1 .. c_m
        before = torch.cat((torch.zeros_like(mass[:, :1]), mass[:, :-1]), -1)  # c_0 .. c_{m-1}
        n_kept = (before < top_p - MASS_TOLERANCE).sum(-1, keepdim=True).clamp(min=1)  # L
        reached = mass[:, -1] >= top_p - MASS_TOLERANCE  # then L <= m: this stage decides
        done = reached if m < v else torch.ones_like(rows, dtype=torch.bool)
        thr[rows[done]] = s[done].gather(-1, n_kept[done] - 1)
        rows = rows[~done]
        if rows.numel() == 0 or m >= v:
            break
    return thr
