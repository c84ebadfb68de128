"""SMC speculative decoding (SMC-SD).

Emara et al. 2026, "Faster LLM Inference via Sequential Monte Carlo" (arXiv:2604.15672);
the steps below follow ``shared/docs/smc-sd.md`` (numbers refer to its sections).

N particles share the prompt's KV. Each round every particle drafts K tokens from the draft
(one batched forward per token), the target scores all N x (K+1) positions in one forward,
each particle gets the incremental log-weight ``sum_k alpha log p_T(d_k) - log q_T(d_k)``
and a bonus token from the target; nothing is rejected, so every particle advances K+1
tokens. When ``ESS < kappa * N`` the particles are resampled (tokens and both KV caches).
At the end one particle is drawn in proportion to its weight.

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

import torch

from smcspec.config import GenerationConfig
from smcspec.decoding.common import (
    DecodeOutput,
    ParticleOutput,
    TokenCallback,
    as_prompt_tensor,
    cache_capacity,
)
from smcspec.decoding.program import Forward, Prefill, Program, run_program
from smcspec.models.transformer import Transformer
from smcspec.potentials import (
    ConstraintState,
    DeadEndError,
    TokenConstraint,
    compiled_constraint,
    mask_log_probs,
    masked_power_log_probs,
    reorder,
    stack_masks,
    timed_start,
)
from smcspec.sampling.distributions import sample_categorical, tempered_log_probs
from smcspec.sampling.resampling import (
    RESAMPLERS,
    effective_sample_size,
    log_mean_weight,
    normalized_weights,
)
from smcspec.sampling.smc_weights import (
    bonus_log_normalizer,
    incremental_log_weights,
    power_log_probs,
)
from smcspec.sampling.truncation import truncate_log_probs, truncation_active


def _common_prefix_len(tokens: torch.Tensor, lengths: torch.Tensor) -> int:
    m = int(lengths.min())
    if m == 0:
        return 0
    agree = (tokens[:, :m] == tokens[:1, :m]).all(0)
    return m if bool(agree.all()) else int((~agree).nonzero()[0, 0])


def _power_target(
    logits: torch.Tensor,
    t_t: float,
    alpha: float,
    trunc: tuple[int, float, float],
    with_norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities ``∝ p~(v)^alpha`` (float32 ``[..., V]``) for x0 and the bonus token, and
    the bonus log-weight ``log sum_v p~(v)^alpha`` (float64 ``[...]``; None at alpha == 1,
    where it is 0, or without ``with_norm``). ``trunc``: ``(top_k, top_p, min_p)``. All
    filters off: ``softmax(alpha * l / T_t)`` and :func:`bonus_log_normalizer`, the code
    path used before truncation existed."""
    if not truncation_active(*trunc):
        probs = tempered_log_probs(alpha * logits, t_t).exp()
        use_norm = with_norm and alpha != 1.0
        return probs, bonus_log_normalizer(logits, t_t, alpha) if use_norm else None
    lp = truncate_log_probs(tempered_log_probs(logits, t_t), *trunc)
    if alpha == 1.0:
        return lp.exp(), None
    log_r, log_z = power_log_probs(lp, alpha)
    return log_r.exp(), log_z


