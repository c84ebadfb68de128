"""Exact speculative sampling from N drafted chains (multi-draft ``sd``, ``-N`` >= 2).

Each round the draft samples N chains of K tokens from the accepted prefix, one batched
forward per token (SMC-SD's drafting: the chains are N particle rows); the target scores the
N x (K+1) rows in one forward (with distinct rows, :mod:`smcspec.backends.shared_rows`, the
chains' shared prefixes once: the token tree); recursive rejection over the tree
(:func:`~smcspec.sampling.tree_verify.multi_draft_verify`; SpecInfer, Miao et al. 2024)
accepts a path and draws the target's token after it. Every row then restarts from the
accepted path: both caches take the accepting chain's rows (``reorder``) and roll back what
was not accepted. The output is distributed exactly as the target (after temperature and
top-k / top-p / min-p, as chain sd), and the accepted length grows with N.

With a constraint each chain drafts from the masked draft with its own matcher and the
target is masked row by row, as chain sd masks its one row (:mod:`smcspec.decoding.sd.chain`):
the output is exactly the locally-masked target. A chain that drafts a stop token or reaches
a dead end ends early; its node is then a leaf of the tree. Greedy requests run as chain sd
(every chain would be the draft's argmax chain).

The draft's KV is kept one step behind (deferred feeding), as in chain sd.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import torch

import smcspec.decoding.potential_hooks as potential_hooks
from smcspec.backends.base import KVCache
from smcspec.backends.pool import CacheNeed
from smcspec.config import GenerationConfig
from smcspec.decoding.caches import cache_capacity, run_on_caches
from smcspec.decoding.fused import fused_rounds, plain
from smcspec.decoding.job import Job, job_for
from smcspec.decoding.logprobs import TokenLogprobs, token_logprobs
from smcspec.decoding.output import DecodeOutput, cut_at_stop
from smcspec.decoding.program import Forward, Program, run_program
from smcspec.decoding.sd.chain import sd_start
from smcspec.decoding.sd.fused import multi_sd_round
from smcspec.decoding.sd.stats import SdStats
from smcspec.errors import NumericalError
from smcspec.potentials import ConstraintState, DeadEndError
from smcspec.sampling.distributions import draw_uniforms, sample_categorical, step_log_probs
from smcspec.sampling.masking import mask_log_probs
from smcspec.sampling.tree_verify import TreeVerdict, multi_draft_verify
from smcspec.sampling.truncation import truncate_log_probs


def multi_sd_caches(cfg: GenerationConfig, prompt_len: int) -> list[CacheNeed]:
    """The KV caches :func:`multi_sd_program` opens: N rows on the target and N on the draft
    (distinct rows: the chains' shared prefixes are stored and computed once)."""
    cap = cache_capacity(cfg.max_new_tokens, cfg.draft_tokens)
    n, share = cfg.particles, cfg.shared_rows
    return [
        CacheNeed("target", n, cap, prompt_len, share),
        CacheNeed("draft", n, cap, prompt_len, share),
    ]


def multi_sd_program(job: Job) -> Program:
    """Multi-draft speculative sampling: ``cfg.particles`` chains of ``cfg.draft_tokens``
    tokens a round (module docstring). ``job``: the request
    (:class:`~smcspec.decoding.job.Job`; ``cfg.temperature > 0``).

    Yields :class:`Prefill`/:class:`Forward` requests, or one
    :class:`~smcspec.decoding.program.Round` per full round where the models run rounds fused
    (:func:`smcspec.decoding.sd.fused.multi_sd_round`).

    Returns:
        :class:`DecodeOutput` with :class:`~smcspec.decoding.sd.stats.SdStats` from
        :meth:`~smcspec.decoding.sd.stats.SdStats.multi_draft`: rounds, the depth
        offered (``drafted``, K a round) and accepted, per-depth acceptance, candidates
        examined.

    Raises:
        ValueError: a greedy request (the engine runs those as chain sd).
        DeadEndError: with a constraint, no allowed token can follow.
    """
    cfg = job.config
    if cfg.greedy:
        raise ValueError("multi-draft sd needs temperature > 0 (greedy requests run as sd)")
    fused = fused_rounds(job.target, job.draft) and plain(cfg)
    needs = multi_sd_caches(cfg, len(job.ids))
    return (yield from run_on_caches(job, needs, _multi_sd_rounds, fused))


@dataclass
class _Tree:
    """One round's drafted chains and the verdict on them (host values)."""

    drafted: list[list[int]]  # N chains, each its drafted tokens (a chain may be shorter)
    verdict: TreeVerdict  # of one tree (B = 1), on the host
    states: list[ConstraintState] = field(default_factory=list)  # each chain's matcher
    consumed: list[int] = field(default_factory=list)  # tokens each matcher consumed
    # the accepted path's and the next token's log-probabilities (requests that ask)
    logprobs: TokenLogprobs | None = None

    @property
    def path(self) -> list[int]:
        """The accepted drafted tokens."""
        c, n = int(self.verdict.chain), int(self.verdict.accepted)
        return self.drafted[c][:n]


def _multi_sd_rounds(job: Job, tcache: KVCache, dcache: KVCache) -> Program:
    cfg = job.config
    start = yield from sd_start(job, tcache, dcache)
    state, out, record, finished = start.state, start.out, start.record, start.finished
    pending_t, pending_d = out[0], [out[0]]
    stats = SdStats.multi_draft(cfg.particles, cfg.draft_tokens)
    while not finished:
        k = min(cfg.draft_tokens, cfg.max_new_tokens - len(out) - 1)
        d_len0, t_len0 = dcache.length, tcache.length
        if start.fused and k == cfg.draft_tokens:  # the whole round on the device
            tree = _Tree(*(yield from multi_sd_round(job, tcache, dcache, pending_d, pending_t)))
        else:
            tree = yield from _tree_round_steps(job, tcache, dcache, pending_d, pending_t, k, state)
        _count(stats, tree, k)
        v = tree.verdict
        c, n, nxt = int(v.chain), int(v.accepted), int(v.token)
        new, stopped = cut_at_stop([*tree.path, nxt], job.stop_ids)
        new = new[: cfg.max_new_tokens - len(out)]
        out.extend(new)
        lps = tree.logprobs.slice(0, len(new)) if tree.logprobs is not None else None
        if record is not None and lps is not None:
            record.extend(lps)
        job.emit(new, lps)
        finished = stopped or len(out) >= cfg.max_new_tokens
        if state is not None:
            state = tree_state(tree, c, n, nxt, finished)
        _restart_rows(tcache, dcache, c, t_len0 + 1 + n)
        pending_d = _tree_draft_pending(dcache, d_len0, pending_d, tree.drafted[c], n, nxt)
        pending_t = nxt
    return start.output(stats)


def _count(stats: SdStats, tree: _Tree, k: int) -> None:
    """Add one round to ``stats``: the depth offered and accepted, per-depth counts and the
    candidates examined."""
    n = int(tree.verdict.accepted)
    stats.rounds += 1
    stats.drafted += k
    stats.accepted += n
    tried = tree.verdict.tried.view(-1).tolist()
    stats.candidates += sum(tried)
    for j in range(min(k, len(stats.depth_reached))):
        if tried[j] > 0:  # a node with candidates: the round reached depth j
            stats.depth_reached[j] += 1
            stats.depth_accepted[j] += int(j < n)


def tree_state(tree: _Tree, c: int, n: int, nxt: int, finished: bool) -> ConstraintState:
    """The matcher after a round: chain ``c``'s, rolled back to the ``n`` accepted tokens and
    advanced by ``nxt`` (unless the answer ended)."""
    state = tree.states[c]
    if not finished:  # (an accepted stop token ends the answer: the matcher is not needed)
        state.rollback(tree.consumed[c] - n)
        state.consume([nxt])
    return state


def _restart_rows(tcache: KVCache, dcache: KVCache, chain: int, t_keep: int) -> None:
    """Every row of both caches becomes a copy of ``chain``'s, and the target keeps
    ``t_keep`` generated positions (what it accepted)."""
    anc = torch.full((tcache.rows,), chain, dtype=torch.long)
    tcache.truncate(t_keep)
    tcache.reorder(anc)
    dcache.reorder(anc)


def _tree_draft_pending(
    dcache: KVCache, d_len0: int, pending: list[int], chain: list[int], n: int, nxt: int
) -> list[int]:
    """The tokens the draft has not seen after a round (deferred feeding), its KV rolled back
    to them. Every row was fed ``pending`` then each chain's tokens but its last from length
    ``d_len0``; ``chain`` (the accepting chain's drafted tokens, ``n`` of them accepted) and
    ``nxt`` decide: nothing drafted: ``pending`` and ``nxt``; a rejection inside the chain:
    ``nxt``; the whole chain accepted: its last token (never fed) and ``nxt``."""
    if not chain:
        dcache.truncate(d_len0)
        return [*pending, nxt]
    if n < len(chain):
        dcache.truncate(d_len0 + len(pending) + n)
        return [nxt]
    dcache.truncate(d_len0 + len(pending) + len(chain) - 1)
    return [chain[-1], nxt]


def _tree_round_steps(
    job: Job,
    tcache: KVCache,
    dcache: KVCache,
    pending_d: list[int],
    pending_t: int,
    k: int,
    state: ConstraintState | None,
) -> Generator[Forward, torch.Tensor, _Tree]:
    """One round step by step: ``k`` draft forwards of N rows, the target's forward over
    ``[pending_t, d_1..d_k]`` on every row and the tree's verdict; the random numbers in the
    order :func:`smcspec.decoding.sd.fused.multi_sd_round` draws them."""
    cfg, dev, vocab = job.config, job.device, job.vocab
    n = cfg.particles
    drafts = _Drafts(job, state, n, k)
    x = torch.tensor([pending_d] * n, device=dev)
    for j in range(k):
        logits = (yield Forward(job.draft, x, dcache, last_only=True))[:, -1, :vocab]
        q = truncate_log_probs(step_log_probs(logits, cfg.draft_temperature), *cfg.truncation)
        d = drafts.draw(j, q)
        x = d[:, None]
    block = torch.cat((torch.full((n, 1), pending_t, device=dev), drafts.tokens), 1)
    t_logits = (yield Forward(job.target, block, tcache))[:, :, :vocab]
    lp = truncate_log_probs(step_log_probs(t_logits, cfg.temperature), *cfg.truncation)
    masked = drafts.masked_target(lp)
    p = masked.exp()
    u_accept = torch.rand(k * n, generator=job.generator, device=dev).view(1, k, n)
    u_next = draw_uniforms(1, job.generator, dev)
    verdict = multi_draft_verify(
        drafts.tokens[None], drafts.lengths[None], drafts.probs()[None], p[None], u_accept, u_next
    )
    if not bool(verdict.valid.all()):
        raise NumericalError("cannot sample from a distribution with no finite positive mass")
    drafts.check_leaf(verdict)
    tree = drafts.tree(verdict)
    if job.wants_logprobs:  # the accepting chain's rows, up to the token after its path
        c, m = int(verdict.chain), int(verdict.accepted)
        toks = [*tree.path, int(verdict.token)]
        lp_c, logits_c = masked[c, : m + 1], t_logits[c, : m + 1]
        tree.logprobs = token_logprobs(lp_c, logits_c, toks, cfg.logprobs, cfg.logprobs_mode)
    return tree


class _Drafts:
    """The N chains a round drafts step by step, with their draft distributions and, under a
    constraint, their matchers and masks (``masks[j]``: bool ``[N, V]``, each chain's mask
    after its first ``j`` tokens)."""

    def __init__(self, job: Job, state: ConstraintState | None, n: int, k: int) -> None:
        dev = job.device
        self.job, self.k = job, k
        self.tokens = torch.zeros(n, k, dtype=torch.long, device=dev)
        self.lengths = torch.full((n,), k, dtype=torch.long, device=dev)
        self.q: list[torch.Tensor] = []
        self.states = [state.copy() for _ in range(n)] if state is not None else []
        self.open = torch.ones(n, dtype=torch.bool, device=dev)
        self.masks: list[torch.Tensor] = []
        if state is not None:
            root = state.allowed()[: job.vocab].to(dev)
            if not bool(root.any()):
                raise DeadEndError("no token allowed by the constraint can follow (dead end)")
            self.masks.append(root.expand(n, -1))

    def draw(self, j: int, lq: torch.Tensor) -> torch.Tensor:
        """Draw each chain's token ``j+1`` from its draft log-probs ``lq`` ``[N, V]``
        (masked under a constraint); returns int64 ``[N]``."""
        if self.masks:
            lq = _masked_draft_rows(lq, self.masks[j])
        q = lq.exp()
        d = sample_categorical(q, self.job.generator)
        self.q.append(q)
        self.tokens[:, j] = d
        if self.masks:
            self._step_matchers(j, d)
        return d

    def _step_matchers(self, j: int, d: torch.Tensor) -> None:
        """Matchers consume token ``j+1``; a chain ends at a stop token (its next mask all
        True, junk: a leaf there) or at a dead end after it (an empty mask)."""
        job = self.job
        stop = torch.isin(d, job.stop_tensor) & self.open
        self.lengths = torch.where(stop, j + 1, self.lengths)
        self.open = self.open & ~stop
        for i in self.open.nonzero()[:, 0].tolist():
            self.states[i].consume([int(d[i])])  # a refusal raises, as in chain sd
        mask = potential_hooks.masks(job.constraint, self.states, self.open, job.vocab, d.device)
        ended = self.open & ~mask.any(-1)  # a dead end after d_{j+1}
        self.lengths = torch.where(ended, j + 1, self.lengths)
        self.open = self.open & ~ended
        self.masks.append(mask)

    def probs(self) -> torch.Tensor:
        """float ``[N, k, V]``: each drafted token's draft distribution."""
        if not self.q:
            return self.tokens.new_zeros(self.tokens.shape[0], 0, 1).float()
        return torch.stack(self.q, 1)

    def masked_target(self, lp: torch.Tensor) -> torch.Tensor:
        """The target's log-probs ``[N, k+1, V]`` masked row by row (the mask of each
        chain's prefix); a row whose mask is empty (a dead end) or whose prefix lies past the
        chain's end is left unmasked: the tree never reads it, or :meth:`check_leaf` raises.

        Raises:
            DeadEndError: a used row's mask allows no token the target's filters keep
                (chain sd's rule).
        """
        if not self.masks:
            return lp
        out = lp.clone()
        for j, m in enumerate(self.masks):
            used = m.any(-1) & (self.lengths >= j)
            if bool((used & ~(m & (lp[:, j] > -torch.inf)).any(-1)).any()):
                raise DeadEndError("no token allowed by the constraint can be sampled (dead end)")
            out[:, j] = torch.where(used[:, None], mask_log_probs(lp[:, j], m), lp[:, j])
        return out

    def check_leaf(self, v: TreeVerdict) -> None:
        """Raise :class:`DeadEndError` where the accepted path ends at a position whose mask
        allows nothing the target can draw (chain sd's rule)."""
        if not self.masks:
            return
        c, n = int(v.chain), int(v.accepted)
        if not bool(self.masks[n][c].any()):
            raise DeadEndError("no token allowed by the constraint can follow (dead end)")

    def tree(self, v: TreeVerdict) -> _Tree:
        """The round's :class:`_Tree`: the chains cut to their lengths, the verdict, and under
        a constraint the matchers with how many tokens each consumed."""
        lengths = self.lengths.tolist()
        chains = [row[:m] for row, m in zip(self.tokens.tolist(), lengths, strict=True)]
        consumed = [m - int(bool(row) and row[-1] in self.job.stop_ids) for row, m in
                    zip(chains, lengths, strict=True)] if self.states else []  # fmt: skip
        return _Tree(chains, v, self.states, consumed)


def _masked_draft_rows(lq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log norm(q~ * m)`` per row (float32 ``[N, V]``); a row whose kept set misses the
    mask is uniform over the mask (any proposal keeps the rule exact)."""
    empty = ~(mask & (lq > -torch.inf)).any(-1, keepdim=True)
    return mask_log_probs(torch.where(empty, torch.zeros_like(lq), lq), mask)


def decode_multi_sd(*args: Any, **kwargs: Any) -> DecodeOutput:
    """Run :func:`multi_sd_program` to completion on its own, without an engine; arguments
    :func:`~smcspec.decoding.job.job_for`'s (target, draft, prompt, cfg, stop ids, vocab,
    generator, on_tokens)."""
    return run_program(multi_sd_program(job_for(*args, **kwargs)))
