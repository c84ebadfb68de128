"""The sd rounds as single functions of device tensors (:mod:`smcspec.decoding.fused`).

* :func:`sd_round`: K draft steps, the target's forward over ``[pending, d_1..d_K]``, the
  speculative test (Leviathan et al. 2023, Alg. 1) and the token after the accepted prefix
  (chain sd, :mod:`smcspec.decoding.sd.chain`).
* :func:`multi_sd_round`: K draft steps for N chains, the target's forward over every row and
  the tree's verdict (multi-draft sd, :mod:`smcspec.decoding.sd.multi_sd`).

Each with its ``*_joined`` twin over every slot of a bank (the scheduler's joined rounds).
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from smcspec.backends.base import KVCache
from smcspec.config import GenerationConfig
from smcspec.decoding.fused import (
    StaticForward,
    Tensors,
    bank_forwards,
    cache_forwards,
    claim,
    read_checked,
    scalar,
    window,
)
from smcspec.decoding.job import Job
from smcspec.decoding.program import Join, Round
from smcspec.sampling.distributions import (
    categorical_from_uniforms,
    draw_uniforms,
    point_mass_log_probs,
    step_log_probs,
)
from smcspec.sampling.tree_verify import TreeVerdict, multi_draft_verify
from smcspec.sampling.truncation import truncate_log_probs


def sd_round(
    job: Job, tcache: KVCache, dcache: KVCache, pending_d: list[int], pending_t: int
) -> Generator[Round, Tensors, tuple[list[int], int, int]]:
    """One round of exact speculative sampling as a :class:`Round`, which the scheduler may
    run batched with other requests' rounds of the same shape (:class:`Join`,
    :func:`sd_joined`): K = ``cfg.draft_tokens`` draft steps after feeding ``pending_d`` (1
    or 2 tokens the draft has not seen), the target's forward over ``[pending_t,
    d_1..d_K]``, the test ``u q(d_j) < p(d_j)`` and the token after the accepted prefix
    (from the residual ``norm(max(p - q, 0))`` at the first rejection, ``p`` itself where
    that is empty, the bonus from ``p`` at position K+1).

    Returns ``(drafted, n, next)``: the K drafted tokens, how many were accepted and the
    target's token after them, as :func:`~smcspec.decoding.sd.chain.verify_block` does. Both
    caches hold the whole block afterwards; the caller rolls back what was rejected.
    Raises NumericalError after the round, ContextLengthError before it."""
    cfg, dev, k, w, generator = (
        job.config,
        job.device,
        job.config.draft_tokens,
        len(pending_d),
        job.generator,
    )
    d_start, t_start = claim(dcache, w + k - 1), claim(tcache, k + 1)
    span = window(max(d_start + w + k - 1, t_start + k + 1))
    inputs = {
        "pending_d": torch.tensor([pending_d], dtype=torch.long, device=dev),
        "pending_t": torch.full((1, 1), pending_t, dtype=torch.long, device=dev),
        "u_draft": draw_uniforms(k, generator, dev).view(k, 1, 1),  # as k draws of one
        "u_accept": torch.rand(k, generator=generator, device=dev).view(
            1, k
        ),  # speculative_verify's
        "u_next": draw_uniforms(1, generator, dev),
        "d_start": scalar(d_start, dev),
        "t_start": scalar(t_start, dev),
    }
    t_d = 0.0 if cfg.greedy else cfg.draft_temperature
    consts = (k, w, cfg.temperature, t_d, cfg.greedy, cfg.truncation, job.vocab)
    key = ("sd", span, consts, dcache.serial, dcache.prompt_window, tcache.prompt_window)

    def fn(x: Tensors) -> Tensors:
        out = _sd_body(job, x, *cache_forwards(job, tcache, dcache, span))
        return {name: t[0] for name, t in out.items()}

    join = Join(("sd", *consts), sd_joined(job), span, (tcache, dcache))
    out = yield Round(job.target, tcache, key, fn, inputs, join)
    *drafted, n, nxt = read_checked(out, "result")
    return drafted, n, nxt


def sd_joined(job: Job):
    """The sd rounds of every slot of a pair of banks at once (:class:`Join`; the target's
    bank first, the draft's second, slot ``b`` of both one request's): the inputs of
    :func:`sd_round` stacked over ``B`` slots and ``keep`` ``[B]``; outputs ``result`` int64
    ``[B, K+2]`` and ``ok`` bool ``[B]``. Only the request's constants are taken from
    ``job`` (the join key names them)."""

    def fn(banks, x: Tensors, span: int, prompt_windows: tuple[int, int]) -> Tensors:
        keep = x["keep"]
        b = keep.shape[0]
        flat = {
            "pending_d": x["pending_d"].view(b, -1),
            "pending_t": x["pending_t"].view(b, 1),
            "u_draft": x["u_draft"].transpose(0, 1).reshape(-1, b, 1),
            "u_accept": x["u_accept"].view(b, -1),
            "u_next": x["u_next"].view(b, 1),
            "d_start": x["d_start"],
            "t_start": x["t_start"],
        }

        return _sd_body(job, flat, *bank_forwards(job, banks, keep, span, prompt_windows))

    return fn


def _sd_probs(cfg: GenerationConfig, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """sd's sampling distributions of ``logits`` ``[..., V]``: tempered, truncated by the
    request's filters, a point mass when greedy (float32 probabilities)."""
    lp = truncate_log_probs(step_log_probs(logits, temperature, False), *cfg.truncation)
    return (point_mass_log_probs(lp) if cfg.greedy else lp).exp()


