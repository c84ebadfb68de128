"""SMC speculative decoding (SMC-SD).

Emara et al. 2026, "Faster LLM Inference via Sequential Monte Carlo" (arXiv:2604.15672);
the steps below follow ``docs/smc-sd.md`` (the step numbers are its).

N particles share the prompt's KV. Each round every particle drafts K tokens from the draft
(one batched forward per token), the target scores all N x (K+1) positions in one forward,
each particle gets the incremental log-weight ``sum_k alpha log p_T(d_k) - log q_T(d_k)``
and a bonus token from the target; nothing is rejected, so every particle advances K+1
tokens. When ``ESS < kappa * N`` the particles are resampled (tokens and both KV caches).
At the end one particle is drawn in proportion to its weight.

Groups (``cfg.groups`` = G): the N particles form G groups of N/G, each weighted, resampled
and banked on its own (ESS against ``kappa * N/G``), as G independent SMC-SD runs sharing
each forward; at the end the groups count equally
(:func:`~smcspec.sampling.resampling.group_normalized_weights`). With G = 1 every step, and
the random stream, is that of plain SMC-SD.

Finished particles (``cfg.finished_particles``): by default a particle that ends (EOS, a
stop token, the budget) is *banked*: set aside with its share of the round's weight times
the mass still running, while all N slots are refilled from the running particles; the
output is drawn from the banked particles by mass. The paper's rule (``"keep"``) leaves it
among the running ones with its weight frozen, which at small N lets early endings win
against running weights whose logarithm drifts down round after round
(``docs/benchmarks/finished-particles/``). Banking needs normalised prefix targets, so it
runs at alpha = 1 without constraint or reward; elsewhere ``"keep"`` runs, and a kept
particle that ended follows a running one's tokens and KV rows (``_host_ended``), so that
with distinct rows it costs no row in the forwards that remain.

With top-k / top-p / min-p set (``docs/sampling.md``) the target is truncated and
renormalised (``p~``) at every step and the sampler targets ``prod_t p~(x_t | x_<t)^alpha``:
the weight is ``sum_k alpha log p~(d_k) - log q_T(d_k)`` (``-inf`` when a drafted token is
outside the target's kept set: that particle is resampled away), x0 and the bonus come from
``∝ p~^alpha`` and the bonus term is ``log sum_v p~(v)^alpha``. The draft proposes from its
*untruncated* ``q_T`` by default: importance sampling is consistent only if the proposal can
draw every token the target keeps, and a truncated draft ``q~`` cannot draw the tokens the
target keeps but the draft's own filter drops (``truncate_draft=True`` uses ``q~`` anyway;
its error stops falling with N, see ``docs/sampling.md``). With all three filters off the
code path is the one without truncation.

Streaming: a token is final once every particle holds it (resampling only copies
particles), so the common prefix of all particles is emitted round by round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

import smcspec.decoding.smc.cut as smc_cut
import smcspec.decoding.smc.potentials as smc_potentials
from smcspec.backends.base import KVCache
from smcspec.backends.pool import CacheNeed
from smcspec.config import GenerationConfig
from smcspec.decoding.caches import cache_capacity, run_on_caches
from smcspec.decoding.fused import fused_rounds, is_static, plain
from smcspec.decoding.job import Job, job_for
from smcspec.decoding.logprobs import TokenLogprobs
from smcspec.decoding.output import DecodeOutput, ParticleOutput, as_prompt_tensor
from smcspec.decoding.program import Forward, Prefill, Program, run_program, target_prefill
from smcspec.decoding.smc.fused import smc_block
from smcspec.decoding.smc.logprobs import ParticleLogprobs, Values, position_values
from smcspec.decoding.smc.stats import SmcStats
from smcspec.potentials import ConstraintClock, ConstraintState, DeadEndError, reorder, timed_start
from smcspec.sampling.distributions import sample_categorical, tempered_log_probs
from smcspec.sampling.resampling import (
    RESAMPLERS,
    effective_sample_sizes,
    group_normalized_weights,
    log_mean_weight,
)
from smcspec.sampling.smc_weights import (
    finished_shares,
    incremental_log_weights,
    power_target_probs,
)
from smcspec.sampling.truncation import truncate_log_probs

DEGENERATE_ESS = 1.1
"""A round whose ESS (before resampling) is below this counts in ``degenerate_rounds``."""


def _common_prefix(tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[int, list[int]]:
    """How many leading tokens every particle holds alike (int64 ``tokens`` ``[N, cap]``,
    ``lengths`` ``[N]``: the first column, below the shortest length, where they differ), and
    the first particle's row, in one host read."""
    cols = torch.arange(tokens.shape[1], device=tokens.device)
    agree = (tokens == tokens[:1]).all(0) & (cols < lengths.min())
    upto = torch.where(agree, tokens.shape[1], cols).min()
    upto, *row = torch.cat((upto.view(1), tokens[0])).tolist()
    return upto, row


