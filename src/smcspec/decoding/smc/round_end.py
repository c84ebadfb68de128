"""The end of an SMC-SD round (``docs/smc-sd.md``, step 3f and "Finished particles"): group by
group, banking the particles that ended or resampling where the ESS fell, the copies of the
ancestors taken at once; the epsilon stop of the bank rule; and, under the keep rule, the
ended particles pointed at running hosts so that they cost no rows."""

from __future__ import annotations

import math

import torch

from smcspec.backends.base import KVCache
from smcspec.decoding.job import Job
from smcspec.decoding.smc.particles import Particles
from smcspec.potentials import reorder
from smcspec.sampling.resampling import RESAMPLERS, effective_sample_sizes, log_mean_weight
from smcspec.sampling.smc_weights import finished_shares


def end_round(
    job: Job,
    ps: Particles,
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
        ps.tally.ess_trace.append(sum(ess))
        if ps.tally.equal_start:
            ps.tally.fresh_ess.append(ps.tally.ess_trace[-1])
        ps.tally.equal_start = False
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


def mass_stop(job: Job, ps: Particles) -> bool:
    """Whether the request may end before every particle has (``cfg.stop_epsilon``, the bank
    rule): every group has banked a particle and the particles still running carry less than
    ``stop_epsilon`` of the probability mass (the mean of the groups' running masses, the
    groups counting equally). Their descendants could take at most that mass, so drawing the
    output from the bank now moves its distribution by at most ``stop_epsilon`` in total
    variation (``docs/smc-sd.md``, "Stopping when the running mass is small"). The running
    particles are then marked ended and left out of the output."""
    cfg = job.config
    if cfg.stop_epsilon <= 0 or not cfg.banks_finished or not ps.bank.entries:
        return False
    if len({g for _, m, g in ps.bank.entries if m > -math.inf}) < cfg.groups:
        return False
    if float(ps.bank.log_running.exp().mean()) >= cfg.stop_epsilon:
        return False
    ps.finished[:] = True
    ps.tally.stopped_early = True
    return True


def _bank_group(job: Job, ps: Particles, g: int, ended: torch.Tensor) -> torch.Tensor | None:
    """Bank the particles of group ``g`` that ended this round (``ended``: bool ``[N]``) and
    return the group's new ancestors (int64 ``[N/G]``, indices within the group), drawn from
    its running particles; None when none of them runs on with any weight (the group ends).

    Each ended particle is set aside with probability mass ``running mass x its normalised
    weight`` (:func:`~smcspec.sampling.smc_weights.finished_shares`); the running mass shrinks
    to its own share; the running particles are resampled into all the group's slots (an
    unbiased resampling among them, so the SMC estimate stays consistent) and restart at
    equal weights. The output is later drawn from the banked particles in proportion to their
    mass (:func:`~smcspec.decoding.smc.answer.final_output`)."""
    cfg = job.config
    sl = cfg.group(g)
    log_shares, log_run = finished_shares(ps.logw[sl], ended[sl])
    for i in ended[sl].nonzero()[:, 0].tolist():  # zero-weight ones too (mass -inf): listed
        j = sl.start + i
        seq = ps.tokens[j, : int(ps.lengths[j])].tolist()
        ps.bank.entries.append((seq, float(ps.bank.log_running[g]) + float(log_shares[i]), g))
        if ps.logprobs is not None:
            ps.logprobs.bank(j, seq)
    ps.bank.log_running[g] += log_run
    running = ~ps.finished[sl]
    if not math.isfinite(log_run) or not bool(running.any()):
        ps.finished[sl] = True  # nothing left to run in this group
        return None
    logw = torch.where(running, ps.logw[sl], torch.full_like(ps.logw[sl], -math.inf))
    return RESAMPLERS[cfg.resampler](logw, job.generator)


def host_ended(ps: Particles, tcache: KVCache, dcache: KVCache) -> None:
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


def _resample_group(job: Job, ps: Particles, g: int, ess: float) -> torch.Tensor | None:
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
    ps: Particles,
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
    ps.tally.equal_start = all_reset
    ps.tally.resamples += 1