def _sd_drafts(
    job: Job, x: Tensors, draft: StaticForward
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sd's K draft steps over every row (``pending_d`` ``[R, w]``, ``u_draft`` ``[K, R,
    1]``): the drafted tokens int64 ``[R, K]``, their draft distributions ``[R, K, V]`` and a
    bool ``[R]`` flag of NaN logits or an unsampleable row."""
    cfg, vocab = job.config, job.vocab
    t_d = 0.0 if cfg.greedy else cfg.draft_temperature
    feed, start = x["pending_d"], x["d_start"]
    bad = torch.zeros(feed.shape[0], dtype=torch.bool, device=feed.device)
    tokens, q_rows = [], []
    for j in range(cfg.draft_tokens):
        logits = draft(feed, start)
        start = start + feed.shape[1]
        q = _sd_probs(cfg, logits[:, -1, :vocab], t_d)  # [R, V]
        d, valid = categorical_from_uniforms(q, x["u_draft"][j])
        bad = bad | ~valid | torch.isnan(q[:, 0])
        tokens.append(d)
        q_rows.append(q)
        feed = d[:, None]
    return torch.stack(tokens, 1), torch.stack(q_rows, 1), bad


def _sd_body(job: Job, x: Tensors, draft: StaticForward, target: StaticForward) -> Tensors:
    """The sd round of ``B`` requests of one row each: ``pending_d`` ``[B, w]``,
    ``pending_t`` ``[B, 1]``, ``u_draft`` ``[K, B, 1]``, ``u_accept`` ``[B, K]``, ``u_next``
    ``[B, 1]``; ``draft(feed, start)`` and ``target(block, start)`` are the models' static
    forwards. Returns ``result`` int64 ``[B, K+2]`` (the drafted tokens, how many were
    accepted, the next token) and ``ok`` bool ``[B]``."""
    cfg, vocab, k = job.config, job.vocab, job.config.draft_tokens
    drafted, q_all, bad = _sd_drafts(job, x, draft)  # [B, K], [B, K, V]
    block = torch.cat((x["pending_t"], drafted), 1)
    p_all = _sd_probs(cfg, target(block, x["t_start"])[:, :, :vocab], cfg.temperature)
    q_d = q_all.gather(-1, drafted[..., None])[..., 0]
    p_d = p_all[:, :k].gather(-1, drafted[..., None])[..., 0]
    rejected = x["u_accept"] * q_d >= p_d  # [B, K]
    n = torch.where(rejected.any(1), rejected.int().argmax(1), k)  # the first rejection
    q_ext = torch.cat((q_all, torch.zeros_like(q_all[:, :1])), 1)  # q = 0 after the block
    at_n = n[:, None, None].expand(-1, 1, p_all.shape[-1])
    p_n = p_all.gather(1, at_n)[:, 0]
    residual = (p_n - q_ext.gather(1, at_n)[:, 0]).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)  # p == q
    nxt, valid = categorical_from_uniforms(residual, x["u_next"])
    bad = bad | ~valid | torch.isnan(p_all[:, :, 0]).any(1)
    return {"result": torch.cat((drafted, n[:, None], nxt[:, None]), 1), "ok": ~bad}


# ------------------------------------------------------------------ multi-draft sd
def multi_sd_round(
    job: Job, tcache: KVCache, dcache: KVCache, pending_d: list[int], pending_t: int
) -> Generator[Round, Tensors, tuple[list[list[int]], TreeVerdict]]:
    """One round of multi-draft sd (:mod:`smcspec.decoding.sd.multi_sd`) as a :class:`Round`,
    which the scheduler may run batched with other requests' rounds of the same shape
    (:class:`Join`, :func:`multi_sd_joined`): K draft steps for the N chains after feeding
    ``pending_d`` (1 or 2 tokens, the same on every row), the target's forward over
    ``[pending_t, d_1..d_K]`` on every row and the tree's verdict
    (:func:`~smcspec.sampling.tree_verify.multi_draft_verify`), read back in one host read.

    Returns ``(drafted, verdict)``: the N chains' K tokens and the :class:`TreeVerdict` of
    the one tree (host tensors, ``B`` = 1). Both caches hold every row's block afterwards;
    the caller makes every row the accepting chain's and rolls back. Raises NumericalError
    after the round, ContextLengthError before it."""
    cfg, dev, generator = job.config, job.device, job.generator
    n, k, w = cfg.particles, cfg.draft_tokens, len(pending_d)
    d_start, t_start = claim(dcache, w + k - 1), claim(tcache, k + 1)
    span = window(max(d_start + w + k - 1, t_start + k + 1))
    inputs = {
        "pending_d": torch.tensor([pending_d] * n, dtype=torch.long, device=dev),
        "pending_t": torch.full((n, 1), pending_t, dtype=torch.long, device=dev),
        "u_draft": draw_uniforms(k * n, generator, dev).view(k, n, 1),  # k draws of n
        "u_accept": torch.rand(k * n, generator=generator, device=dev).view(1, k, n),
        "u_next": draw_uniforms(1, generator, dev),
        "d_start": scalar(d_start, dev),
        "t_start": scalar(t_start, dev),
    }
    consts = (n, k, w, cfg.temperature, cfg.draft_temperature, cfg.truncation, job.vocab)
    key = ("multi-sd", span, consts, dcache.serial, dcache.prompt_window, tcache.prompt_window)

    def fn(x: Tensors) -> Tensors:
        out = _multi_sd_body(job, x, 1, *cache_forwards(job, tcache, dcache, span))
        return {name: t[0] for name, t in out.items()}

    join = Join(("multi-sd", *consts), multi_sd_joined(job), span, (tcache, dcache))
    out = yield Round(job.target, tcache, key, fn, inputs, join)
    values = read_checked(out, "result")
    drafted = [values[i * k : (i + 1) * k] for i in range(n)]
    accepted, chain, token, *tried = values[n * k :]
    verdict = TreeVerdict(
        *(torch.tensor([v]) for v in (accepted, chain, token)),
        tried=torch.tensor([tried]),
        valid=torch.ones(1, dtype=torch.bool),
    )
    return drafted, verdict


def multi_sd_joined(job: Job):
    """The multi-draft sd rounds of every slot of a pair of banks at once (:class:`Join`; the
    target's bank first): the inputs of :func:`multi_sd_round` stacked over ``B`` slots and
    ``keep`` ``[B]``; outputs ``result`` int64 ``[B, N*K + 3 + K]`` and ``ok`` bool ``[B]``.
    Only the request's constants are taken from ``job`` (the join key names them)."""
    n = job.config.particles

    def fn(banks, x: Tensors, span: int, prompt_windows: tuple[int, int]) -> Tensors:
        keep = x["keep"]
        b = keep.shape[0]
        flat = {
            "pending_d": x["pending_d"].reshape(b * n, -1),
            "pending_t": x["pending_t"].reshape(b * n, 1),
            "u_draft": x["u_draft"].transpose(0, 1).reshape(x["u_draft"].shape[1], b * n, 1),
            "u_accept": x["u_accept"].reshape(b, *x["u_accept"].shape[-2:]),
            "u_next": x["u_next"].reshape(b, 1),
            "d_start": x["d_start"],
            "t_start": x["t_start"],
        }
        forwards = bank_forwards(job, banks, keep, span, prompt_windows)
        return _multi_sd_body(job, flat, b, *forwards)

    return fn


def _multi_sd_body(
    job: Job, x: Tensors, slots: int, draft: StaticForward, target: StaticForward
) -> Tensors:
    """Multi-draft sd rounds of ``slots`` requests of N chains each, rows slot-major:
    ``pending_d`` ``[S*N, w]``, ``pending_t`` ``[S*N, 1]``, ``u_draft`` ``[K, S*N, 1]``,
    ``u_accept`` ``[S, K, N]``, ``u_next`` ``[S, 1]``. Returns ``result`` int64
    ``[S, N*K + 3 + K]`` (each slot's drafted chains, then the accepted depth, the accepting
    chain, the next token and the candidates tried per depth) and ``ok`` bool ``[S]``."""
    cfg, vocab = job.config, job.vocab
    n, k = cfg.particles, cfg.draft_tokens
    drafted, q_all, bad = _sd_drafts(job, x, draft)  # [S*N, K], [S*N, K, V]
    block = torch.cat((x["pending_t"], drafted), 1)
    p_all = _sd_probs(cfg, target(block, x["t_start"])[:, :, :vocab], cfg.temperature)
    v = multi_draft_verify(
        drafted.view(slots, n, k),
        None,
        q_all.view(slots, n, k, -1),
        p_all.view(slots, n, k + 1, -1),
        x["u_accept"],
        x["u_next"],
    )
    picked = torch.stack((v.accepted, v.chain, v.token), 1)
    result = torch.cat((drafted.view(slots, n * k), picked, v.tried), 1)
    bad = bad.view(slots, n).any(1) | torch.isnan(p_all[:, :, 0]).view(slots, -1).any(1)
    return {"result": result, "ok": ~bad & v.valid}
