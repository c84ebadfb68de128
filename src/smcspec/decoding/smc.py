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

    Returns:
        :class:`DecodeOutput` with the chosen particle's tokens; stats ``rounds``,
        ``resamples``, ``mean_ess``, ``min_ess`` (over rounds, before resampling),
        ``degenerate_weights`` (1 if every final weight was zero and the output particle
        was drawn uniformly; an all-zero weight vector has ESS = N, so it never triggers
        resampling);
        with ``cfg.return_particles`` also all particles, their normalised weights and the
        log-normaliser estimate (sum over resampling events of ``logsumexp(logw) - log N``,
        plus the same term for the final weights).
    """
    dev = target.device
    n, k = cfg.particles, cfg.draft_tokens
    alpha, t_t, t_d = cfg.alpha, cfg.temperature, cfg.draft_temperature
    trunc = (cfg.top_k, cfg.top_p, cfg.min_p)  # all off: truncate_log_probs returns its input
    d_trunc = trunc if truncate_draft else (0, 1.0, 0.0)  # the proposal: q_T unless asked
    resample = RESAMPLERS[cfg.resampler]
    cap = cache_capacity(cfg.max_new_tokens, k)
    tcache, dcache = target.new_cache(n, cap), draft.new_cache(n, cap)

    # 1. prefill once per model (shared prefix KV); x0 from the target's power distribution
    p = as_prompt_tensor(prompt, dev)
    first = (yield Prefill(target, p, tcache))[:vocab]
    yield Prefill(draft, p, dcache)
    x0 = int(sample_categorical(_power_target(first, t_t, alpha, trunc, False)[0], generator))
    tokens = torch.zeros(n, cap, dtype=torch.long, device=dev)
    tokens[:, 0] = x0
    lengths = torch.ones(n, dtype=torch.long, device=dev)
    done = x0 in stop_ids or cfg.max_new_tokens == 1
    finished = torch.full((n,), done, dtype=torch.bool, device=dev)
    logw = torch.zeros(n, dtype=torch.float64, device=dev)  # 2. uniform start
    stop_t = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev)
    pending_t = tokens[:, :1].clone()  # [N, 1] not yet fed to the target
    pending_d = tokens[:, :1].clone()  # [N, 1 or 2] not yet fed to the draft
    emitted = 0
    rounds = resamples = degenerate = 0
    ess_trace: list[float] = []
    log_z = 0.0
    block_pos = torch.arange(1, k + 2, device=dev)

    def emit(upto: int, row: int = 0) -> None:
        nonlocal emitted
        if upto > emitted and on_tokens:
            on_tokens(tokens[row, emitted:upto].tolist())
        emitted = max(emitted, upto)

    emit(1)
    while not bool(finished.all()):
        # 3a. draft K tokens per particle (deferred bonus: first forward feeds 1-2 tokens)
        drafted = torch.empty(n, k, dtype=torch.long, device=dev)
        draft_lp = torch.empty(n, k, dtype=torch.float32, device=dev)
        x = pending_d
        for j in range(k):
            d_logits = yield Forward(draft, x, dcache, last_only=True)
            lq = truncate_log_probs(tempered_log_probs(d_logits[:, -1, :vocab], t_d), *d_trunc)
            d = sample_categorical(lq.exp(), generator)
            drafted[:, j] = d
            draft_lp[:, j] = lq.gather(-1, d[:, None])[:, 0]
            x = d[:, None]
        # 3b. one target forward over [v, d_1..d_K] for every particle
        t_block = torch.cat((pending_t, drafted), 1)
        t_logits = (yield Forward(target, t_block, tcache))[:, :, :vocab]
        lp = truncate_log_probs(tempered_log_probs(t_logits[:, :k], t_t), *trunc)
        target_lp = lp.gather(-1, drafted[:, :, None])[:, :, 0]
        # 3d. bonus token from softmax(alpha * l / T_t) (∝ p~^alpha) at position K+1
        bonus_probs, bonus_norm = _power_target(t_logits[:, k], t_t, alpha, trunc)
        bonus = sample_categorical(bonus_probs, generator)
        # 4. how much of the block each particle keeps (EOS / max_new_tokens cut it)
        block = torch.cat((drafted, bonus[:, None]), 1)  # [N, K+1]
        is_stop = torch.isin(block, stop_t)
        first_stop = torch.where(is_stop, block_pos, k + 2).min(1).values  # K+2: none
        kept = torch.minimum(first_stop.clamp(max=k + 1), cfg.max_new_tokens - lengths)
        kept = torch.where(finished, torch.zeros_like(kept), kept)
        # 3c + 3e. incremental log-weights
        logw = logw + incremental_log_weights(target_lp, draft_lp, alpha, bonus_norm, kept)
        start = 1 + rounds * (k + 1)  # every unfinished particle has this length
        tokens[:, start : start + k + 1] = torch.where(
            finished[:, None], tokens[:, start : start + k + 1], block
        )
        lengths = lengths + kept
        finished = finished | (first_stop <= kept) | (lengths >= cfg.max_new_tokens)
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
            logw = torch.zeros_like(logw)
            resamples += 1
        emit(_common_prefix_len(tokens, lengths))

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


def decode_smc(*args, **kwargs) -> DecodeOutput:
    """Run :func:`smc_program` to completion on its own (same arguments)."""
    return run_program(smc_program(*args, **kwargs))
