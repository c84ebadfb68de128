"""Autoregressive sampling from the target: the baseline."""

from __future__ import annotations

from typing import Any

import torch

from smcspec.backends.base import DecoderModel, KVCache
from smcspec.backends.pool import CacheNeed
from smcspec.config import GenerationConfig
from smcspec.decoding.ar.fused import HostCopy, ar_round
from smcspec.decoding.ar.stats import ArStats
from smcspec.decoding.caches import run_on_caches
from smcspec.decoding.fused import check_ok, fused_rounds, is_static, plain
from smcspec.decoding.job import Job, job_for
from smcspec.decoding.logprobs import TokenLogprobs, token_logprobs
from smcspec.decoding.output import DecodeOutput
from smcspec.decoding.program import Forward, Program, run_program, target_prefill
from smcspec.errors import ContextLengthError
from smcspec.potentials import ConstraintState, DeadEndError, timed_start
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


def ar_program(job: Job) -> Program:
    """Sample up to ``cfg.max_new_tokens`` tokens from ``softmax(logits / T_t)``, one per forward.

    ``cfg.temperature == 0`` decodes greedily: each token is the target's most likely one
    (after truncation and the constraint's mask; the first on ties).

    With ``cfg.top_k`` / ``top_p`` / ``min_p`` set, each token is drawn from the truncated,
    renormalised distribution ``p~`` (:func:`~smcspec.sampling.truncation.truncate_log_probs`).

    With ``cfg.constraint`` each token is drawn from the locally-masked ``norm(p~ * m_t)``
    (``m_t`` the constraint's mask after the tokens so far; what structured-output engines
    do, which is not the conditional ``p(x | x in A)``: Park et al. 2024).

    ``job``: the request (:class:`~smcspec.decoding.job.Job`; its cache opens on
    ``job.reservation``, or reserves its own, given back when the program ends or is closed).
    Yields :class:`Prefill`/:class:`Forward` requests (see :mod:`smcspec.decoding.program`),
    or one :class:`~smcspec.decoding.program.Round` a token where the target runs rounds
    fused.

    Raises:
        DeadEndError: with a constraint, no allowed token has positive probability.
    Returns:
        :class:`DecodeOutput` with :class:`~smcspec.decoding.ar.stats.ArStats`.
    """
    fused = fused_rounds(job.target) and plain(job.config)
    return (yield from run_on_caches(job, ar_caches(job.config, len(job.ids)), _ar_steps, fused))


def _ar_steps(job: Job, cache: KVCache) -> Program:
    cfg, target, vocab = job.config, job.target, job.vocab
    state, clock = timed_start(job.constraint) if job.constraint is not None else (None, None)
    logits, prompt_lps = yield from target_prefill(job, cache)
    logits = logits[:vocab]
    tok, lps = _next_token(job, logits, state)
    if state is None and is_static(cache):  # each forward and draw as one round on the device
        out = yield from _pipelined_rounds(job, cache, tok)
        return DecodeOutput(tokens=out, stats=ArStats(len(out), None))
    out: list[int] = []
    record = TokenLogprobs() if job.wants_logprobs else None
    while True:
        out.append(tok)
        if record is not None and lps is not None:
            record.extend(lps)
        job.emit([tok], lps)
        if tok in job.stop_ids or len(out) >= cfg.max_new_tokens:
            break
        if state is not None:
            state.consume([tok])
        step = torch.tensor([[tok]], device=target.device)
        logits = (yield Forward(target, step, cache, last_only=True))[0, -1, :vocab]
        tok, lps = _next_token(job, logits, state)
    stats = ArStats(len(out), clock.seconds if clock is not None else None)
    return DecodeOutput(out, stats, logprobs=record, prompt_logprobs=prompt_lps)


def _pipelined_rounds(job: Job, cache: KVCache, first: int) -> Program:
    """The tokens of fused ``ar`` rounds (:func:`~smcspec.decoding.ar.fused.ar_round`) after
    ``first``, pipelined: round t+1 is launched, fed round t's token on the device, before
    round t's token is read on the host (:class:`~smcspec.decoding.ar.fused.HostCopy`), so that
    the host's work (the read, streaming, the stop test, the next inputs) overlaps the
    device's forward. Where round t's token ends the answer, round t+1 was launched for
    nothing: one forward more than the answer needs, the price of never waiting for the
    device. The uniforms are drawn in the step path's order, so the tokens are its tokens
    for a seed. A full cache raises ContextLengthError only when the round it refused is
    needed."""
    cfg, out = job.config, []

    def take(tok: int) -> bool:  # True: the answer ends here
        out.append(tok)
        job.emit([tok])
        return tok in job.stop_ids or len(out) >= cfg.max_new_tokens

    if take(first):
        return out
    nxt = torch.full((1, 1), first, dtype=torch.long, device=job.device)
    inflight: HostCopy | None = None
    while True:
        launched, refused = None, None
        if len(out) + (inflight is not None) < cfg.max_new_tokens:
            try:
                res = yield from ar_round(job, cache, nxt)
                launched, nxt = HostCopy(res), res["token"].view(1, 1)
            except ContextLengthError as exc:
                refused = exc
        if inflight is not None:
            done = inflight.get()
            check_ok(done)
            if take(int(done["token"])):
                return out
        if launched is None:  # needed (the answer goes on) but refused
            raise refused or AssertionError("a needed round was not launched")
        inflight = launched


def _next_token(
    job: Job, logits: torch.Tensor, state: ConstraintState | None
) -> tuple[int, TokenLogprobs | None]:
    """The next token from the target's ``logits`` ``[V]``: tempered, truncated, masked by the
    constraint ``state``, a point mass when greedy; and, where the request asks for them, its
    log-probabilities under that distribution (before the point mass when greedy)."""
    cfg = job.config
    lp = step_log_probs(logits, cfg.temperature)
    lp = truncate_log_probs(lp, cfg.top_k, cfg.top_p, cfg.min_p)
    if state is not None:
        lp = _masked(lp, state.allowed()[: job.vocab].to(lp.device))
    draw = point_mass_log_probs(lp) if cfg.greedy else lp
    tok = int(sample_categorical(draw.exp(), job.generator))
    if not job.wants_logprobs:
        return tok, None
    return tok, token_logprobs(lp[None], logits[None], [tok], cfg.logprobs, cfg.logprobs_mode)


def _masked(lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log norm(p~ * m)`` (float32 ``[V]``); raises :class:`DeadEndError` when no allowed
    token has positive probability."""
    if not bool((mask & (lp > -torch.inf)).any()):
        raise DeadEndError("no token allowed by the constraint can be sampled (dead end)")
    return mask_log_probs(lp, mask)


def decode_ar(target: DecoderModel, *args: Any, **kwargs: Any) -> DecodeOutput:
    """Run :func:`ar_program` to completion on its own, without an engine; arguments
    ``(target, prompt, cfg, stop_ids, vocab, generator, on_tokens=None)`` (no draft model)."""
    return run_program(ar_program(job_for(target, None, *args, **kwargs)))