@dataclass
class _Particles:
    """The N particles of one request between rounds (tensors on the models' device)."""

    tokens: torch.Tensor  # int64 [N, cap]: generated tokens, x0 in column 0
    lengths: torch.Tensor  # int64 [N]
    finished: torch.Tensor  # bool [N]
    logw: torch.Tensor  # float64 [N]: log-weights since the last resampling
    pending_t: torch.Tensor  # int64 [N, 1]: not yet fed to the target
    pending_d: torch.Tensor  # int64 [N, 1 or 2]: not yet fed to the draft
    phi: torch.Tensor  # float64 [N]: log twist of each prefix (0 without prefix_fn)
    log_z: torch.Tensor  # float64 [G]: each group's log-normaliser estimate so far
    log_running: torch.Tensor  # float64 [G]: banking: each group's running mass (log)
    states: list[ConstraintState] = field(default_factory=list)  # matchers (constraint)
    dead: int = 0  # particles killed by dead ends
    width: int = 1  # the common length of the running particles (tokens written)
    rounds: int = 0
    cut_rounds: int = 0  # round_end "ess": rounds cut before their K-th drafted token
    stopped_early: bool = False  # stop_epsilon ended the request before every particle
    resamples: int = 0
    ess_trace: list[float] = field(default_factory=list)
    equal_start: bool = True  # the round being run began with equal weights
    fresh_ess: list[float] = field(default_factory=list)  # ESS of such rounds
    # banking: ended particles (tokens, log probability mass, group)
    banked: list[tuple[list[int], float, int]] = field(default_factory=list)
    # keep rule: int64 [N], the running particle whose KV rows and tokens each row follows
    # (itself while running; see _host_ended), or None before any particle ended
    host: torch.Tensor | None = None
    # requests that ask for logprobs: every particle's tokens' values (smc_logprobs)
    logprobs: ParticleLogprobs | None = None


@dataclass
class _Block:
    """One round's proposal: K drafted tokens per particle and what the target made of them."""

    drafted: torch.Tensor  # int64 [N, K]
    draft_lp: torch.Tensor  # float32 [N, K]: log q of each drafted token
    dead_pos: torch.Tensor | None  # int64 [N]: block position of a dead end (K+2: none)
    open_: torch.Tensor | None  # bool [N]: still consuming tokens (constraint)
    target_lp: torch.Tensor | None = None  # float32 [N, K]: log p~ of each drafted token
    bonus: torch.Tensor | None = None  # int64 [N]: the target's token at position K+1
    bonus_norm: torch.Tensor | None = None  # float64 [N]: the bonus log-weight (or None)
    # round_end "ess": the target's logits at every position (float32 [N, K+1, V]), whose
    # row at the cut gives the deferred bonus, and the tokens each matcher consumed
    logits: torch.Tensor | None = None
    consumed: torch.Tensor | None = None  # int64 [N] (constraint)
    # requests that ask for logprobs: the constraint's mask at each drafted position (bool
    # [N, V] each) and the values of the block's tokens ([N, K or K+1] positions)
    masks: list[torch.Tensor] = field(default_factory=list)
    values: Values | None = None


def smc_caches(cfg: GenerationConfig, prompt_len: int) -> list[CacheNeed]:
    """The KV caches :func:`smc_program` opens: N rows on the target and N on the draft,
    room for the budget plus the last round's overshoot."""
    cap = cache_capacity(cfg.max_new_tokens, cfg.draft_tokens)
    n = cfg.particles
    share = cfg.shared_rows
    return [
        CacheNeed("target", n, cap, prompt_len, share),
        CacheNeed("draft", n, cap, prompt_len, share),
    ]