def _masked_power_target(
    logits: torch.Tensor,
    t_t: float,
    alpha: float,
    trunc: tuple[int, float, float],
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities ``∝ p~(v)^alpha m(v)`` (float32 ``[R, V]``) and the bonus log-weight
    ``logsumexp_v(alpha*log p~(v) + log m(v))`` (float64 ``[R]``; ``-inf`` where nothing the
    mask allows has target mass: that row is uniform, for sampling only, and the particle
    must get weight zero if it keeps the token). Source: ``shared/docs/smc-sd.md``,
    "Potentials"."""
    lp = truncate_log_probs(tempered_log_probs(logits, t_t), *trunc)
    log_r, log_z = masked_power_log_probs(lp, alpha, mask)
    bad = ~torch.isfinite(log_z)
    probs = torch.where(bad[:, None], torch.ones_like(log_r), log_r.exp())
    return probs, log_z


def _masked_proposal(lq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The masked draft ``log q'(v) = log norm(q * m)`` (float32 ``[R, V]``); a row whose mask
    misses the draft's kept set (only with ``truncate_draft``) is uniform over the mask."""
    empty = ~(mask & (lq > -math.inf)).any(-1, keepdim=True)
    return mask_log_probs(torch.where(empty, torch.zeros_like(lq), lq), mask)


def _masks(
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


def smc_program(
    target: Transformer,
    draft: Transformer,
    prompt: list[int],
    cfg: GenerationConfig,
    stop_ids: frozenset[int],
    vocab: int,
    generator: torch.Generator,
    on_tokens: TokenCallback | None = None,
    truncate_draft: bool = False,
) -> Program:
    """Run SMC-SD for one request.

    Args:
        target, draft: models sharing a vocabulary; ``vocab`` ids may be sampled.
        prompt: token ids. ``cfg``: N, K, temperatures, alpha, kappa, resampler, budget,
            and top-k / top-p / min-p (applied to the target; see the module docstring).
        stop_ids: tokens that end a particle (EOS and stop tokens).
        truncate_draft: draft from the truncated ``q~`` (same filters as the target)
            instead of ``q_T``. Not consistent for ``p~`` when the draft's kept set misses
            tokens the target keeps; kept for comparison (``docs/sampling.md``).
    Yields :class:`Prefill`/:class:`Forward` requests (see :mod:`smcspec.decoding.program`).

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
        :class:`DecodeOutput` with the chosen particle's tokens; stats ``rounds``,
        ``resamples``, ``mean_ess``, ``min_ess`` (over rounds, before resampling),
        ``degenerate_weights`` (1 if every final weight was zero and the output particle
        was drawn uniformly; an all-zero weight vector has ESS = N, so it never triggers
        resampling);
        with ``cfg.return_particles`` also all particles, their normalised weights and the
        log-normaliser estimate (sum over resampling events of ``logsumexp(logw) - log N``,
        plus the same term for the final weights). With a constraint or reward the stats
        also hold ``log_normalizer`` (including x0's masked mass) and ``dead_particles``, and
        with a constraint ``constraint_seconds`` (wall seconds in masks, matchers and their
        copies on resampling).
    """
    dev = target.device
    n, k = cfg.particles, cfg.draft_tokens
    alpha, t_t, t_d = cfg.alpha, cfg.temperature, cfg.draft_temperature
    trunc = (cfg.top_k, cfg.top_p, cfg.min_p)  # all off: truncate_log_probs returns its input
    d_trunc = trunc if truncate_draft else (0, 1.0, 0.0)  # the proposal: q_T unless asked
    resample = RESAMPLERS[cfg.resampler]
    constraint = compiled_constraint(cfg.constraint)
    reward = cfg.reward
    potential = constraint is not None or reward is not None
    twisted = reward is not None and reward.prefix_fn is not None
    cap = cache_capacity(cfg.max_new_tokens, k)
    tcache, dcache = target.new_cache(n, cap), draft.new_cache(n, cap)

    # 1. prefill once per model (shared prefix KV); x0 from the target's power distribution
    p = as_prompt_tensor(prompt, dev)
    first = (yield Prefill(target, p, tcache))[:vocab]
    yield Prefill(draft, p, dcache)
    tokens = torch.zeros(n, cap, dtype=torch.long, device=dev)
    lengths = torch.ones(n, dtype=torch.long, device=dev)
    logw = torch.zeros(n, dtype=torch.float64, device=dev)  # 2. uniform start
    stop_t = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev)
    log_z = 0.0
    states: list[ConstraintState] = []
    phi = torch.zeros(n, dtype=torch.float64, device=dev)  # log twist of each prefix
    dead_count = 0
    clock = None
    if not potential:
        x0 = int(sample_categorical(_power_target(first, t_t, alpha, trunc, False)[0], generator))
        tokens[:, 0] = x0
        done = x0 in stop_ids or cfg.max_new_tokens == 1
        finished = torch.full((n,), done, dtype=torch.bool, device=dev)
    else:  # each particle draws its own x0 from ∝ p~^alpha m (a shared x0 would stay biased)
        root, clock = timed_start(constraint) if constraint is not None else (None, None)
        m0 = _masks(constraint, [root], torch.ones(1, dtype=torch.bool), vocab, dev)
        probs0, lz0 = _masked_power_target(first[None], t_t, alpha, trunc, m0)
        if not math.isfinite(float(lz0[0])):
            raise DeadEndError("no first token is allowed by the constraint (dead end)")
        log_z += float(lz0[0])  # x0's weight, the same for every particle
        x0s = sample_categorical(probs0.expand(n, -1), generator)
        tokens[:, 0] = x0s
        finished = torch.isin(x0s, stop_t) | (cfg.max_new_tokens == 1)
        if root is not None:
            states = [root.copy() for _ in range(n)]
            bad = _consume(states, ~finished, x0s)
            if bad:  # the matcher refused a token its own mask allowed: a dead end
                logw[bad] = -math.inf
                finished[bad] = True
                dead_count += len(bad)
        if twisted:
            phi = _log_twist(reward, tokens, lengths, finished, dev)
            logw = phi.clone()
    pending_t = tokens[:, :1].clone()  # [N, 1] not yet fed to the target
    pending_d = tokens[:, :1].clone()  # [N, 1 or 2] not yet fed to the draft
    emitted = 0
    rounds = resamples = degenerate = 0
    ess_trace: list[float] = []
    block_pos = torch.arange(1, k + 2, device=dev)

    def emit(upto: int, row: int = 0) -> None:
        nonlocal emitted
        if upto > emitted and on_tokens:
            on_tokens(tokens[row, emitted:upto].tolist())
        emitted = max(emitted, upto)

    emit(_common_prefix_len(tokens, lengths))
    while not bool(finished.all()):
        # 3a. draft K tokens per particle (deferred bonus: first forward feeds 1-2 tokens)
        drafted = torch.empty(n, k, dtype=torch.long, device=dev)
        draft_lp = torch.empty(n, k, dtype=torch.float32, device=dev)
        x = pending_d
        if potential:
            open_ = ~finished  # still consuming tokens this round
            dead_pos = torch.full((n,), k + 2, dtype=torch.long, device=dev)  # K+2: alive
        for j in range(k):
            d_logits = yield Forward(draft, x, dcache, last_only=True)
            lq = truncate_log_probs(tempered_log_probs(d_logits[:, -1, :vocab], t_d), *d_trunc)
            if constraint is not None:
                m = _masks(constraint, states, open_, vocab, dev)
                empty = ~m.any(-1)  # a dead end at block position j+1
                dead_pos = torch.where(empty & open_, j + 1, dead_pos)
                open_ = open_ & ~empty
                lq = _masked_proposal(lq, m | empty[:, None])  # q' (junk rows: dead)
            d = sample_categorical(lq.exp(), generator)
            drafted[:, j] = d
            draft_lp[:, j] = lq.gather(-1, d[:, None])[:, 0]
            if constraint is not None:
                open_ = open_ & ~torch.isin(d, stop_t)
                bad = _consume(states, open_, d)
                if bad:  # d_{j+1} itself was refused: dead at block position j+1
                    dead_pos[bad] = torch.clamp(dead_pos[bad], max=j + 1)
                    open_[bad] = False
            x = d[:, None]
        # 3b. one target forward over [v, d_1..d_K] for every particle
        t_block = torch.cat((pending_t, drafted), 1)
        t_logits = (yield Forward(target, t_block, tcache))[:, :, :vocab]
        lp = truncate_log_probs(tempered_log_probs(t_logits[:, :k], t_t), *trunc)
        target_lp = lp.gather(-1, drafted[:, :, None])[:, :, 0]
        # 3d. bonus token from softmax(alpha * l / T_t) (∝ p~^alpha) at position K+1
        if potential:  # after all K drafted tokens: bonus ∝ p~^alpha m, weight log sum
            m = _masks(constraint, states, open_, vocab, dev)
            bonus_probs, bonus_norm = _masked_power_target(t_logits[:, k], t_t, alpha, trunc, m)
            empty = ~m.any(-1) | ~torch.isfinite(bonus_norm)
            dead_pos = torch.where(empty & open_, k + 1, dead_pos)
            bonus_norm = torch.where(empty, torch.zeros_like(bonus_norm), bonus_norm)
        else:
            bonus_probs, bonus_norm = _power_target(t_logits[:, k], t_t, alpha, trunc)
        bonus = sample_categorical(bonus_probs, generator)
        if constraint is not None:
            bad = _consume(states, open_ & (dead_pos > k + 1) & ~torch.isin(bonus, stop_t), bonus)
            dead_pos[bad] = k + 1
        # 4. how much of the block each particle keeps (EOS / max_new_tokens cut it)
        block = torch.cat((drafted, bonus[:, None]), 1)  # [N, K+1]
        is_stop = torch.isin(block, stop_t)
        first_stop = torch.where(is_stop, block_pos, k + 2).min(1).values  # K+2: none
        kept = torch.minimum(first_stop.clamp(max=k + 1), cfg.max_new_tokens - lengths)
        kept = torch.where(finished, torch.zeros_like(kept), kept)
        # 3c + 3e. incremental log-weights
        logw = logw + incremental_log_weights(target_lp, draft_lp, alpha, bonus_norm, kept)
        if potential:  # a particle that reached a dead end inside what it keeps dies
            killed = ~finished & (dead_pos <= kept)
            logw = torch.where(killed, torch.full_like(logw, -math.inf), logw)
            dead_count += int(killed.sum())
        start = 1 + rounds * (k + 1)  # every unfinished particle has this length
        tokens[:, start : start + k + 1] = torch.where(
            finished[:, None], tokens[:, start : start + k + 1], block
        )
        lengths = lengths + kept
        was_finished = finished
        finished = finished | (first_stop <= kept) | (lengths >= cfg.max_new_tokens)
        if potential:
            finished = finished | killed
            if twisted:  # 3e'. twist: times phi(new prefix) / phi(old prefix)
                grew = ~was_finished & ~killed
                new_phi = _log_twist(reward, tokens, lengths, finished, dev, rows=grew)
                logw = torch.where(grew, logw + new_phi - phi, logw)
                phi = torch.where(grew, new_phi, phi)
            if not bool(torch.isfinite(logw).any()):
                raise DeadEndError(
                    "every particle reached a dead end of the constraint (no allowed "
                    "continuation has target probability)"
                )
        pending_t = bonus[:, None]
        pending_d = torch.stack((drafted[:, -1], bonus), 1)
        rounds += 1
        # 3f. ESS and resampling
        ess = effective_sample_size(logw)
        ess_trace.append(ess)
        if n >= 2 and ess < cfg.ess_threshold * n:
            log_z += log_mean_weight(logw)
            anc = resample(logw, generator)
            tokens, lengths, finished = tokens[anc], lengths[anc], finished[anc]
            pending_t, pending_d = pending_t[anc], pending_d[anc]
            tcache.reorder(anc)
            dcache.reorder(anc)
            if potential:
                phi = phi[anc]
                if constraint is not None:
                    states = reorder(states, anc)
            logw = torch.zeros_like(logw)
            resamples += 1
        emit(_common_prefix_len(tokens, lengths))

    if reward is not None and not twisted:  # the whole reward at the end
        alive = torch.isfinite(logw)
        final = reward.log_potential(
            [tokens[i, : int(lengths[i])].tolist() for i in range(n)], prefix=False
        ).to(dev)
        logw = torch.where(alive, logw + final, logw)
    # 5. output: one particle drawn in proportion to its final weight
    w, all_inf = normalized_weights(logw)
    degenerate += int(all_inf)
    if not all_inf:
        log_z += log_mean_weight(logw)
    choice = int(sample_categorical(w, generator)) if n > 1 else 0
    emit(int(lengths[choice]), row=choice)
    out = tokens[choice, : int(lengths[choice])].tolist()
    stats = {
        "rounds": rounds,
        "resamples": resamples,
        "mean_ess": sum(ess_trace) / len(ess_trace) if ess_trace else float(n),
        "min_ess": min(ess_trace) if ess_trace else float(n),
        "degenerate_weights": degenerate,
    }
    if potential:
        stats.update(log_normalizer=log_z, dead_particles=dead_count)
    if clock is not None:
        stats["constraint_seconds"] = clock.seconds
    particles = None
    if cfg.return_particles:
        particles = [
            ParticleOutput(tokens[i, : int(lengths[i])].tolist(), float(w[i])) for i in range(n)
        ]
    return DecodeOutput(
        tokens=out,
        stats=stats,
        particles=particles,
        log_normalizer=log_z if math.isfinite(log_z) else None,
    )


def _consume(states: list[ConstraintState], rows: torch.Tensor, toks: torch.Tensor) -> list[int]:
    """Advance ``states[i]`` by ``toks[i]`` for each row set in ``rows`` (bool ``[N]``);
    returns the rows whose matcher refused the token (:class:`DeadEndError`)."""
    bad = []
    for i in rows.nonzero()[:, 0].tolist():
        try:
            states[i].consume([int(toks[i])])
        except DeadEndError:
            bad.append(i)
    return bad


def _log_twist(
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
    for done in (True, False):
        idx = [i for i in sel if bool(finished[i]) == done]
        if idx:
            seqs = [tokens[i, : int(lengths[i])].tolist() for i in idx]
            out[idx] = reward.log_potential(seqs, prefix=not done)
    return out.to(dev)


def decode_smc(*args, **kwargs) -> DecodeOutput:
    """Run :func:`smc_program` to completion on its own (same arguments)."""
    return run_program(smc_program(*args, **kwargs))
