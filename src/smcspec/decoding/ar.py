"""Autoregressive sampling from the target: the baseline."""

from __future__ import annotations

import torch

from smcspec.backends.base import DecoderModel, KVCache
from smcspec.backends.pool import CacheNeed, Reservation
from smcspec.config import GenerationConfig
from smcspec.decoding.common import (
    DecodeOutput,
    TokenCallback,
    as_prompt_tensor,
    with_caches,
)
from smcspec.decoding.fused import ar_step, fused_rounds, graph_safe, is_static, static_needs
from smcspec.decoding.program import Forward, Prefill, Program, run_program
from smcspec.potentials import ConstraintState, DeadEndError, compiled_constraint, timed_start
from smcspec.sampling.distributions import (
    point_mass_log_probs,
    sample_categorical,
    step_log_probs,
)
from smcspec.sampling.masking import mask_log_probs
from smcspec.sampling.truncation import truncate_log_probs


def ar_caches(cfg: GenerationConfig, prompt_len: int) -> list[CacheNeed]:
    """The KV cache :func:`ar_program` opens: one target row (the last token's KV is never
    needed, but the budget's last forward writes one more position)."""
    return [CacheNeed("target", 1, cfg.max_new_tokens + 1, prompt_len)]


def ar_program(
    target: DecoderModel,
    prompt: list[int],
    cfg: GenerationConfig,
    stop_ids: frozenset[int],
    vocab: int,
    generator: torch.Generator,
    on_tokens: TokenCallback | None = None,
    reservation: Reservation | None = None,
) -> Program:
    """Sample up to ``cfg.max_new_tokens`` tokens from ``softmax(logits / T_t)``, one per forward.

    ``cfg.temperature == 0`` decodes greedily: each token is the target's most likely one
    (after truncation and the constraint's mask; the first on ties).

    With ``cfg.top_k`` / ``top_p`` / ``min_p`` set, each token is drawn from the truncated,
    renormalised distribution ``p~`` (:func:`~smcspec.sampling.truncation.truncate_log_probs`).

    With ``cfg.constraint`` each token is drawn from the locally-masked ``norm(p~ * m_t)``
    (``m_t`` the constraint's mask after the tokens so far; what structured-output engines
    do, which is not the conditional ``p(x | x in A)``: Park et al. 2024).

    Args:
        prompt: token ids. ``vocab``: number of token ids that may be sampled.
    Raises:
        DeadEndError: with a constraint, no allowed token has positive probability.
    Yields :class:`Prefill`/:class:`Forward` requests (see :mod:`smcspec.decoding.program`).

    Returns:
        :class:`DecodeOutput` with stats ``{"forwards": ...}`` and, with a constraint,
        ``constraint_seconds`` (wall seconds spent computing masks and advancing matchers).

    ``reservation``: the request's leases (the KV cache is opened on them); without one the
    cache reserves its own, given back when the program ends or is closed.
    """

    def steps(cache: KVCache) -> Program:
        return _ar_steps(target, cache, prompt, cfg, stop_ids, vocab, generator, on_tokens)

    needs = ar_caches(cfg, len(prompt))
    if fused_rounds(target) and graph_safe(cfg, "ar"):
        needs = static_needs(needs)  # steps captured as CUDA graphs (decoding/fused.py)
    return (yield from with_caches(needs, {"target": target}, reservation, steps))


def _ar_steps(
    target: DecoderModel,
    cache: KVCache,
    prompt: list[int],
    cfg: GenerationConfig,
    stop_ids: frozenset[int],
    vocab: int,
    generator: torch.Generator,
    on_tokens: TokenCallback | None,
) -> Program:
    constraint = compiled_constraint(cfg.constraint)
    state, clock = timed_start(constraint) if constraint is not None else (None, None)
    logits = (yield Prefill(target, as_prompt_tensor(prompt, target.device), cache))[:vocab]
    fused = state is None and is_static(cache)
    tok = _next_token(logits, cfg, state, vocab, generator)
    out: list[int] = []
    while True:
        out.append(tok)
        if on_tokens:
            on_tokens([tok])
        if tok in stop_ids or len(out) >= cfg.max_new_tokens:
            break
        if state is not None:
            state.consume([tok])
        if fused:  # the forward and the next draw as one round on the device
            tok = yield from ar_step(target, cache, tok, cfg, vocab, generator)
            continue
        step = torch.tensor([[tok]], device=target.device)
        logits = (yield Forward(target, step, cache, last_only=True))[0, -1, :vocab]
        tok = _next_token(logits, cfg, state, vocab, generator)
    stats: dict[str, float | int] = {"forwards": len(out)}
    if clock is not None:
        stats["constraint_seconds"] = clock.seconds
    return DecodeOutput(tokens=out, stats=stats)


def _next_token(
    logits: torch.Tensor,
    cfg: GenerationConfig,
    state: ConstraintState | None,
    vocab: int,
    generator: torch.Generator,
) -> int:
    """The next token from the target's ``logits`` ``[V]``: tempered, truncated, masked by the
    constraint ``state``, a point mass when greedy."""
    lp = step_log_probs(logits, cfg.temperature)
    lp = truncate_log_probs(lp, cfg.top_k, cfg.top_p, cfg.min_p)
    if state is not None:
        lp = _masked(lp, state.allowed()[:vocab].to(lp.device))
    if cfg.greedy:
        lp = point_mass_log_probs(lp)
    return int(sample_categorical(lp.exp(), generator))


def _masked(lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log norm(p~ * m)`` (float32 ``[V]``); raises :class:`DeadEndError` when no allowed
    token has positive probability."""
    if not bool((mask & (lp > -torch.inf)).any()):
        raise DeadEndError("no token allowed by the constraint can be sampled (dead end)")
    return mask_log_probs(lp, mask)


def decode_ar(*args, **kwargs) -> DecodeOutput:
    """Run :func:`ar_program` to completion on its own (same arguments)."""
    return run_program(ar_program(*args, **kwargs))