def smc_program(job: Job) -> Program:
    """Run SMC-SD for one request.

    ``job``: the request (:class:`~smcspec.decoding.job.Job`): the models (sharing a
    vocabulary), the prompt, ``job.config`` (N, K, temperatures, alpha, kappa, resampler,
    budget, and top-k / top-p / min-p, applied to the target; see the module docstring), the
    stop tokens that end a particle, and ``job.truncate_draft``: draft from the truncated
    ``q~`` (same filters as the target) instead of ``q_T``, not consistent for ``p~`` when
    the draft's kept set misses tokens the target keeps, kept for comparison
    (``docs/sampling.md``). Yields :class:`Prefill`/:class:`Forward` requests (see
    :mod:`smcspec.decoding.program`), or one :class:`~smcspec.decoding.program.Round` per
    round (steps 3a, 3b, 3d) where the models run rounds fused.

    With ``cfg.constraint`` (a compiled :class:`~smcspec.potentials.TokenConstraint`) or
    ``cfg.reward`` the sampler targets ``p~(x)^alpha Psi(x)`` (``docs/constraints.md``): every
    particle draws its own x0 from the masked power target, drafts from the masked draft
    ``q' ∝ q_T m`` with weight ``alpha log p~(d_k) - log q'(d_k)``, and draws the bonus from
    ``∝ p~^alpha m`` with weight ``log sum_v p~(v)^alpha m(v)``; a particle at a dead end (an
    empty mask) gets weight zero; a reward with ``prefix_fn`` multiplies the weight by
    ``phi(new)/phi(old)`` each round, one without by ``exp(beta R(x))`` at the end.

    Raises:
        DeadEndError: with a constraint or reward, every particle reached a dead end.

    Returns:
        :class:`DecodeOutput` with the chosen particle's tokens;
        :class:`~smcspec.decoding.smc.stats.SmcStats`: ``rounds``,
        ``resamples``, ``mean_ess``, ``min_ess`` (over rounds, before resampling),
        ``degenerate_rounds`` (rounds whose ESS before resampling was below 1.1: the
        weights had collapsed onto one particle, and that round was only importance
        sampling of the draft; 0 at N=1), ``mean_round_ess`` (the mean ESS of the rounds
        that began with equal weights: at the start and after each resampling; the
        quantity :func:`smcspec.tuning.predict.predicted_ess` predicts),
        ``degenerate_weights`` (1 if every final weight was zero and the output particle
        was drawn uniformly; an all-zero weight vector has ESS = N, so it never triggers
        resampling);
        with ``cfg.return_particles`` also all particles, their normalised weights and the
        log-normaliser estimate (sum over resampling events of ``logsumexp(logw) - log N``,
        plus the same term for the final weights). With a constraint or reward the stats
        also hold ``log_normalizer`` (including x0's masked mass) and ``dead_particles``, and
        with a constraint ``constraint_seconds`` (wall seconds in masks, matchers and their
        copies on resampling); ``distinct_rows_target`` and ``distinct_rows_draft``: the
        rows each model computed over the rows it was fed, over the request (1.0 when no
        two particles shared a row, or with ``cfg.shared_rows`` off).

    ``cfg.temperature`` must be > 0: a greedy (point-mass) target has no importance weights;
    :class:`~smcspec.engine.Engine` runs greedy requests of ``smc`` as greedy ``sd``.
    """
    cfg = job.config
    if cfg.greedy:
        raise ValueError("SMC-SD needs temperature > 0 (greedy requests run as greedy sd)")
    fused = fused_rounds(job.target, job.draft) and plain(cfg)
    return (yield from run_on_caches(job, smc_caches(cfg, len(job.ids)), _smc_rounds, fused))


def _smc_rounds(job: Job, tcache: KVCache, dcache: KVCache) -> Program:
    cfg = job.config
    cap = cache_capacity(cfg.max_new_tokens, cfg.draft_tokens)
    # 1. prefill once per model (shared prefix KV); x0 from the target's power distribution
    first, prompt_lps = yield from target_prefill(job, tcache)
    first = first[: job.vocab]
    yield Prefill(job.draft, as_prompt_tensor(job.ids, job.device), dcache)
    ps, clock = _initial_particles(job, first, cap)
    emitted = _emit(ps, 0, job)
    fused = not cfg.has_potential and is_static(tcache, dcache)
    while not bool(ps.finished.all()) and not _mass_stop(job, ps):
        lengths0 = (tcache.length, dcache.length, ps.pending_d.shape[1])
        if fused:  # 3a, 3b, 3d as one round on the device
            block = yield from _fused_block(job, ps, tcache, dcache)
        else:
            block = yield from _draft_block(job, ps, dcache)  # 3a
            yield from _score_block(job, ps, block, tcache)  # 3b, 3d
        was_running = ~ps.finished
        if block.logits is None:  # round_end "block": the whole block and its bonus
            newly_finished = _advance(job, ps, block)  # 3c, 3e, 4
            _end_round(job, ps, newly_finished, was_running, tcache, dcache)  # 3f, banking
        else:  # round_end "ess": resample where the ESS falls, the bonus after it
            cut = smc_cut.cut_position(job, ps, block)
            newly_finished = _advance(job, ps, block, cut)
            anc = _end_round(job, ps, newly_finished, was_running, tcache, dcache)
            smc_cut.truncate(tcache, dcache, lengths0, cut, job.config.draft_tokens)
            ended = smc_cut.deferred_bonus(job, ps, block, anc, cut)
            if bool(ended.any()):  # particles the bonus ended: banked now
                _end_round(job, ps, ended, ended, tcache, dcache, bank_only=True)
        _host_ended(ps, tcache, dcache)
        emitted = _emit(ps, emitted, job)
    keep = cfg.return_particles or cfg.vote is not None  # the vote reads every particle
    out = _output(job, ps, keep, emitted, clock, tcache, dcache)
    out.prompt_logprobs = prompt_lps
    return out


