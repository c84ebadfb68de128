"""SMC-SD rounds that end where the weights degenerate (``round_end="ess"``).

A plain SMC-SD round adds K drafted tokens of weight before its ESS is looked at, so at a long
K the weights can collapse inside the block with nothing to react. The target's one forward
over ``[v, d_1..d_K]`` already gives its distribution at every position, so a round can end
earlier at no extra forward: write ``w_i(j)`` for particle ``i``'s log-weight after the first
``j`` drafted tokens of the round (its running log-weight plus ``alpha log p~ - log q`` of
those tokens); the round ends at ``j*``, the first ``j`` in ``1..K`` at which the ESS of
``w(j)`` (of any group) falls below ``kappa`` times the group's size (none: ``j* = K``, the
plain round). The particles keep their first ``j*`` drafted tokens (both KV caches are rolled
back past them), are banked and resampled with ``w(j*)`` as a plain round's end would, and
then every running particle draws its token ``j*+1`` from the target's distribution at
position ``j*`` of its ancestor's row (``∝ p~^alpha``, masked under a constraint), whose
incremental log-weight is ``log sum_v p~(v)^alpha`` (0 at alpha = 1 without a mask). A round
yields ``j*+1`` tokens, 2 to K+1.

Why this is still SMC-SD (``docs/smc-sd.md``, "Rounds cut where the ESS falls"): seen token
by token, the sampler is sequential importance sampling whose proposal is the draft for tokens
``1..j*`` and the target for token ``j*+1``, with resampling at ``j*``. Whether to resample at
``j`` is decided from the particles up to ``j`` (the weights ``w(j)`` and the drafted tokens
before it), never from what comes after: the adaptive resampling rule of Del Moral, Doucet &
Jasra 2012 ("On adaptive resampling strategies for sequential Monte Carlo methods",
Bernoulli 18(1)), under which the particle system stays consistent as N grows. The drafted
tokens after ``j*`` are discarded unseen by the weights, as sd discards a rejected tail. The
bonus is drawn after resampling, so that copies of one ancestor draw their own.
"""

from __future__ import annotations

import math

import torch

from smcspec.backends.base import KVCache
from smcspec.decoding.job import Job
from smcspec.decoding.smc.extend import draw_bonus, extend, settle
from smcspec.decoding.smc.particles import Block, Particles
from smcspec.sampling.resampling import batched_ess


def cut_position(job: Job, ps: Particles, b: Block) -> int:
    """``j*`` of the round just scored (module docstring): the first drafted position
    ``1..K`` at which some group that ran has an ESS below ``kappa`` times its size, else K.

    A particle's weight stops growing at its first stop token and at the budget; a finished
    particle's does not grow; one at a dead end of a constraint has weight zero from there.
    One host read. ``kappa = 0`` or groups of one particle: K."""
    cfg = job.config
    k, m, g = cfg.draft_tokens, cfg.group_size, cfg.groups
    if cfg.ess_threshold <= 0 or m < 2:
        return k
    pos = torch.arange(1, k + 1, device=job.device)
    first_stop = torch.where(torch.isin(b.drafted, job.stop_tensor), pos, k + 1).min(1).values
    limit = torch.minimum(first_stop, cfg.max_new_tokens - ps.lengths)
    limit = torch.where(ps.finished, torch.zeros_like(limit), limit)
    terms = cfg.alpha * b.target_lp.double() - b.draft_lp.double()
    inc = torch.where(pos[None, :] <= limit[:, None], terms, torch.zeros_like(terms)).cumsum(1)
    w = ps.logw[:, None] + inc  # [N, K]: w(j)
    if b.dead_pos is not None:
        w = torch.where(pos[None, :] >= b.dead_pos[:, None], -math.inf, w)
    ess = batched_ess(w.view(g, m, k), dim=1)  # [G, K]
    ran = (~ps.finished).view(g, m).any(1)
    below = (ess < cfg.ess_threshold * m) & ran[:, None]
    first = torch.where(below.any(0), pos, k + 1).min()
    return min(int(first), k)


def truncate(
    tcache: KVCache, dcache: KVCache, lengths0: tuple[int, int, int], cut: int, k: int
) -> None:
    """Roll both caches back to the first ``cut`` drafted tokens of the round: the target,
    fed ``[v, d_1..d_K]`` from ``lengths0[0]``, keeps ``v, d_1..d_cut``; the draft, fed its
    ``lengths0[2]`` pending tokens then ``d_1..d_{K-1}`` from ``lengths0[1]``, keeps those up
    to ``d_cut`` (all of them at ``cut = K``: ``d_K`` is never fed, as in a plain round)."""
    t0, d0, w = lengths0
    if cut < k:
        tcache.truncate(t0 + 1 + cut)
        dcache.truncate(d0 + w + cut)


def deferred_bonus(job: Job, ps: Particles, b: Block, anc: torch.Tensor, cut: int) -> torch.Tensor:
    """Token ``cut+1`` of every running particle, drawn after the round's resampling from the
    target's row at position ``cut`` of its ancestor (``anc`` int64 ``[N]``) (module
    docstring; :func:`~smcspec.decoding.smc.extend.draw_bonus`); its log-weight, the tokens
    kept (:func:`~smcspec.decoding.smc.extend.extend`), dead ends and the twist of the grown
    prefix (:func:`~smcspec.decoding.smc.extend.settle`), and the pending tokens of the next
    round. Returns bool ``[N]``: the particles the bonus ended (a stop token, the budget, a
    dead end), for banking. Raises :class:`DeadEndError` when every particle is dead."""
    cfg = job.config
    running = ~ps.finished
    rows = b.logits[anc, cut]  # [N, V]
    if job.constraint is not None:
        extra = (b.consumed[anc] - cut).clamp(min=0).tolist()
        for i in running.nonzero()[:, 0].tolist():  # matchers back to the cut
            ps.states[i].rollback(extra[i])
    bonus = draw_bonus(job, ps, rows, running, job.constraint is not None)
    if bonus.norm is not None:
        ps.logw = torch.where(running, ps.logw + bonus.norm.to(ps.logw), ps.logw)
    extend(job, ps, bonus.token[:, None], bonus.values)
    killed = torch.zeros_like(running) if bonus.dead is None else bonus.dead
    ended = running & (ps.finished | killed)
    if cfg.has_potential:  # unlike a block round's, a particle of weight zero is not twisted
        settle(job, ps, killed, grew=running & ~killed & torch.isfinite(ps.logw))
    ps.pending_t = bonus.token[:, None]
    k = cfg.draft_tokens
    if cut < k:
        ps.pending_d = bonus.token[:, None]
    else:  # the draft was never fed d_K: it comes with the bonus
        ps.pending_d = torch.stack((b.drafted[anc, k - 1], bonus.token), 1)
    ps.tally.cut_rounds += int(cut < k)
    return ended
