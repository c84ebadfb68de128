"""One SMC-SD round's proposal and what it makes of the particles (``docs/smc-sd.md``):
steps 3a (K draft forwards, :func:`draft_block`), 3b and 3d (the target's forward and the
bonus token, :func:`score_block`), or the three as one fused round (:func:`fused_block`), then
3c, 3e and 4 (the incremental log-weights, dead ends, twists and the new tokens,
:func:`advance`)."""

from __future__ import annotations

import torch

import smcspec.decoding.potential_hooks as potential_hooks
from smcspec.backends.base import KVCache
from smcspec.decoding.job import Job
from smcspec.decoding.program import Forward, Program
from smcspec.decoding.smc.extend import draw_bonus, extend, settle
from smcspec.decoding.smc.fused import smc_block
from smcspec.decoding.smc.particle_logprobs import position_values
from smcspec.decoding.smc.particles import Block, Particles
from smcspec.sampling.distributions import sample_categorical, tempered_log_probs
from smcspec.sampling.smc_weights import incremental_log_weights
from smcspec.sampling.truncation import truncate_log_probs


def draft_block(job: Job, ps: Particles, dcache: KVCache) -> Program:
    """Step 3a: K draft forwards (deferred bonus: the first feeds 1-2 tokens per particle),
    each token from ``q_T`` (``q'`` ∝ ``q_T m`` with a constraint). Returns a :class:`Block`."""
    cfg = job.config
    n, k, dev = cfg.particles, cfg.draft_tokens, job.device
    drafted = torch.empty(n, k, dtype=torch.long, device=dev)
    draft_lp = torch.empty(n, k, dtype=torch.float32, device=dev)
    open_ = dead_pos = None
    consumed = torch.zeros(n, dtype=torch.long, device=dev)  # tokens each matcher consumed
    masks: list[torch.Tensor] = []  # the constraint's masks, for logprobs
    if cfg.has_potential:
        open_ = ~ps.finished  # still consuming tokens this round
        dead_pos = torch.full((n,), k + 2, dtype=torch.long, device=dev)  # K+2: alive
    x = ps.pending_d
    for j in range(k):
        d_logits = yield Forward(job.draft, x, dcache, last_only=True)
        lq = tempered_log_probs(d_logits[:, -1, : job.vocab], cfg.draft_temperature)
        lq = truncate_log_probs(lq, *job.draft_truncation)
        if job.constraint is not None:
            m = potential_hooks.masks(job.constraint, ps.states, open_, job.vocab, dev)
            empty = ~m.any(-1)  # a dead end at block position j+1
            dead_pos = torch.where(empty & open_, j + 1, dead_pos)
            open_ = open_ & ~empty
            lq = potential_hooks.masked_proposal(lq, m | empty[:, None])  # q' (junk rows: dead)
            if job.wants_logprobs:
                masks.append(m)
        d = sample_categorical(lq.exp(), job.generator)
        if ps.host is not None:  # ended rows draft what their host drafts (host_ended)
            d = d[ps.host]
        drafted[:, j] = d
        draft_lp[:, j] = lq.gather(-1, d[:, None])[:, 0]
        if job.constraint is not None:
            open_ = open_ & ~torch.isin(d, job.stop_tensor)
            bad = potential_hooks.consume(ps.states, open_, d)
            if bad:  # d_{j+1} itself was refused: dead at block position j+1
                dead_pos[bad] = torch.clamp(dead_pos[bad], max=j + 1)
                open_[bad] = False
            consumed += open_.long()
        x = d[:, None]
    b = Block(drafted, draft_lp, dead_pos, open_)
    b.consumed, b.masks = consumed, masks
    return b


def fused_block(job: Job, ps: Particles, tcache: KVCache, dcache: KVCache) -> Program:
    """Steps 3a, 3b and 3d as one :class:`~smcspec.decoding.program.Round`
    (:func:`smcspec.decoding.smc.fused.smc_block`): the same draws as :func:`draft_block` and
    :func:`score_block`, without a host read between the forwards."""
    out = yield from smc_block(job, ps.pending_d, ps.pending_t, ps.host, tcache, dcache)
    b = Block(out["drafted"], out["draft_lp"], None, None, out["target_lp"], out.get("bonus"))
    b.bonus_norm, b.logits = out.get("bonus_norm"), out.get("logits")
    return b