def _initial_particles(
    job: Job, first: torch.Tensor, cap: int
) -> tuple[_Particles, ConstraintClock | None]:
    """Steps 1-2: x0 for every particle and uniform log-weights. Without potentials all
    particles share one x0 from ``∝ p~^alpha``; with them each particle draws its own from
    ``∝ p~^alpha m`` (a shared x0 would stay biased) and ``log_z`` starts at x0's masked
    mass. ``first``: float32 ``[V]`` logits after the prompt. Raises :class:`DeadEndError`."""
    cfg = job.config
    n, dev = cfg.particles, job.device
    tokens = torch.zeros(n, cap, dtype=torch.long, device=dev)
    ps = _Particles(
        tokens=tokens,
        lengths=torch.ones(n, dtype=torch.long, device=dev),
        finished=torch.zeros(n, dtype=torch.bool, device=dev),
        logw=torch.zeros(n, dtype=torch.float64, device=dev),  # 2. uniform start
        pending_t=tokens[:, :1],
        pending_d=tokens[:, :1],
        phi=torch.zeros(n, dtype=torch.float64, device=dev),
        log_z=torch.zeros(cfg.groups, dtype=torch.float64),
        log_running=torch.zeros(cfg.groups, dtype=torch.float64),
    )
    clock = None
    if not cfg.has_potential:
        probs = power_target_probs(first, cfg.temperature, cfg.alpha, cfg.truncation, False)[0]
        x0 = int(sample_categorical(probs, job.generator))
        tokens[:, 0] = x0
        done = x0 in job.stop_ids or cfg.max_new_tokens == 1
        ps.finished = torch.full((n,), done, dtype=torch.bool, device=dev)
        m0 = None
    else:
        root, clock = timed_start(job.constraint) if job.constraint is not None else (None, None)
        m0 = smc_potentials.masks(
            job.constraint, [root], torch.ones(1, dtype=torch.bool), job.vocab, dev
        )
        probs0, lz0 = smc_potentials.masked_power_target(
            first[None], cfg.temperature, cfg.alpha, cfg.truncation, m0
        )
        if not math.isfinite(float(lz0[0])):
            raise DeadEndError("no first token is allowed by the constraint (dead end)")
        ps.log_z += float(lz0[0])  # x0's weight, the same for every particle
        x0s = sample_categorical(probs0.expand(n, -1), job.generator)
        tokens[:, 0] = x0s
        ps.finished = torch.isin(x0s, job.stop_tensor) | (cfg.max_new_tokens == 1)
        if root is not None:
            ps.states = [root.copy() for _ in range(n)]
            bad = smc_potentials.consume(ps.states, ~ps.finished, x0s)
            if bad:  # the matcher refused a token its own mask allowed: a dead end
                ps.logw[bad] = -math.inf
                ps.finished[bad] = True
                ps.dead += len(bad)
        if cfg.twisted:
            ps.phi = smc_potentials.log_twist(cfg.reward, tokens, ps.lengths, ps.finished, dev)
            ps.logw = ps.phi.clone()
    ps.pending_t = tokens[:, :1].clone()
    ps.pending_d = tokens[:, :1].clone()
    if job.wants_logprobs:  # x0's values, from the target's row after the prompt
        ps.logprobs = ParticleLogprobs.start(n, cap, cfg.logprobs, dev)
        rows = first[None].expand(n, -1)[:, None]
        masks = m0.expand(n, -1)[:, None] if m0 is not None else None
        values = position_values(cfg, rows, tokens[:, :1], masks)
        ps.logprobs.write(0, torch.zeros_like(ps.finished), values)
    return ps, clock


def _draft_block(job: Job, ps: _Particles, dcache: KVCache) -> Program:
    """Step 3a: K draft forwards (deferred bonus: the first feeds 1-2 tokens per particle),
    each token from ``q_T`` (``q'`` ∝ ``q_T m`` with a constraint). Returns a :class:`_Block`."""
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
            m = smc_potentials.masks(job.constraint, ps.states, open_, job.vocab, dev)
            empty = ~m.any(-1)  # a dead end at block position j+1
            dead_pos = torch.where(empty & open_, j + 1, dead_pos)
            open_ = open_ & ~empty
            lq = smc_potentials.masked_proposal(lq, m | empty[:, None])  # q' (junk rows: dead)
            if job.wants_logprobs:
                masks.append(m)
        d = sample_categorical(lq.exp(), job.generator)
        if ps.host is not None:  # ended rows draft what their host drafts (_host_ended)
            d = d[ps.host]
        drafted[:, j] = d
        draft_lp[:, j] = lq.gather(-1, d[:, None])[:, 0]
        if job.constraint is not None:
            open_ = open_ & ~torch.isin(d, job.stop_tensor)
            bad = smc_potentials.consume(ps.states, open_, d)
            if bad:  # d_{j+1} itself was refused: dead at block position j+1
                dead_pos[bad] = torch.clamp(dead_pos[bad], max=j + 1)
                open_[bad] = False
            consumed += open_.long()
        x = d[:, None]
    b = _Block(drafted, draft_lp, dead_pos, open_)
    b.consumed, b.masks = consumed, masks
    return b


