"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Each round the draft proposes up to K tokens autoregressively, the target scores them in one
forward, :func:`~smcspec.sampling.speculative.speculative_verify` accepts a prefix and draws
the next token; rejected tokens are rolled back from both KV caches. The output is
distributed exactly as the target at temperature ``T_t``.

With top-k / top-p / min-p set, the target's and the draft's distributions are each
truncated and renormalised (``p~`` and ``q~``, with the same parameters, as vLLM does)
before the rule is applied: accept with ``min(1, p~(d)/q~(d))``, residual
``norm(max(p~ - q~, 0))``, first and bonus tokens from ``p~``. The output is then
distributed exactly as ``p~`` step by step (``docs/sampling.md``).

With a constraint (``cfg.constraint``) the draft and the target are both masked,
``q' = norm(q~ * m)`` and ``p' = norm(p~ * m)`` with the mask ``m`` of the same prefix, and the
same rule applies: the output is exactly the locally-masked ``prod_t norm(p~ * m_t)`` (what
masked autoregressive sampling gives, not the conditional ``p(x | x in A)``; see
``docs/constraints.md``). The matcher consumes the drafted tokens to give the next masks and
rolls back the rejected ones; a drafted stop token or a dead end ends the block early.

The draft's KV is kept one step behind (deferred feeding): the tokens it has not yet seen
(the last accepted draft token and the target's token) go into the next round's first draft
forward, so a round costs K draft forwards.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch

from smcspec.backends.base import KVCache
from smcspec.backends.pool import CacheNeed
from smcspec.config import GenerationConfig
from smcspec.decoding.caches import cache_capacity, run_on_caches
from smcspec.decoding.fused import fused_rounds, is_static, plain
from smcspec.decoding.job import Job, job_for
from smcspec.decoding.logprobs import TokenLogprobs, token_logprobs
from smcspec.decoding.output import DecodeOutput, as_prompt_tensor, cut_at_stop
from smcspec.decoding.program import (
    Forward,
    Prefill,
    Program,
    Step,
    run_program,
    target_prefill,
)
from smcspec.decoding.sd.fused import sd_round
from smcspec.decoding.sd.stats import SdStats
from smcspec.potentials import ConstraintClock, ConstraintState, DeadEndError, timed_start
from smcspec.sampling.distributions import (
    point_mass_log_probs,
    sample_categorical,
    step_log_probs,
)
from smcspec.sampling.masking import mask_log_probs
from smcspec.sampling.speculative import speculative_verify
from smcspec.sampling.truncation import truncate_log_probs


def sd_caches(cfg: GenerationConfig, prompt_len: int) -> list[CacheNeed]:
    """The KV caches :func:`sd_program` opens: one row on the target and one on the draft."""
    cap = cache_capacity(cfg.max_new_tokens, cfg.draft_tokens)
    return [CacheNeed("target", 1, cap, prompt_len), CacheNeed("draft", 1, cap, prompt_len)]


def sd_program(job: Job) -> Program:
    """Speculative sampling with ``cfg.draft_tokens`` draft tokens per round.

    ``cfg.temperature == 0`` is greedy speculative decoding: the target and the draft are
    point masses at their most likely tokens (after truncation and masks), so a drafted
    token is accepted iff it is the target's most likely token, the token after the block
    is the target's most likely one, and the output equals greedy ``ar``'s.
    ``job``: the request (:class:`~smcspec.decoding.job.Job`).

    Yields :class:`Prefill`/:class:`Forward` requests (see :mod:`smcspec.decoding.program`),
    or one :class:`~smcspec.decoding.program.Round` per full round where the models run
    rounds fused.

    Returns:
        :class:`DecodeOutput` with :class:`~smcspec.decoding.sd.stats.SdStats` (rounds, tokens
        drafted and accepted, the acceptance rate, the mean accepted length as vLLM defines
        it; with a constraint the seconds in masks and matchers).
    """
    cfg = job.config
    fused = fused_rounds(job.target, job.draft) and plain(cfg) and cfg.p_min <= 0
    return (yield from run_on_caches(job, sd_caches(cfg, len(job.ids)), _sd_rounds, fused))


def first_token(
    job: Job, logits: torch.Tensor, state: ConstraintState | None
) -> tuple[int, TokenLogprobs | None]:
    """The first generated token, from the target's ``logits`` (``[V]``) after the prompt:
    truncated, masked by the constraint ``state``, a point mass when greedy; and its
    log-probabilities where the request asks for them (:mod:`smcspec.decoding.logprobs`)."""
    cfg = job.config
    first = truncate_log_probs(step_log_probs(logits, cfg.temperature), *cfg.truncation)
    if state is not None:
        first = _masked_target(first, _allowed(state, job.vocab, logits.device))
    draw = point_mass_log_probs(first) if cfg.greedy else first
    tok = int(sample_categorical(draw.exp(), job.generator))
    if not job.wants_logprobs:
        return tok, None
    lps = token_logprobs(first[None], logits[None], [tok], cfg.logprobs, cfg.logprobs_mode)
    return tok, lps


@dataclass
class SdStart:
    """Where both sd programs (chain and multi-draft) stand after the prompt
    (:func:`sd_start`): the constraint's matcher ``state`` and its ``clock`` (None without a
    constraint), the prompt's log-probabilities where asked, the output so far (``out``: the
    first token), its log-probabilities ``record`` (None unless asked; later rounds extend
    it), whether the answer already ended, and whether the rounds may run fused (static
    caches, no constraint)."""

    state: ConstraintState | None
    clock: ConstraintClock | None
    prompt_logprobs: TokenLogprobs | None
    out: list[int]
    record: TokenLogprobs | None
    finished: bool
    fused: bool

    def output(self, stats: SdStats) -> DecodeOutput:
        """The program's result: ``out`` with ``stats`` (the constraint's seconds added)."""
        if self.clock is not None:
            stats.constraint_seconds = self.clock.seconds
        return DecodeOutput(
            self.out, stats, logprobs=self.record, prompt_logprobs=self.prompt_logprobs
        )


def sd_start(job: Job, tcache: KVCache, dcache: KVCache) -> Generator[Step, torch.Tensor, SdStart]:
    """The opening both sd programs share: the constraint's matcher started (timed), the
    target's prefill into ``tcache`` and the draft's into ``dcache``, the first token drawn
    from the target (:func:`first_token`), emitted and, unless it ends the answer, consumed by
    the matcher."""
    state, clock = timed_start(job.constraint) if job.constraint is not None else (None, None)
    first_logits, prompt_lps = yield from target_prefill(job, tcache)
    yield Prefill(job.draft, as_prompt_tensor(job.ids, job.device), dcache)
    tok, record = first_token(job, first_logits[: job.vocab], state)
    job.emit([tok], record)
    finished = tok in job.stop_ids or job.config.max_new_tokens <= 1
    if state is not None and not finished:
        state.consume([tok])
    fused = state is None and is_static(tcache, dcache)
    return SdStart(state, clock, prompt_lps, [tok], record, finished, fused)


def _draft_pending(
    dcache: KVCache, d_len0: int, pending: list[int], drafted: list[int], n: int, nxt: int
) -> list[int]:
    """The tokens the draft has not seen after a round (deferred feeding), its KV rolled
    back to them: ``drafted`` (K tokens, ``n`` accepted) were fed after ``pending`` from
    length ``d_len0``, and ``nxt`` is the target's token. All accepted: the last drafted
    token (never fed) and ``nxt``; one rejected: ``nxt``; nothing drafted: ``pending`` and
    ``nxt``."""
    if not drafted:
        return [*pending, nxt]
    if n < len(drafted):
        dcache.truncate(d_len0 + len(pending) + n)
        return [nxt]
    return [drafted[-1], nxt]


def _sd_rounds(job: Job, tcache: KVCache, dcache: KVCache) -> Program:
    cfg = job.config
    start = yield from sd_start(job, tcache, dcache)
    state, out, record, finished = start.state, start.out, start.record, start.finished
    pending_t = out[0]  # fed to the target at the start of the next round
    pending_d = [out[0]]  # tokens the draft has not seen yet
    stats = SdStats(cfg.draft_tokens, rounds=0, drafted=0, accepted=0)
    while not finished:
        k = min(cfg.draft_tokens, cfg.max_new_tokens - len(out) - 1)
        d_len0, t_len0 = dcache.length, tcache.length
        lps = None
        if start.fused and k == cfg.draft_tokens:  # the whole round on the device
            d_tokens, n, nxt = yield from sd_round(job, tcache, dcache, pending_d, pending_t)
        else:
            d_tokens, n, nxt, lps = yield from _round_steps(
                job, tcache, dcache, pending_d, pending_t, k, state
            )
            k = len(d_tokens)
        stats.rounds += 1
        stats.drafted += k
        stats.accepted += n
        new, stopped = cut_at_stop([*d_tokens[:n], nxt], job.stop_ids)
        new = new[: cfg.max_new_tokens - len(out)]
        out.extend(new)
        lps = lps.slice(0, len(new)) if lps is not None else None
        if record is not None and lps is not None:
            record.extend(lps)
        job.emit(new, lps)
        finished = stopped or len(out) >= cfg.max_new_tokens
        if state is not None and not finished:  # no stop token was accepted
            consumed = k - (1 if d_tokens and d_tokens[-1] in job.stop_ids else 0)
            state.rollback(consumed - n)
            state.consume([nxt])
        tcache.truncate(t_len0 + 1 + n)  # roll back what was rejected
        pending_t = nxt
        pending_d = _draft_pending(dcache, d_len0, pending_d, d_tokens, n, nxt)
    return start.output(stats)


def _round_steps(
    job: Job,
    tcache: KVCache,
    dcache: KVCache,
    pending_d: list[int],
    pending_t: int,
    k: int,
    state: ConstraintState | None,
) -> Generator[Forward, torch.Tensor, tuple[list[int], int, int, TokenLogprobs | None]]:
    """One round step by step: up to ``k`` draft forwards (:func:`_draft_block`), the
    target's forward and the test (:func:`verify_block`). Returns ``(drafted, n, next,
    logprobs)``: the log-probabilities of the ``n + 1`` tokens where the request asks for
    them (None otherwise)."""
    d_tokens: list[int] = []
    d_probs: list[torch.Tensor] = []
    # constraint: masks[j] is the mask after d_1..d_j (draft step j+1 and target row j)
    masks = [_allowed(state, job.vocab, job.device)] if state is not None else []
    if state is not None and not bool(masks[0].any()):
        raise DeadEndError("no token allowed by the constraint can follow (dead end)")
    if k > 0:
        d_tokens, d_probs = yield from _draft_block(job, dcache, pending_d, k, state, masks)
    lps: list[TokenLogprobs] = []
    n, nxt = yield from verify_block(job, tcache, pending_t, d_tokens, d_probs, masks, None, lps)
    return d_tokens, n, nxt, (lps[0] if lps else None)


def verify_block(
    job: Job,
    tcache: KVCache,
    pending: int,
    d_tokens: list[int],
    d_probs: list[torch.Tensor],
    masks: list[torch.Tensor],
    probs_out: list[torch.Tensor] | None = None,
    logprobs_out: list[TokenLogprobs] | None = None,
) -> Generator[Forward, torch.Tensor, tuple[int, int]]:
    """Score ``[pending, *d_tokens]`` (1 + k rows) with the target in one forward and run
    the speculative-sampling test (Leviathan et al. 2023, Alg. 1) on the k drafted tokens
    with their draft distributions ``d_probs`` (k tensors of shape ``(vocab,)``).
    ``masks``: the constraint's mask at each row (empty without one). ``probs_out``, if
    given, receives the target's distributions at the 1 + k positions (float ``[1 + k,
    vocab]``, after temperature, truncation and masks). ``logprobs_out``, if given and the
    request asks for them, receives the :class:`~smcspec.decoding.logprobs.TokenLogprobs` of
    the accepted tokens and the next one, each at its row of the target (before the point
    mass when greedy).

    Returns:
        ``(n, nxt)``: how many drafted tokens were accepted and the target's token after
        them (the residual draw on a rejection, the bonus token when all were accepted; a
        plain target draw when nothing was drafted).

    Raises:
        DeadEndError: the constraint allows no token at the position ``nxt`` is drawn for.
    """
    dev = job.device
    block = torch.tensor([[pending, *d_tokens]], device=dev)
    t_logits = (yield Forward(job.target, block, tcache))[0, :, : job.vocab]
    t_probs, dead, t_lp = _target_probs(t_logits, job.config, masks)
    if probs_out is not None:
        probs_out.append(t_probs)
    k = len(d_tokens)
    if k > 0:
        n, nxt = speculative_verify(
            torch.tensor(d_tokens, device=dev), torch.stack(d_probs), t_probs, job.generator
        )
    else:
        n, nxt = 0, int(sample_categorical(t_probs[0], job.generator))
    if dead and n == k:
        raise DeadEndError("no token allowed by the constraint can follow (dead end)")
    if logprobs_out is not None and job.wants_logprobs:
        cfg, toks = job.config, [*d_tokens[:n], nxt]
        rows = slice(0, n + 1)
        logprobs_out.append(
            token_logprobs(t_lp[rows], t_logits[rows], toks, cfg.logprobs, cfg.logprobs_mode)
        )
    return n, nxt


def _draft_block(
    job: Job,
    dcache: KVCache,
    pending: list[int],
    k: int,
    state: ConstraintState | None,
    masks: list[torch.Tensor],
) -> Generator[Forward, torch.Tensor, tuple[list[int], list[torch.Tensor]]]:
    """Draft up to ``k`` tokens after feeding ``pending`` (tokens the draft has not seen):
    returns the tokens and their draft distributions (``[V]`` float probabilities each).
    With a constraint, ``state`` consumes each token and ``masks`` gains the mask after it;
    a stop token or a dead end ends the block early. With ``cfg.p_min`` > 0, a draft
    distribution whose most likely token has less than that probability ends it too, before
    that token is drawn (llama.cpp's ``--draft-p-min``): the forward that gave it is rolled
    back, so the draft stays one step behind. The rule stays exact: whether to draft on is
    decided from the draft's own distribution only."""
    cfg, dev, vocab = job.config, job.device, job.vocab
    greedy = cfg.greedy
    t_d = 0 if greedy else cfg.draft_temperature
    tokens: list[int] = []
    probs: list[torch.Tensor] = []
    x = torch.tensor([pending], device=dev)
    for _ in range(k):
        fed = dcache.length
        logits = (yield Forward(job.draft, x, dcache, last_only=True))[0, -1, :vocab]
        q = truncate_log_probs(step_log_probs(logits, t_d), *cfg.truncation)
        if state is not None:
            q = _masked_draft(q, masks[-1])
        q = (point_mass_log_probs(q) if greedy else q).exp()
        if cfg.p_min > 0 and float(q.max()) < cfg.p_min:
            dcache.truncate(fed)  # unsure: stop drafting, as if this forward never ran
            break
        d = int(sample_categorical(q, job.generator))
        tokens.append(d)
        probs.append(q)
        if state is not None:
            if d in job.stop_ids:
                masks.append(torch.ones(vocab, dtype=torch.bool, device=dev))
                break
            state.consume([d])
            masks.append(_allowed(state, vocab, dev))
            if not bool(masks[-1].any()):
                break
        x = torch.tensor([[d]], device=dev)
    return tokens, probs


def _target_probs(
    logits: torch.Tensor, cfg: GenerationConfig, masks: list[torch.Tensor]
) -> tuple[torch.Tensor, bool, torch.Tensor]:
    """The target's sampling distributions ``[k+1, V]`` for a scored block (``logits``
    ``[k+1, V]``), masked by ``masks[j]`` at row ``j`` when a constraint runs. Also returns
    whether the last mask allows nothing (a dead end: fatal only if every drafted token is
    accepted; that row is left unmasked meanwhile), and the log-probabilities before the
    greedy point mass (float32 ``[k+1, V]``; the same as the distributions' log otherwise)."""
    lp = truncate_log_probs(step_log_probs(logits, cfg.temperature), *cfg.truncation)
    dead = False
    if masks:
        dead = not bool(masks[-1].any())
        if dead:
            masks[-1] = torch.ones_like(masks[-1])
        lp = torch.stack([_masked_target(lp[j], masks[j]) for j in range(len(lp))])
    draw = point_mass_log_probs(lp) if cfg.greedy else lp
    return draw.exp(), dead, lp


def _allowed(state: ConstraintState, vocab: int, dev: torch.device) -> torch.Tensor:
    return state.allowed()[:vocab].to(dev)


def _masked_target(lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log norm(p~ * m)`` (float32 ``[V]``); :class:`DeadEndError` if nothing is left."""
    if not bool((mask & (lp > -torch.inf)).any()):
        raise DeadEndError("no token allowed by the constraint can be sampled (dead end)")
    return mask_log_probs(lp, mask)


def _masked_draft(lq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The draft's ``log norm(q~ * m)``; uniform over the mask when the draft's kept set
    misses it (any proposal keeps the rule exact; the mask itself is never empty here)."""
    if not bool((mask & (lq > -torch.inf)).any()):
        return mask_log_probs(torch.zeros_like(lq), mask)
    return mask_log_probs(lq, mask)


def decode_sd(*args: Any, **kwargs: Any) -> DecodeOutput:
    """Run :func:`sd_program` to completion on its own, without an engine; arguments
    :func:`~smcspec.decoding.job.job_for`'s (target, draft, prompt, cfg, stop ids, vocab,
    generator, on_tokens)."""
    return run_program(sd_program(job_for(*args, **kwargs)))
