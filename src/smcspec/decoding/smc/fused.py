"""The SMC-SD proposal as one function of device tensors (:mod:`smcspec.decoding.fused`).

:func:`smc_block`: SMC-SD's steps 3a, 3b and 3d (``docs/smc-sd.md``): K draft steps for the
N particles, each drawing from ``q_T`` (truncated only with ``truncate_draft``), the target's
forward over the N x (K+1) block, the drafted tokens' ``log p~``, the bonus token from
``∝ p~^alpha`` and its log-weight (with ``round_end="ess"`` the target's logits instead: the
bonus is drawn where the round is cut, :mod:`smcspec.decoding.smc.cut`). Weights, ESS,
resampling and banking stay in the decoder (they read a few numbers per round, once).
:func:`smc_joined` is the same over every slot of a bank (the scheduler's joined rounds).
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from smcspec.backends.base import KVCache
from smcspec.decoding.fused import (
    StaticForward,
    Tensors,
    bank_forwards,
    cache_forwards,
    check_ok,
    claim,
    scalar,
    window,
)
from smcspec.decoding.job import Job
from smcspec.decoding.program import Join, Round
from smcspec.sampling.distributions import (
    categorical_from_uniforms,
    draw_uniforms,
    nan_rows,
    tempered_log_probs,
)
from smcspec.sampling.smc_weights import power_target_probs
from smcspec.sampling.truncation import truncate_log_probs


def smc_block(
    job: Job,
    pending_d: torch.Tensor,
    pending_t: torch.Tensor,
    host: torch.Tensor | None,
    tcache: KVCache,
    dcache: KVCache,
) -> Generator[Round, Tensors, Tensors]:
    """One SMC-SD proposal as a :class:`Round`, which the scheduler may run batched with
    other requests' proposals of the same shape (:class:`Join`, :func:`smc_joined`):
    returns ``drafted`` int64 ``[N, K]``, ``draft_lp`` float32 ``[N, K]`` (log q of each
    drafted token), ``target_lp`` float32 ``[N, K]`` (log p~), ``bonus`` int64 ``[N]`` and,
    at alpha != 1 or with truncation, ``bonus_norm`` float64 ``[N]``.

    ``pending_d`` int64 ``[N, 1 or 2]`` (not yet fed to the draft), ``pending_t`` int64
    ``[N, 1]``; ``host`` int64 ``[N]``: the row each ended particle follows (None: itself).
    Both caches advance on the host before the round (``w + K - 1`` and ``K + 1``
    positions). Raises NumericalError after the round where the step-by-step round would
    have raised inside it, ContextLengthError before it.
    """
    cfg, dev = job.config, job.device
    n, k = cfg.particles, cfg.draft_tokens
    w = pending_d.shape[1]
    d_start, t_start = claim(dcache, w + k - 1), claim(tcache, k + 1)
    span = window(max(d_start + w + k - 1, t_start + k + 1))
    draws = k if cfg.round_end == "ess" else k + 1  # "ess": the bonus waits for the cut
    inputs = {
        "pending_d": pending_d,
        "pending_t": pending_t,
        "host": host if host is not None else torch.arange(n, device=dev),
        "u": draw_uniforms(draws * n, job.generator, dev).view(draws, n, 1),
        "d_start": scalar(d_start, dev),
        "t_start": scalar(t_start, dev),
    }
    consts = (n, k, w, cfg.temperature, cfg.draft_temperature, cfg.alpha, cfg.truncation)
    consts += (job.draft_truncation, job.vocab, cfg.round_end)
    key = ("smc", span, consts, dcache.serial, dcache.prompt_window, tcache.prompt_window)

    def fn(x: Tensors) -> Tensors:
        out = _smc_body(job, x, 1, *cache_forwards(job, tcache, dcache, span))
        return {name: t[0] if name == "ok" else t for name, t in out.items()}

    join = Join(("smc", *consts), smc_joined(job), span, (tcache, dcache))
    out = yield Round(job.target, tcache, key, fn, inputs, join)
    check_ok(out)
    return out


def smc_joined(job: Job):
    """The SMC-SD proposals of every slot of a pair of banks at once (:class:`Join`; the
    target's bank first, the draft's second, slot ``b`` of both one request's): the inputs
    of :func:`smc_block` stacked over ``B`` slots (``pending_d`` ``[B, N, w]``, ``host``
    ``[B, N]``, ``u`` ``[B, K+1, N, 1]``, the starts ``[B]``) and ``keep`` ``[B]``; the
    outputs of :func:`smc_block` with a leading ``[B]`` (``ok`` bool ``[B]``). Only the
    request's constants are taken from ``job`` (the join key names them)."""
    n = job.config.particles

    def fn(banks, x: Tensors, span: int, prompt_windows: tuple[int, int]) -> Tensors:
        b, keep = x["keep"].shape[0], x["keep"]
        flat = {
            "pending_d": x["pending_d"].reshape(b * n, -1),
            "pending_t": x["pending_t"].reshape(b * n, 1),
            # each slot's rows follow rows of the same slot
            "host": (x["host"] + n * torch.arange(b, device=keep.device)[:, None]).reshape(-1),
            "u": x["u"].transpose(0, 1).reshape(x["u"].shape[1], b * n, 1),
            "d_start": x["d_start"],
            "t_start": x["t_start"],
        }

        out = _smc_body(job, flat, b, *bank_forwards(job, banks, keep, span, prompt_windows))
        return {name: t if name == "ok" else t.view(b, n, *t.shape[1:]) for name, t in out.items()}

    return fn


def _smc_body(
    job: Job, x: Tensors, slots: int, draft: StaticForward, target: StaticForward
) -> Tensors:
    """Steps 3a, 3b and 3d for ``slots`` requests' N particles each, rows slot-major:
    ``pending_d`` ``[S*N, w]``, ``pending_t`` ``[S*N, 1]``, ``host`` ``[S*N]`` (rows of
    the whole batch), ``u`` ``[K+1, S*N, 1]``; ``draft(feed, start)`` and ``target(block,
    start)`` are the models' static forwards. Outputs per row, and ``ok`` bool ``[S]``."""
    cfg, k = job.config, job.config.draft_tokens
    t_t, trunc = cfg.temperature, cfg.truncation
    drafted, draft_lp, bad = _smc_drafts(job, x, slots, draft)
    block = torch.cat((x["pending_t"], drafted), 1)
    logits = target(block, x["t_start"])[:, :, : job.vocab]
    lp = truncate_log_probs(tempered_log_probs(logits[:, :k], t_t, False), *trunc)
    target_lp = lp.gather(-1, drafted[:, :, None])[:, :, 0]
    if cfg.round_end == "ess":  # the bonus is drawn at the cut, after the round
        bad = bad | (nan_rows(lp).any(-1) | torch.isnan(logits[:, k, 0])).view(slots, -1).any(1)
        out = {"drafted": drafted, "draft_lp": draft_lp, "target_lp": target_lp}
        return {**out, "logits": logits.float(), "ok": ~bad}
    probs, norm = power_target_probs(logits[:, k], t_t, cfg.alpha, trunc, check=False)
    bonus, valid = categorical_from_uniforms(probs, x["u"][k])
    bad_rows = nan_rows(lp).any(-1) | ~valid | torch.isnan(probs[:, 0])
    bad = bad | bad_rows.view(slots, -1).any(1)
    out = {
        "drafted": drafted,
        "draft_lp": draft_lp,
        "target_lp": target_lp,
        "bonus": bonus[x["host"]],
        "ok": ~bad,
    }
    if norm is not None:
        out["bonus_norm"] = norm
    return out


def _smc_drafts(
    job: Job, x: Tensors, slots: int, draft: StaticForward
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K draft forwards of every row inside a round: drafted tokens ``[S*N, K]``, their
    ``log q`` ``[S*N, K]`` and a bool ``[S]`` flag per slot of NaN logits or an
    unsampleable row."""
    cfg = job.config
    feed, start = x["pending_d"], x["d_start"]
    bad = torch.zeros(slots, dtype=torch.bool, device=feed.device)
    tokens, lps = [], []
    for j in range(cfg.draft_tokens):
        logits = draft(feed, start)
        start = start + feed.shape[1]
        lq = tempered_log_probs(logits[:, -1, : job.vocab], cfg.draft_temperature, False)
        lq = truncate_log_probs(lq, *job.draft_truncation)
        d, valid = categorical_from_uniforms(lq.exp(), x["u"][j])
        d = d[x["host"]]  # ended rows draft what their host drafts
        bad = bad | (nan_rows(lq) | ~valid).view(slots, -1).any(1)
        tokens.append(d)
        lps.append(lq.gather(-1, d[:, None])[:, 0])
        feed = d[:, None]
    return torch.stack(tokens, 1), torch.stack(lps, 1), bad
