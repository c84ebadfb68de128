"""What a round's new tokens do to the particles, written once for both kinds of round: a
block round (:mod:`smcspec.decoding.smc.block`: K drafted tokens and the bonus) and a round cut
where the ESS falls (:mod:`smcspec.decoding.smc.cut`: the first ``j*`` drafted tokens, then the
bonus drawn after resampling). Steps of ``docs/smc-sd.md`` and ``docs/constraints.md``:

* :func:`draw_bonus`, step 3d: the bonus token from ``∝ p~^alpha`` (``∝ p~^alpha m`` under a
  potential), its log-weight ``log sum_v p~(v)^alpha (m(v))``, the rows at a dead end (no
  allowed token of target mass) and those whose matcher refused the token drawn;
* :func:`extend`, steps 3c and 4: how many of the new tokens each particle keeps (up to its
  first stop token and the budget), written after its tokens; the particles they end;
* :func:`settle`, step 3e: dead ends (weight zero, ended), the twist ``phi(new) / phi(old)``,
  and the error when every particle is dead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import smcspec.decoding.potential_hooks as potential_hooks
from smcspec.decoding.job import Job
from smcspec.decoding.smc.particle_logprobs import Values, position_values
from smcspec.decoding.smc.particles import Particles, kill
from smcspec.potentials import DeadEndError
from smcspec.sampling.distributions import sample_categorical
from smcspec.sampling.smc_weights import power_target_probs


@dataclass
class Bonus:
    """One bonus token per particle and what it brings (:func:`draw_bonus`)."""

    token: torch.Tensor  # int64 [N]
    # float64 [N]: its log-weight, 0 at a dead end; None: 0 everywhere (alpha 1, no mask)
    norm: torch.Tensor | None
    # bool [N]: rows at a dead end, no allowed token of target mass or the token refused by
    # the row's matcher (None: drawn without a mask)
    dead: torch.Tensor | None
    values: Values | None  # its log-probability values ([N, 1] positions; cfg.logprobs)


def draw_bonus(
    job: Job,
    ps: Particles,
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    masked: bool,
    host: torch.Tensor | None = None,
) -> Bonus:
    """Step 3d: draw each particle's bonus token from the target's row ``logits`` (float32
    ``[N, V]``): from ``∝ p~^alpha`` (:func:`~smcspec.sampling.smc_weights.power_target_probs`),
    or with ``masked`` from ``∝ p~^alpha m`` under the constraint's masks of ``rows`` (bool
    ``[N]``: the rows still consuming tokens; all True without a constraint) with the bonus
    log-weight ``log sum_v p~(v)^alpha m(v)``
    (:func:`~smcspec.decoding.potential_hooks.masked_power_target`). A row of ``rows`` whose
    mask allows nothing of target mass is at a dead end: its log-weight is 0 (the caller gives
    the particle weight zero if it keeps the token) and its draw is uniform junk. ``host``
    (int64 ``[N]``, the keep rule's hosts): each row takes its host's token, after the draw.
    Under a constraint the matchers of ``rows`` not at a dead end consume the token unless it
    is a stop token; the rows they refuse are at a dead end too (``Bonus.dead``). Source:
    ``docs/constraints.md``, "Hard constraints"; ``docs/smc-sd.md``, step 3d."""
    cfg = job.config
    dead = mask = None
    if masked:
        mask = potential_hooks.masks(job.constraint, ps.states, rows, job.vocab, job.device)
        probs, norm = potential_hooks.masked_power_target(
            logits, cfg.temperature, cfg.alpha, cfg.truncation, mask
        )
        empty = ~mask.any(-1) | ~torch.isfinite(norm)
        dead = empty & rows
        norm = torch.where(empty, torch.zeros_like(norm), norm)
    else:
        probs, norm = power_target_probs(logits, cfg.temperature, cfg.alpha, cfg.truncation)
    token = sample_categorical(probs, job.generator)
    if host is not None:
        token = token[host]
    values = None
    if job.wants_logprobs:
        masks = mask[:, None] if mask is not None and job.constraint is not None else None
        values = position_values(cfg, logits[:, None], token[:, None], masks)
    if job.constraint is not None:
        consuming = rows & ~dead & ~torch.isin(token, job.stop_tensor)
        refused = potential_hooks.consume(ps.states, consuming, token)
        if refused:
            dead = dead.clone()
            dead[refused] = True
    return Bonus(token, norm, dead, values)


def extend(job: Job, ps: Particles, tokens: torch.Tensor, values: Values | None) -> torch.Tensor:
    """Steps 3c and 4: every running particle keeps ``tokens`` (int64 ``[N, M]``) up to and
    including its first stop token and within ``max_new_tokens``; they are written after its
    tokens (with their log-probability ``values``, ``[N, M]`` positions, where the request
    asks), its length grows by them, and the particles they end (a stop token kept, the
    budget reached) are marked finished. Finished particles keep nothing. Returns int64
    ``[N]``: how many tokens each kept."""
    cfg = job.config
    m = tokens.shape[1]
    pos = torch.arange(1, m + 1, device=job.device)
    first_stop = torch.where(torch.isin(tokens, job.stop_tensor), pos, m + 1).min(1).values
    kept = torch.minimum(first_stop.clamp(max=m), cfg.max_new_tokens - ps.lengths)
    kept = torch.where(ps.finished, torch.zeros_like(kept), kept)
    start = ps.width  # every unfinished particle has this length
    window = ps.tokens[:, start : start + m]
    ps.tokens[:, start : start + m] = torch.where(ps.finished[:, None], window, tokens)
    if ps.logprobs is not None:
        ps.logprobs.write(start, ps.finished, values)
    ps.width += m
    ps.lengths = ps.lengths + kept
    ps.finished = ps.finished | (first_stop <= kept) | (ps.lengths >= cfg.max_new_tokens)
    return kept


def settle(job: Job, ps: Particles, killed: torch.Tensor, grew: torch.Tensor) -> None:
    """Step 3e under a potential, after :func:`extend`: the particles ``killed`` (bool ``[N]``)
    die (:func:`~smcspec.decoding.smc.particles.kill`); under a twist each particle of
    ``grew`` (bool ``[N]``: those whose prefix grew, the killed ones aside) has its weight
    times ``phi(new prefix) / phi(old prefix)`` (``docs/constraints.md``, "Rewards and
    twists").

    Raises:
        DeadEndError: every particle's weight is zero.
    """
    cfg = job.config
    kill(ps, killed)
    if cfg.twisted:
        phi = potential_hooks.log_twist(
            cfg.reward, ps.tokens, ps.lengths, ps.finished, job.device, grew
        )
        ps.logw = torch.where(grew, ps.logw + phi - ps.phi, ps.logw)
        ps.phi = torch.where(grew, phi, ps.phi)
    if not bool(torch.isfinite(ps.logw).any()):
        raise DeadEndError(
            "every particle reached a dead end of the constraint (no allowed continuation "
            "has target probability)"
        )
