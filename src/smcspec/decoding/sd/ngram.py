"""Exact speculative decoding with n-gram drafts: no draft model (``sd`` with ``draft="ngram"``).

The proposal is prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; llama.cpp's
``ngram-simple`` and vLLM's ``ngram`` speculators): the longest n-gram (n from
``NGRAM_MAX`` down to 1) that ends the text so far (prompt and generated tokens) is looked up
at its most recent earlier occurrence, and the tokens that followed it there, at most K, are
drafted. Nothing is drafted when no n-gram recurs; the round is then a plain target step.

The draft distribution of each drafted token is a point mass, ``q(x) = 1``, so the exact
speculative rule (Leviathan et al. 2023, Alg. 1; :func:`~smcspec.sampling.speculative.
speculative_verify`) accepts a drafted token ``x`` with probability ``min(1, p(x) / 1) =
p(x)`` and, on a rejection, samples from the residual ``norm(max(p - q, 0))``, which is ``p``
with ``x`` removed. The output is therefore distributed exactly as the target's (truncated)
distribution, whatever is drafted; at temperature 0 a drafted token is accepted iff it is the
target's most likely one, so the output equals ``ar``'s. ``docs/ngram.md`` states the rule.

With ``cfg.p_min`` > 0 (by default :data:`~smcspec.config.NGRAM_DRAFT_P_MIN`;
``draft_p_min=0`` turns it off) the drafting is gated (:class:`NgramGate`): a round drafts
only while the target's probability of the n-gram's proposals, averaged over the last
``CONFIDENCE_STEPS`` rounds that had one, is at least ``p_min``. That probability is the
exact acceptance probability of a point-mass draft's first token, and it is read from the
target's distribution each round computes anyway, also in rounds that drafted nothing (the
proposal is then only compared, never verified), so a gated request goes back to drafting
when the text starts to copy again. With ``draft_schedule="confidence"`` the gate also sets
the round's length: the longest prefix of the proposal whose estimated acceptance, the product
of the recent per-position probabilities, is at least ``p_min`` (:meth:`NgramGate.length`).
Whether and how much to draft depends on past rounds only, so the output stays exact.

SMC-SD cannot use this proposal: its importance weights ``p / q`` need a proposal that gives
every token the target can produce positive probability, and a point mass does not
(:meth:`~smcspec.config.GenerationConfig.validate` refuses the combination).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch.nn.functional import one_hot

from smcspec.backends.base import DecoderModel, KVCache
from smcspec.backends.pool import CacheNeed
from smcspec.config import GenerationConfig
from smcspec.decoding.caches import cache_capacity, run_on_caches
from smcspec.decoding.job import Job, job_for
from smcspec.decoding.logprobs import TokenLogprobs
from smcspec.decoding.output import DecodeOutput, cut_at_stop
from smcspec.decoding.program import Program, run_program, target_prefill
from smcspec.decoding.sd.chain import first_token, verify_block
from smcspec.decoding.sd.stats import SdStats

NGRAM_MAX = 3  # the longest n-gram matched (llama.cpp's lookup decoding uses up to 4)
NGRAM_MIN = 1  # the shortest n-gram matched
CONFIDENCE_STEPS = 4  # the n-gram gate averages the target's probability of this many proposals


class NgramIndex:
    """The most recent continuation of every n-gram (n in 1..``n_max``) of a token history.

    ``extend`` appends tokens; ``propose(k)`` drafts up to ``k`` tokens: what followed the
    most recent earlier occurrence of the longest n-gram that ends the history. Each n-gram
    is registered when the token after it arrives, so the n-gram ending the history (whose
    continuation is unknown) never matches itself. O(n_max) dict operations per token.
    """

    def __init__(self, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_max, self.n_min = n_max, n_min
        self.tokens: list[int] = []
        self._next: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max + 1)]

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the history."""
        for t in tokens:
            j = len(self.tokens)  # the n-grams ending just before j continue at j
            for n in range(1, min(self.n_max, j) + 1):
                self._next[n][tuple(self.tokens[j - n : j])] = j
            self.tokens.append(int(t))

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` drafted tokens (``[]``: no n-gram that ends the history recurs)."""
        size = len(self.tokens)
        for n in range(min(self.n_max, size), self.n_min - 1, -1):
            j = self._next[n].get(tuple(self.tokens[size - n :]))
            if j is not None:
                return self.tokens[j : j + k]
        return []


class NgramGate:
    """Whether, and how much of its proposal, an n-gram round drafts (``cfg.p_min``; see the
    module notes).

    ``observe(probs)`` records the target's probability of the proposed tokens a round
    verified, position by position (only the first when nothing was drafted: the round's one
    row gives it). ``open`` is True until the first proposal is seen, then while the mean of
    the last ``steps`` probabilities observed at the first position is at least ``p_min``
    (always with ``p_min`` 0). ``length(k)`` (``draft_schedule="confidence"``) is the
    longest prefix of a ``k``-token proposal whose estimated acceptance probability, the
    product of the positions' recent means, is at least ``p_min``; a position not yet seen
    counts as 1, so it is drafted and measured. For a point-mass draft the target's
    probability of a drafted token is exactly its acceptance probability given the tokens
    before it (Leviathan et al. 2023, Alg. 1), so the product estimates the chance that the
    whole prefix is accepted.
    """

    def __init__(self, p_min: float, steps: int = CONFIDENCE_STEPS) -> None:
        self.p_min = p_min
        self.steps = steps
        self.positions: list[deque[float]] = []  # [i]: recent p of the (i+1)-th proposed token

    def observe(self, probs: float | list[float]) -> None:
        """Record the target's probability of the proposed tokens, first position first."""
        for i, p in enumerate([probs] if isinstance(probs, float | int) else probs):
            if i == len(self.positions):
                self.positions.append(deque(maxlen=self.steps))
            self.positions[i].append(float(p))

    def _mean(self, i: int) -> float:
        seen = self.positions[i] if i < len(self.positions) else ()
        return sum(seen) / len(seen) if seen else 1.0

    @property
    def open(self) -> bool:
        return self.p_min <= 0 or self._mean(0) >= self.p_min

    def length(self, k: int) -> int:
        """How many of a ``k``-token proposal to draft under ``"confidence"`` (0 to ``k``)."""
        if self.p_min <= 0:
            return k
        accept, n = 1.0, 0
        while n < k:
            accept *= self._mean(n)
            if accept < self.p_min:
                break
            n += 1
        return n


def next_draft_length(k: int, k_max: int, drafted: int, accepted: int) -> int:
    """The next round's draft length under ``draft_schedule="adaptive"``.

    Hugging Face's ``num_assistant_tokens_schedule="heuristic"`` rule, capped at ``k_max``
    (``cfg.draft_tokens``): 2 more after a round whose every drafted token was accepted, 1
    fewer (at least 1) after a round that rejected one; unchanged after a round that drafted
    nothing (no n-gram recurred). The length depends only on past rounds, so each round's
    verification stays exact.
    """
    if drafted == 0:
        return k
    if accepted == drafted:
        return min(k_max, k + 2)
    return max(1, k - 1)


def ngram_caches(cfg: GenerationConfig, prompt_len: int) -> list[CacheNeed]:
    """The KV cache :func:`ngram_sd_program` opens: one row on the target (no draft model)."""
    return [CacheNeed("target", 1, cache_capacity(cfg.max_new_tokens, cfg.draft_tokens),
                      prompt_len)]  # fmt: skip


def ngram_sd_program(job: Job) -> Program:
    """Exact speculative decoding with n-gram drafts of at most ``cfg.draft_tokens`` tokens.

    Yields :class:`Prefill`/:class:`Forward` requests on the target only. ``job``: the
    request (:class:`~smcspec.decoding.job.Job`; its draft model, if any, is not used).

    Returns:
        :class:`DecodeOutput` with :class:`~smcspec.decoding.sd.stats.SdStats` (``ngram``
        set), and with ``cfg.p_min`` > 0 ``gated_rounds``: rounds whose proposal the gate
        kept from drafting, or cut short (``draft_schedule="confidence"``).
    """
    return (yield from run_on_caches(job, ngram_caches(job.config, len(job.ids)), _ngram_rounds))


def _ngram_rounds(job: Job, tcache: KVCache) -> Program:
    cfg, target, vocab = job.config, job.target, job.vocab
    logits, prompt_lps = yield from target_prefill(job, tcache)
    logits = logits[:vocab]
    tok, record = first_token(job, logits, None)
    out = [tok]
    job.emit([tok], record)
    index = NgramIndex()
    index.extend([*job.ids, tok])
    gate = NgramGate(cfg.p_min)
    stats = SdStats(cfg.draft_tokens, rounds=0, drafted=0, accepted=0, ngram=True)
    gated = 0
    k_round = cfg.draft_tokens  # the round's draft length (adaptive: follows acceptance)
    finished = tok in job.stop_ids or len(out) >= cfg.max_new_tokens
    while not finished:
        k = min(k_round, cfg.max_new_tokens - len(out) - 1)
        proposal = index.propose(k) if k > 0 else []
        if cfg.draft_schedule == "confidence":
            d_tokens = proposal[: gate.length(len(proposal))]
        else:  # a closed gate: the proposal is only probed
            d_tokens = proposal if gate.open else []
        gated += len(proposal) > len(d_tokens)
        dev = target.device  # each drafted token's draft distribution: a point mass
        d_probs = [one_hot(torch.tensor(t, device=dev), vocab).float() for t in d_tokens]
        t_len0 = tcache.length
        t_probs: list[torch.Tensor] = []
        lps: list[TokenLogprobs] = []
        n, nxt = yield from verify_block(job, tcache, out[-1], d_tokens, d_probs, [], t_probs, lps)
        if proposal and gate.p_min > 0:  # p(proposed token): its acceptance probability
            seen = d_tokens or proposal[:1]  # a probed proposal: its first token's row only
            gate.observe([float(t_probs[0][i, t]) for i, t in enumerate(seen)])
        stats.rounds += 1
        stats.drafted += len(d_tokens)
        stats.accepted += n
        if cfg.draft_schedule == "adaptive":
            k_round = next_draft_length(k_round, cfg.draft_tokens, len(d_tokens), n)
        new, stopped = cut_at_stop([*d_tokens[:n], nxt], job.stop_ids)
        new = new[: cfg.max_new_tokens - len(out)]
        out.extend(new)
        index.extend(new)
        round_lps = lps[0].slice(0, len(new)) if lps else None
        if record is not None and round_lps is not None:
            record.extend(round_lps)
        job.emit(new, round_lps)
        finished = stopped or len(out) >= cfg.max_new_tokens
        tcache.truncate(t_len0 + 1 + n)  # roll back what was rejected
    if gate.p_min > 0:
        stats.gated_rounds = gated  # rounds whose proposal the gate cut or kept from drafting
    return DecodeOutput(out, stats, logprobs=record, prompt_logprobs=prompt_lps)


def decode_ngram_sd(target: DecoderModel, *args: Any, **kwargs: Any) -> DecodeOutput:
    """Run :func:`ngram_sd_program` to completion on its own, without an engine; arguments
    ``(target, prompt, cfg, stop_ids, vocab, generator, on_tokens=None)`` (no draft model)."""
    return run_program(ngram_sd_program(job_for(target, None, *args, **kwargs)))
