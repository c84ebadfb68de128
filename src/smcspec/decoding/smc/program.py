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
particle that ended follows a running one's tokens and KV rows
(:func:`.round_end.host_ended`), so that with distinct rows it costs no row in the forwards
that remain.

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

from typing import Any

import smcspec.decoding.smc.answer as answer
import smcspec.decoding.smc.block as block
import smcspec.decoding.smc.cut as cut
import smcspec.decoding.smc.round_end as round_end
from smcspec.backends.base import KVCache
from smcspec.backends.pool import CacheNeed
from smcspec.config import GenerationConfig
from smcspec.decoding.caches import cache_capacity, run_on_caches
from smcspec.decoding.fused import fused_rounds, is_static, plain
from smcspec.decoding.job import Job, job_for
from smcspec.decoding.output import DecodeOutput, as_prompt_tensor
from smcspec.decoding.program import Prefill, Program, run_program, target_prefill
from smcspec.decoding.smc.particles import initial_particles


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
    """Steps 1 to 5 on the request's caches: the prefills and x0, then rounds (the proposal,
    :mod:`.block`; its end, :mod:`.round_end`; cut rounds, :mod:`.cut`) until every particle
    has ended, streaming what every particle holds and drawing the answer (:mod:`.answer`)."""
    cfg = job.config
    cap = cache_capacity(cfg.max_new_tokens, cfg.draft_tokens)
    # 1. prefill once per model (shared prefix KV); x0 from the target's power distribution
    first, prompt_lps = yield from target_prefill(job, tcache)
    first = first[: job.vocab]
    yield Prefill(job.draft, as_prompt_tensor(job.ids, job.device), dcache)
    ps, clock = initial_particles(job, first, cap)
    emitted = answer.emit(ps, 0, job)
    fused = not cfg.has_potential and is_static(tcache, dcache)
    while not bool(ps.finished.all()) and not round_end.mass_stop(job, ps):
        lengths0 = (tcache.length, dcache.length, ps.pending_d.shape[1])
        if fused:  # 3a, 3b, 3d as one round on the device
            b = yield from block.fused_block(job, ps, tcache, dcache)
        else:
            b = yield from block.draft_block(job, ps, dcache)  # 3a
            yield from block.score_block(job, ps, b, tcache)  # 3b, 3d
        was_running = ~ps.finished
        if b.logits is None:  # round_end "block": the whole block and its bonus
            newly_finished = block.advance(job, ps, b)  # 3c, 3e, 4
            round_end.end_round(job, ps, newly_finished, was_running, tcache, dcache)  # 3f, banking
        else:  # round_end "ess": resample where the ESS falls, the bonus after it
            at = cut.cut_position(job, ps, b)
            newly_finished = block.advance(job, ps, b, at)
            anc = round_end.end_round(job, ps, newly_finished, was_running, tcache, dcache)
            cut.truncate(tcache, dcache, lengths0, at, job.config.draft_tokens)
            ended = cut.deferred_bonus(job, ps, b, anc, at)
            if bool(ended.any()):  # particles the bonus ended: banked now
                round_end.end_round(job, ps, ended, ended, tcache, dcache, bank_only=True)
        round_end.host_ended(ps, tcache, dcache)
        emitted = answer.emit(ps, emitted, job)
    keep = cfg.return_particles or cfg.vote is not None  # the vote reads every particle
    out = answer.final_output(job, ps, keep, emitted, clock, tcache, dcache)
    out.prompt_logprobs = prompt_lps
    return out


def decode_smc(*args: Any, **kwargs: Any) -> DecodeOutput:
    """Run :func:`smc_program` to completion on its own, without an engine; arguments
    :func:`~smcspec.decoding.job.job_for`'s (target, draft, prompt, cfg, stop ids, vocab,
    generator, on_tokens, truncate_draft)."""
    return run_program(smc_program(job_for(*args, **kwargs)))
