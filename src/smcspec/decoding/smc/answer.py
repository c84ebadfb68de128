"""What SMC-SD streams and returns: the tokens every particle holds, as they become final
(:func:`emit`), and step 5, the answer drawn from the particles with its stats
(:func:`final_output`)."""

from __future__ import annotations

import math

import torch

from smcspec.backends.base import KVCache
from smcspec.config import GenerationConfig
from smcspec.decoding.job import Job
from smcspec.decoding.logprobs import TokenLogprobs
from smcspec.decoding.output import DecodeOutput, ParticleOutput
from smcspec.decoding.smc.particles import Particles
from smcspec.decoding.smc.stats import SmcStats
from smcspec.potentials import ConstraintClock
from smcspec.sampling.distributions import sample_categorical
from smcspec.sampling.resampling import group_normalized_weights, log_mean_weight

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


def emit(
    ps: Particles,
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
        for seq, _, _ in ps.bank.entries:
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


def final_output(
    job: Job,
    ps: Particles,
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
    banked = ps.bank.entries
    if banked:  # every particle was banked when it ended: the candidates are those
        seqs = [seq for seq, _, _ in banked]
        masses = torch.tensor([m for _, m, _ in banked], dtype=torch.float64)
        group_ids = torch.tensor([g for _, _, g in banked], dtype=torch.long)
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
        lps = ps.logprobs.banked[choice] if banked else ps.logprobs.row(choice, seqs[choice])
    emit(ps, emitted, job, seqs[choice], lps)
    stats = _request_stats(cfg, ps, all_inf, tcache, dcache)
    if banked:  # the banked particles' total probability mass (per group): 1 once all ended
        stats.banked_mass = float(torch.logsumexp(masses, 0).exp()) / cfg.groups
    if cfg.has_potential:
        stats.log_normalizer, stats.dead_particles = log_z, ps.tally.dead
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


def _request_stats(
    cfg: GenerationConfig, ps: Particles, all_inf: bool, tcache: KVCache, dcache: KVCache
) -> SmcStats:
    """The request's :class:`SmcStats` from its rounds' ESS trace and the caches' counts of
    rows computed over rows fed (1.0 for a cache never fed)."""
    n, trace, fresh = cfg.particles, ps.tally.ess_trace, ps.tally.fresh_ess

    def distinct(cache: KVCache) -> float:
        h = cache.histories
        return h.computed / h.fed if h.fed else 1.0

    return SmcStats(
        particles=n,
        draft_tokens=cfg.draft_tokens,
        rounds=ps.tally.rounds,
        resamples=ps.tally.resamples,
        mean_ess=sum(trace) / len(trace) if trace else float(n),
        min_ess=min(trace) if trace else float(n),
        degenerate_weights=int(all_inf),
        # rounds whose weights had collapsed onto about one particle (ESS < 1.1)
        degenerate_rounds=sum(e < DEGENERATE_ESS for e in trace) if n > 1 else 0,
        # the ESS of rounds that began with equal weights (what the tuner predicts)
        mean_round_ess=sum(fresh) / len(fresh) if fresh else float(n),
        banked=len(ps.bank.entries),
        distinct_rows_target=distinct(tcache),
        distinct_rows_draft=distinct(dcache),
        mean_round_tokens=(ps.width - 1) / ps.tally.rounds if ps.tally.rounds else 0.0,
        cut_rounds=ps.tally.cut_rounds if cfg.round_end == "ess" else None,
        stopped_early=True if ps.tally.stopped_early else None,
    )
