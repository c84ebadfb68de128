"""The particle decoders' hooks for potentials: hard constraints (token masks), rewards and
twists, over rows of particles or drafted chains.

SMC-SD's rounds (:mod:`smcspec.decoding.smc.block`, :mod:`smcspec.decoding.smc.cut`) and
multi-draft sd's (:mod:`smcspec.decoding.sd.multi_sd`, the masks only) call these only where a
request has a constraint or a reward; each is a step of ``docs/constraints.md`` ("Hard
constraints", "Rewards and twists"): the masked draft ``q'``, the masked power target and its
bonus weight, the matchers advanced by the sampled tokens (a refusal is a dead end), and the
twist ``log phi`` of each particle's prefix.
"""

from __future__ import annotations

import math

import torch

from smcspec.potentials import ConstraintState, DeadEndError, TokenConstraint, stack_masks
from smcspec.sampling.distributions import tempered_log_probs
from smcspec.sampling.masking import mask_log_probs, masked_power_log_probs
from smcspec.sampling.truncation import truncate_log_probs


def masked_power_target(
    logits: torch.Tensor,
    t_t: float,
    alpha: float,
    trunc: tuple[int, float, float],
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities ``∝ p~(v)^alpha m(v)`` (float32 ``[R, V]``) and the bonus log-weight
    ``logsumexp_v(alpha*log p~(v) + log m(v))`` (float64 ``[R]``; ``-inf`` where nothing the
    mask allows has target mass: that row is uniform, for sampling only, and the particle
    must get weight zero if it keeps the token). Source: ``docs/constraints.md``,
    "Hard constraints"."""
    lp = truncate_log_probs(tempered_log_probs(logits, t_t), *trunc)
    log_r, log_z = masked_power_log_probs(lp, alpha, mask)
    bad = ~torch.isfinite(log_z)
    probs = torch.where(bad[:, None], torch.ones_like(log_r), log_r.exp())
    return probs, log_z


def masked_proposal(lq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The masked draft ``log q'(v) = log norm(q * m)`` (float32 ``[R, V]``); a row whose mask
    misses the draft's kept set (only with ``truncate_draft``) is uniform over the mask."""
    empty = ~(mask & (lq > -math.inf)).any(-1, keepdim=True)
    return mask_log_probs(torch.where(empty, torch.zeros_like(lq), lq), mask)


def masks(
    constraint: TokenConstraint | None,
    states: list[ConstraintState],
    open_: torch.Tensor,
    vocab: int,
    dev: torch.device,
) -> torch.Tensor:
    """bool ``[N, V]`` masks of the open particles (all True elsewhere or without a
    constraint)."""
    if constraint is None:
        return torch.ones(open_.shape[0], vocab, dtype=torch.bool, device=dev)
    return stack_masks(states, open_.tolist(), vocab, dev)


def consume(states: list[ConstraintState], rows: torch.Tensor, toks: torch.Tensor) -> list[int]:
    """Advance ``states[i]`` by ``toks[i]`` for each row set in ``rows`` (bool ``[N]``);
    returns the rows whose matcher refused the token (:class:`DeadEndError`)."""
    bad = []
    for i in rows.nonzero()[:, 0].tolist():
        try:
            states[i].consume([int(toks[i])])
        except DeadEndError:
            bad.append(i)
    return bad


def log_twist(
    reward,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    finished: torch.Tensor,
    dev: torch.device,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 ``[N]``: ``log phi`` of each particle's tokens: ``beta * R`` for a finished
    particle, ``beta * prefix_fn`` otherwise (0 for rows outside ``rows``)."""
    n = tokens.shape[0]
    out = torch.zeros(n, dtype=torch.float64)
    sel = range(n) if rows is None else rows.nonzero()[:, 0].tolist()
    ended, ends, rows_ = finished.tolist(), lengths.tolist(), tokens.tolist()  # one read each
    for done in (True, False):
        idx = [i for i in sel if ended[i] == done]
        if idx:
            seqs = [rows_[i][: ends[i]] for i in idx]
            out[idx] = reward.log_potential(seqs, prefix=not done)
    return out.to(dev)