def _fused_block(job: Job, ps: _Particles, tcache: KVCache, dcache: KVCache) -> Program:
    """Steps 3a, 3b and 3d as one :class:`~smcspec.decoding.program.Round`
    (:func:`smcspec.decoding.smc.fused.smc_block`): the same draws as :func:`_draft_block` and
    :func:`_score_block`, without a host read between the forwards."""
    out = yield from smc_block(job, ps.pending_d, ps.pending_t, ps.host, tcache, dcache)
    b = _Block(out["drafted"], out["draft_lp"], None, None, out["target_lp"], out.get("bonus"))
    b.bonus_norm, b.logits = out.get("bonus_norm"), out.get("logits")
    return b


def _score_block(job: Job, ps: _Particles, b: _Block, tcache: KVCache) -> Program:
    """Steps 3b and 3d: one target forward over ``[v, d_1..d_K]`` for every particle; fills
    ``b.target_lp`` and the bonus token at position K+1 from ``∝ p~^alpha`` (``∝ p~^alpha m``
    with a potential, whose bonus weight is ``log sum_v p~(v)^alpha m(v)``). With round_end
    "ess" the bonus waits for the cut: ``b.logits`` keeps the target's logits instead."""
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
    m = None
    if cfg.has_potential:  # after all K drafted tokens
        m = smc_potentials.masks(job.constraint, ps.states, b.open_, job.vocab, job.device)
        probs, norm = smc_potentials.masked_power_target(
            t_logits[:, k], cfg.temperature, cfg.alpha, cfg.truncation, m
        )
        empty = ~m.any(-1) | ~torch.isfinite(norm)
        b.dead_pos = torch.where(empty & b.open_, k + 1, b.dead_pos)
        b.bonus_norm = torch.where(empty, torch.zeros_like(norm), norm)
    else:
        probs, b.bonus_norm = power_target_probs(
            t_logits[:, k], cfg.temperature, cfg.alpha, cfg.truncation
        )
    b.bonus = sample_categorical(probs, job.generator)
    if ps.host is not None:
        b.bonus = b.bonus[ps.host]
    if b.values is not None:  # the bonus's values, beside the drafted tokens'
        mask = m[:, None] if m is not None and job.constraint is not None else None
        bonus = position_values(cfg, t_logits[:, k : k + 1], b.bonus[:, None], mask)
        b.values = tuple(torch.cat((a, c), 1) for a, c in zip(b.values, bonus, strict=True))
    if job.constraint is not None:
        alive = b.open_ & (b.dead_pos > k + 1) & ~torch.isin(b.bonus, job.stop_tensor)
        bad = smc_potentials.consume(ps.states, alive, b.bonus)
        b.dead_pos[bad] = k + 1