def score_block(job: Job, ps: Particles, b: Block, tcache: KVCache) -> Program:
    """Steps 3b and 3d: one target forward over ``[v, d_1..d_K]`` for every particle; fills
    ``b.target_lp`` and the bonus token at position K+1 from ``∝ p~^alpha`` (``∝ p~^alpha m``
    with a potential, whose bonus weight is ``log sum_v p~(v)^alpha m(v)``). With round_end
    "ess" the bonus waits for the cut: ``b.logits`` keeps the target's logits instead. The
    bonus is :func:`~smcspec.decoding.smc.extend.draw_bonus`'s, a dead end at it recorded at
    block position K+1."""
    cfg = job.config
    k = cfg.draft_tokens
    t_block = torch.cat((ps.pending_t, b.drafted), 1)
    t_logits = (yield Forward(job.target, t_block, tcache))[:, :, : job.vocab]
    lp = truncate_log_probs(tempered_log_probs(t_logits[:, :k], cfg.temperature), *cfg.truncation)
    b.target_lp = lp.gather(-1, b.drafted[:, :, None])[:, :, 0]
    if job.wants_logprobs:  # the drafted tokens' values (the bonus's below)
        masks = torch.stack(b.masks, 1) if b.masks else None
        b.values = position_values(cfg, t_logits[:, :k], b.drafted, masks)
    if cfg.round_end == "ess":  # the backend's buffer: kept until the cut's bonus is drawn
        b.logits = t_logits.clone()
        return
    bonus = draw_bonus(job, ps, t_logits[:, k], b.open_, cfg.has_potential, ps.host)
    b.bonus, b.bonus_norm = bonus.token, bonus.norm
    if bonus.dead is not None:  # dead at the bonus: no allowed token, or the matcher refused
        b.dead_pos = torch.where(bonus.dead, k + 1, b.dead_pos)
    if b.values is not None:  # the bonus's values, beside the drafted tokens'
        b.values = tuple(torch.cat((a, c), 1) for a, c in zip(b.values, bonus.values, strict=True))


def advance(job: Job, ps: Particles, b: Block, cut: int | None = None) -> torch.Tensor:
    """Steps 3c, 3e and 4: how much of the block each particle keeps (EOS and
    ``max_new_tokens`` cut it) and the new tokens (:func:`~smcspec.decoding.smc.extend.extend`),
    the incremental log-weights, dead ends (weight zero) and the twist ``phi(new) / phi(old)``
    (:func:`~smcspec.decoding.smc.extend.settle`). ``cut`` (round_end "ess"): the block is
    the first ``cut`` drafted tokens only, the bonus comes later
    (:func:`smcspec.decoding.smc.cut.deferred_bonus`). Returns bool ``[N]``: the particles
    that ended in this round. Raises :class:`DeadEndError` when every particle is dead."""
    cfg = job.config
    k = cfg.draft_tokens
    if cut is None:
        block, norm = torch.cat((b.drafted, b.bonus[:, None]), 1), b.bonus_norm  # [N, K+1]
    else:
        block, norm = b.drafted[:, :cut], None
    m = block.shape[1]
    was_finished = ps.finished
    values = None if b.values is None else tuple(v[:, :m] for v in b.values)
    kept = extend(job, ps, block, values)
    ps.logw = ps.logw + incremental_log_weights(
        b.target_lp[:, : min(m, k)], b.draft_lp[:, : min(m, k)], cfg.alpha, norm, kept
    )
    if cfg.has_potential:  # a particle that reached a dead end inside what it keeps dies
        killed = ~was_finished & (b.dead_pos <= kept)
        settle(job, ps, killed, grew=~was_finished & ~killed)
    if cut is None:
        ps.pending_t = b.bonus[:, None]
        ps.pending_d = torch.stack((b.drafted[:, -1], b.bonus), 1)
    ps.tally.rounds += 1
    return ps.finished & ~was_finished
