"""SMC-SD's particles between rounds, one round's proposal, and steps 1-2 (x0 and uniform
log-weights) that start them (``docs/smc-sd.md``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

import smcspec.decoding.potential_hooks as potential_hooks
from smcspec.decoding.job import Job
from smcspec.decoding.smc.particle_logprobs import ParticleLogprobs, Values, position_values
from smcspec.potentials import ConstraintClock, ConstraintState, DeadEndError, timed_start
from smcspec.sampling.distributions import sample_categorical
from smcspec.sampling.smc_weights import power_target_probs


@dataclass
class Bank:
    """The bank rule's ledger (:func:`smcspec.decoding.smc.round_end.end_round`): the particles
    set aside as they ended, and each group's probability mass still running."""

    log_running: torch.Tensor  # float64 [G]: each group's running mass (log)
    entries: list[tuple[list[int], float, int]] = field(default_factory=list)
    """One per banked particle: its tokens, its log probability mass, its group."""


@dataclass
class Tally:
    """What a request's stats count over its rounds
    (:func:`smcspec.decoding.smc.answer.final_output`)."""

    rounds: int = 0
    cut_rounds: int = 0  # round_end "ess": rounds cut before their K-th drafted token
    resamples: int = 0
    dead: int = 0  # particles killed by dead ends
    stopped_early: bool = False  # stop_epsilon ended the request before every particle
    ess_trace: list[float] = field(default_factory=list)  # each round's ESS, summed over groups
    equal_start: bool = True  # the round being run began with equal weights
    fresh_ess: list[float] = field(default_factory=list)  # ESS of such rounds


@dataclass
class Particles:
    """The N particles of one request between rounds (tensors on the models' device): their
    tokens, weights and what each model has not been fed yet; the bank and the tally beside
    them."""

    tokens: torch.Tensor  # int64 [N, cap]: generated tokens, x0 in column 0
    lengths: torch.Tensor  # int64 [N]
    finished: torch.Tensor  # bool [N]
    logw: torch.Tensor  # float64 [N]: log-weights since the last resampling
    pending_t: torch.Tensor  # int64 [N, 1]: not yet fed to the target
    pending_d: torch.Tensor  # int64 [N, 1 or 2]: not yet fed to the draft
    phi: torch.Tensor  # float64 [N]: log twist of each prefix (0 without prefix_fn)
    log_z: torch.Tensor  # float64 [G]: each group's log-normaliser estimate so far
    bank: Bank  # banking: the ended particles set aside, each group's running mass
    tally: Tally = field(default_factory=Tally)
    states: list[ConstraintState] = field(default_factory=list)  # matchers (constraint)
    width: int = 1  # the common length of the running particles (tokens written)
    # keep rule: int64 [N], the running particle whose KV rows and tokens each row follows
    # (itself while running; see round_end.host_ended), or None before any particle ended
    host: torch.Tensor | None = None
    # requests that ask for logprobs: every particle's tokens' values (smc/particle_logprobs.py)
    logprobs: ParticleLogprobs | None = None


@dataclass
class Block:
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


def kill(ps: Particles, rows: torch.Tensor) -> None:
    """Particles ``rows`` (bool ``[N]``) reached a dead end: weight zero, ended, counted."""
    ps.logw = torch.where(rows, torch.full_like(ps.logw, -math.inf), ps.logw)
    ps.finished = ps.finished | rows
    ps.tally.dead += int(rows.sum())


def initial_particles(
    job: Job, first: torch.Tensor, cap: int
) -> tuple[Particles, ConstraintClock | None]:
    """Steps 1-2: x0 for every particle and uniform log-weights. Without potentials all
    particles share one x0 from ``∝ p~^alpha``; with them each particle draws its own from
    ``∝ p~^alpha m`` (a shared x0 would stay biased) and ``log_z`` starts at x0's masked
    mass. ``first``: float32 ``[V]`` logits after the prompt. Raises :class:`DeadEndError`."""
    cfg = job.config
    n, dev = cfg.particles, job.device
    tokens = torch.zeros(n, cap, dtype=torch.long, device=dev)
    ps = Particles(
        tokens=tokens,
        lengths=torch.ones(n, dtype=torch.long, device=dev),
        finished=torch.zeros(n, dtype=torch.bool, device=dev),
        logw=torch.zeros(n, dtype=torch.float64, device=dev),  # 2. uniform start
        pending_t=tokens[:, :1],
        pending_d=tokens[:, :1],
        phi=torch.zeros(n, dtype=torch.float64, device=dev),
        log_z=torch.zeros(cfg.groups, dtype=torch.float64),
        bank=Bank(log_running=torch.zeros(cfg.groups, dtype=torch.float64)),
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
        m0 = potential_hooks.masks(
            job.constraint, [root], torch.ones(1, dtype=torch.bool), job.vocab, dev
        )
        probs0, lz0 = potential_hooks.masked_power_target(
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
            bad = potential_hooks.consume(ps.states, ~ps.finished, x0s)
            if bad:  # the matcher refused a token its own mask allowed: a dead end
                refused = torch.zeros_like(ps.finished)
                refused[bad] = True
                kill(ps, refused)
        if cfg.twisted:
            ps.phi = potential_hooks.log_twist(cfg.reward, tokens, ps.lengths, ps.finished, dev)
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