def _advance(job: Job, ps: _Particles, b: _Block, cut: int | None = None) -> torch.Tensor:
    """Steps 3c, 3e and 4: how much of the block each particle keeps (EOS and
    ``max_new_tokens`` cut it), the incremental log-weights, dead ends (weight zero), the
    twist ``phi(new) / phi(old)``, and the new tokens. ``cut`` (round_end "ess"): the block is
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
    block_pos = torch.arange(1, m + 1, device=job.device)
    first_stop = torch.where(torch.isin(block, job.stop_tensor), block_pos, m + 1).min(1).values
    kept = torch.minimum(first_stop.clamp(max=m), cfg.max_new_tokens - ps.lengths)
    kept = torch.where(ps.finished, torch.zeros_like(kept), kept)
    ps.logw = ps.logw + incremental_log_weights(
        b.target_lp[:, : min(m, k)], b.draft_lp[:, : min(m, k)], cfg.alpha, norm, kept
    )
    killed = None
    if cfg.has_potential:  # a particle that reached a dead end inside what it keeps dies
        killed = ~ps.finished & (b.dead_pos <= kept)
        ps.logw = torch.where(killed, torch.full_like(ps.logw, -math.inf), ps.logw)
        ps.dead += int(killed.sum())
    start = ps.width  # every unfinished particle has this length
    window = ps.tokens[:, start : start + m]
    ps.tokens[:, start : start + m] = torch.where(ps.finished[:, None], window, block)
    if ps.logprobs is not None:
        ps.logprobs.write(start, ps.finished, tuple(v[:, :m] for v in b.values))
    ps.width += m
    ps.lengths = ps.lengths + kept
    was_finished = ps.finished
    ps.finished = ps.finished | (first_stop <= kept) | (ps.lengths >= cfg.max_new_tokens)
    if killed is not None:
        ps.finished = ps.finished | killed
        if cfg.twisted:  # 3e'. twist: times phi(new prefix) / phi(old prefix)
            grew = ~was_finished & ~killed
            new_phi = smc_potentials.log_twist(
                cfg.reward, ps.tokens, ps.lengths, ps.finished, job.device, grew
            )
            ps.logw = torch.where(grew, ps.logw + new_phi - ps.phi, ps.logw)
            ps.phi = torch.where(grew, new_phi, ps.phi)
        if not bool(torch.isfinite(ps.logw).any()):
            raise DeadEndError(
                "every particle reached a dead end of the constraint (no allowed "
                "continuation has target probability)"
            )
    if cut is None:
        ps.pending_t = b.bonus[:, None]
        ps.pending_d = torch.stack((b.drafted[:, -1], b.bonus), 1)
    ps.rounds += 1
    return ps.finished & ~was_finished


def _end_round(
    job: Job,
    ps: _Particles,
    ended: torch.Tensor,
    was_running: torch.Tensor,
    tcache: KVCache,
    dcache: KVCache,
    bank_only: bool = False,
) -> torch.Tensor:
    """The end of a round, group by group (one group without ``cfg.groups``): a group in
    which particles ended this round banks them (:func:`_bank_group`, under the bank rule);
    any other group that ran this round is resampled if its ESS fell below ``kappa`` times
    its size (step 3f, :func:`_resample_group`; not with ``bank_only``, a second banking
    after the deferred bonus of round_end "ess"). The ancestors of every group are then
    taken at once and returned (int64 ``[N]``, ``arange`` where nothing moved). ``ended``,
    ``was_running``: bool ``[N]``. The ESS recorded for the round is the sum of the groups'
    ESS."""
    cfg = job.config
    anc = torch.arange(cfg.particles, device=ps.logw.device)
    reset = torch.zeros(cfg.particles, dtype=torch.bool, device=ps.logw.device)
    ess = effective_sample_sizes([ps.logw[cfg.group(g)] for g in range(cfg.groups)])
    if not bank_only:
        ps.ess_trace.append(sum(ess))
        if ps.equal_start:
            ps.fresh_ess.append(ps.ess_trace[-1])
        ps.equal_start = False
    # which groups ran this round and which had particles end in it: one host read
    ran, ends = torch.stack((was_running, ended)).view(2, cfg.groups, -1).any(2).tolist()
    reset_groups = [False] * cfg.groups
    for g in range(cfg.groups):
        sl = cfg.group(g)
        if not ran[g]:
            continue  # every particle of the group had ended before this round
        if cfg.banks_finished and ends[g]:
            a = _bank_group(job, ps, g, ended)
        elif bank_only:
            continue
        else:
            a = _resample_group(job, ps, g, ess[g])
        if a is not None:
            anc[sl] = sl.start + a
            reset[sl] = reset_groups[g] = True
    if any(reset_groups):
        _take_ancestors(ps, anc, reset, all(reset_groups), tcache, dcache)
    return anc


def _mass_stop(job: Job, ps: _Particles) -> bool:
    """Whether the request may end before every particle has (``cfg.stop_epsilon``, the bank
    rule): every group has banked a particle and the particles still running carry less than
    ``stop_epsilon`` of the probability mass (the mean of the groups' running masses, the
    groups counting equally). Their descendants could take at most that mass, so drawing the
    output from the bank now moves its distribution by at most ``stop_epsilon`` in total
    variation (``docs/smc-sd.md``, "Stopping when the running mass is small"). The running
    particles are then marked ended and left out of the output."""
    cfg = job.config
    if cfg.stop_epsilon <= 0 or not cfg.banks_finished or not ps.banked:
        return False
    if len({g for _, m, g in ps.banked if m > -math.inf}) < cfg.groups:
        return False
    if float(ps.log_running.exp().mean()) >= cfg.stop_epsilon:
        return False
    ps.finished[:] = True
    ps.stopped_early = True
    return True


def _bank_group(job: Job, ps: _Particles, g: int, ended: torch.Tensor) -> torch.Tensor | None:
    """Bank the particles of group ``g`` that ended this round (``ended``: bool ``[N]``) and
    return the group's new ancestors (int64 ``[N/G]``, indices within the group), drawn from
    its running particles; None when none of them runs on with any weight (the group ends).

    Each ended particle is set aside with probability mass ``running mass x its normalised
    weight`` (:func:`~smcspec.sampling.smc_weights.finished_shares`); the running mass shrinks
    to its own share; the running particles are resampled into all the group's slots (an
    unbiased resampling among them, so the SMC estimate stays consistent) and restart at
    equal weights. The output is later drawn from the banked particles in proportion to their
    mass (:func:`_output`)."""
    cfg = job.config
    sl = cfg.group(g)
    log_shares, log_run = finished_shares(ps.logw[sl], ended[sl])
    for i in ended[sl].nonzero()[:, 0].tolist():  # zero-weight ones too (mass -inf): listed
        j = sl.start + i
        seq = ps.tokens[j, : int(ps.lengths[j])].tolist()
        ps.banked.append((seq, float(ps.log_running[g]) + float(log_shares[i]), g))
        if ps.logprobs is not None:
            ps.logprobs.bank(j, seq)
    ps.log_running[g] += log_run
    running = ~ps.finished[sl]
    if not math.isfinite(log_run) or not bool(running.any()):
        ps.finished[sl] = True  # nothing left to run in this group
        return None
    logw = torch.where(running, ps.logw[sl], torch.full_like(ps.logw[sl], -math.inf))
    return RESAMPLERS[cfg.resampler](logw, job.generator)


def _host_ended(ps: _Particles, tcache: KVCache, dcache: KVCache) -> None:
    """Under the keep rule, make the particles that ended cost no rows.

    An ended particle takes no more tokens and its weight is frozen; at a resampling its
    copies are ended too, so its KV rows are never read again, yet every forward is fed all
    N rows. Each ended row is therefore pointed at a running particle (its *host*): both of
    its KV rows become copies of the host's (:meth:`KVCache.reorder`, only where they are not
    already on the host's history), it is fed the host's pending tokens, and every later
    round it drafts the host's tokens and takes its bonus (``ps.host``, applied after the
    draws, so the running particles' draws and the random stream are unchanged). With
    distinct rows (:mod:`smcspec.backends.shared_rows`) the forwards then compute each host
    once for all the rows that follow it. The ended particles' tokens, lengths and weights
    are untouched: the output is the same sequence of draws as without hosts.
    """
    if not (tcache.histories.shared and dcache.histories.shared):
        return  # every row is computed anyway: nothing to save
    ended = ps.finished.tolist()
    running = [i for i, e in enumerate(ended) if not e]
    if not running or len(running) == len(ended):
        ps.host = None
        return
    t_node, d_node = tcache.histories.node, dcache.histories.node
    on_node = {(t_node[i], d_node[i]): i for i in reversed(running)}
    host = list(range(len(ended)))
    moved = False
    for i, e in enumerate(ended):
        if e:
            h = on_node.get((t_node[i], d_node[i]))
            if h is None:  # not on a running particle's history: move it onto the first's
                h, moved = running[0], True
            host[i] = h
    if moved:
        anc = torch.tensor(host, dtype=torch.long)
        tcache.reorder(anc)
        dcache.reorder(anc)
    ps.host = torch.tensor(host, dtype=torch.long, device=ps.finished.device)
    ps.pending_t = ps.pending_t[ps.host]
    ps.pending_d = ps.pending_d[ps.host]


def _resample_group(job: Job, ps: _Particles, g: int, ess: float) -> torch.Tensor | None:
    """Step 3f for group ``g``, whose ESS is ``ess``: when ``ess < kappa * N/G``, add its
    ``log mean w`` to its ``log_z`` and return its ancestors (int64 ``[N/G]``, indices within
    the group); otherwise None."""
    cfg = job.config
    lw = ps.logw[cfg.group(g)]
    m = cfg.group_size
    if m < 2 or ess >= cfg.ess_threshold * m:
        return None
    ps.log_z[g] += log_mean_weight(lw)
    return RESAMPLERS[cfg.resampler](lw, job.generator)


def _take_ancestors(
    ps: _Particles,
    anc: torch.Tensor,
    reset: torch.Tensor,
    all_reset: bool,
    tcache: KVCache,
    dcache: KVCache,
) -> None:
    """Make particle ``i`` a copy of particle ``anc[i]`` (int64 ``[N]``): tokens, lengths,
    ended flags, pending tokens, both KV caches, twists and matchers; the particles in
    ``reset`` (bool ``[N]``: the groups resampled or banked; ``all_reset``: every group) restart
    at equal log-weights.
    Serves resampling and banking alike."""
    ps.tokens, ps.lengths, ps.finished = ps.tokens[anc], ps.lengths[anc], ps.finished[anc]
    ps.pending_t, ps.pending_d = ps.pending_t[anc], ps.pending_d[anc]
    tcache.reorder(anc)
    dcache.reorder(anc)
    ps.phi = ps.phi[anc]
    if ps.logprobs is not None:
        ps.logprobs.reorder(anc)
    if ps.states:
        ps.states = reorder(ps.states, anc)
    ps.logw = torch.where(reset, torch.zeros_like(ps.logw), ps.logw)
    ps.equal_start = all_reset
    ps.resamples += 1


def _emit(
    ps: _Particles,
    emitted: int,
    job: Job,
    final: list[int] | None = None,
    final_logprobs: TokenLogprobs | None = None,
) -> int:
    """Stream the tokens every particle holds, banked ones included (final: resampling only
    copies particles), with the first particle's log-probabilities of them where the
    request asks (the same prefix in every particle: the same distributions), or the rest
    of the ``final`` output with its ``final_logprobs``; returns how many tokens have been
    emitted."""
    if final is None:
        upto, row = _common_prefix(ps.tokens, ps.lengths)
        held = row[:upto]
        for seq, _, _ in ps.banked:
            upto = min(upto, _shared_len(seq, held))
        seq = row[:upto]
    else:
        upto, seq = len(final), final
    if upto > emitted and (job.on_tokens or job.on_logprobs):
        new, lps = seq[emitted:upto], None
        if final_logprobs is not None:
            lps = final_logprobs.slice(emitted, upto)
        elif ps.logprobs is not None and job.on_logprobs is not None:
            lps = ps.logprobs.row(0, new, emitted)
        job.emit(new, lps)
    return max(emitted, upto)


def _shared_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _output(
    job: Job,
    ps: _Particles,
    return_particles: bool,
    emitted: int,
    clock: ConstraintClock | None,
    tcache: KVCache,
    dcache: KVCache,
) -> DecodeOutput:
    """Step 5: a reward without twist enters the final weights; one particle is drawn in
    proportion to its weight (banked particles: to their mass; with groups, normalised
    within each group and the groups counted equally) and streamed to the end; stats and
    (optionally) all particles. The log-normaliser estimate is the mean of the groups'."""
    cfg = job.config
    n = cfg.particles
    if cfg.reward is not None and not cfg.twisted:  # the whole reward at the end
        alive = torch.isfinite(ps.logw)
        seqs = [ps.tokens[i, : int(ps.lengths[i])].tolist() for i in range(n)]
        final = cfg.reward.log_potential(seqs, prefix=False).to(job.device)
        ps.logw = torch.where(alive, ps.logw + final, ps.logw)
    if ps.banked:  # every particle was banked when it ended: the candidates are those
        seqs = [seq for seq, _, _ in ps.banked]
        masses = torch.tensor([m for _, m, _ in ps.banked], dtype=torch.float64)
        group_ids = torch.tensor([g for _, _, g in ps.banked], dtype=torch.long)
        ps.log_z.zero_()  # alpha = 1 without potentials: the target is normalised (Z = 1)
    else:
        seqs = [ps.tokens[i, : int(ps.lengths[i])].tolist() for i in range(n)]
        masses = ps.logw
        group_ids = torch.arange(n, device=ps.logw.device) // cfg.group_size
        for g in range(cfg.groups):
            log_mean = log_mean_weight(ps.logw[cfg.group(g)])
            if log_mean != -math.inf:  # a group with no weight left adds nothing
                ps.log_z[g] += log_mean
    w, all_inf = group_normalized_weights(masses, group_ids, cfg.groups)
    log_z = float(torch.logsumexp(ps.log_z, 0)) - math.log(cfg.groups)
    choice = int(sample_categorical(w.to(job.device), job.generator)) if len(seqs) > 1 else 0
    lps = None
    if ps.logprobs is not None:  # the drawn particle's
        lps = ps.logprobs.banked[choice] if ps.banked else ps.logprobs.row(choice, seqs[choice])
    _emit(ps, emitted, job, seqs[choice], lps)
    stats = _stats(cfg, ps, all_inf, tcache, dcache)
    if ps.banked:  # the banked particles' total probability mass (per group): 1 once all ended
        stats.banked_mass = float(torch.logsumexp(masses, 0).exp()) / cfg.groups
    if cfg.has_potential:
        stats.log_normalizer, stats.dead_particles = log_z, ps.dead
    if clock is not None:
        stats.constraint_seconds = clock.seconds
    particles = None
    if return_particles:
        particles = [ParticleOutput(seq, float(wi)) for seq, wi in zip(seqs, w, strict=True)]
    return DecodeOutput(
        tokens=seqs[choice],
        stats=stats,
        particles=particles,
        log_normalizer=log_z if math.isfinite(log_z) else None,
        logprobs=lps,
    )


def _stats(
    cfg: GenerationConfig, ps: _Particles, all_inf: bool, tcache: KVCache, dcache: KVCache
) -> SmcStats:
    """The request's :class:`SmcStats` from its rounds' ESS trace and the caches' counts of
    rows computed over rows fed (1.0 for a cache never fed)."""
    n, trace, fresh = cfg.particles, ps.ess_trace, ps.fresh_ess

    def distinct(cache: KVCache) -> float:
        h = cache.histories
        return h.computed / h.fed if h.fed else 1.0

    return SmcStats(
        particles=n,
        draft_tokens=cfg.draft_tokens,
        rounds=ps.rounds,
        resamples=ps.resamples,
        mean_ess=sum(trace) / len(trace) if trace else float(n),
        min_ess=min(trace) if trace else float(n),
        degenerate_weights=int(all_inf),
        # rounds whose weights had collapsed onto about one particle (ESS < 1.1)
        degenerate_rounds=sum(e < DEGENERATE_ESS for e in trace) if n > 1 else 0,
        # the ESS of rounds that began with equal weights (what the tuner predicts)
        mean_round_ess=sum(fresh) / len(fresh) if fresh else float(n),
        banked=len(ps.banked),
        distinct_rows_target=distinct(tcache),
        distinct_rows_draft=distinct(dcache),
        mean_round_tokens=(ps.width - 1) / ps.rounds if ps.rounds else 0.0,
        cut_rounds=ps.cut_rounds if cfg.round_end == "ess" else None,
        stopped_early=True if ps.stopped_early else None,
    )


def decode_smc(*args: Any, **kwargs: Any) -> DecodeOutput:
    """Run :func:`smc_program` to completion on its own, without an engine; arguments
    :func:`~smcspec.decoding.job.job_for`'s (target, draft, prompt, cfg, stop ids, vocab,
    generator, on_tokens, truncate_draft)."""
    return run_program(smc_program(job_for(*args, **kwargs)))
