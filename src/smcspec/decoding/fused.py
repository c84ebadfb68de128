"""Rounds written as single functions of device tensors: what a backend captures as a CUDA graph.

The decoders (:mod:`.ar`, :mod:`.sd`, :mod:`.smc`) run a round step by step: each forward is
a :class:`~smcspec.decoding.program.Forward` request and the sampling between forwards runs
on the host side of the generator, reading tokens back (distinct rows need them; so do
constraints). On a GPU that round trip after every draft step, and eager PyTorch's launches,
cost more than the forwards. This module writes the same rounds as one function of device
tensors each, yielded as a :class:`~smcspec.decoding.program.Round` that the torch backend
runs captured as a CUDA graph (:mod:`smcspec.backends.torch.graphs`):

* :func:`smc_block`: SMC-SD's steps 3a, 3b and 3d (``docs/smc-sd.md``): K draft steps for
  the N particles, each drawing from ``q_T`` (truncated only with ``truncate_draft``), the
  target's forward over the N x (K+1) block, the drafted tokens' ``log p~``, the bonus token
  from ``∝ p~^alpha`` and its log-weight (with ``round_end="ess"`` the target's logits
  instead: the bonus is drawn where the round is cut, :mod:`smcspec.decoding.smc.cut`).
  Weights, ESS, resampling and banking stay in the decoder (they read a few numbers per
  round, once).
* :func:`ar_round`: one target forward and the next token's draw; the ar decoder launches
  the next round before it reads this one's token (:class:`HostCopy`).
* :func:`sd_round`: K draft steps, the target's forward over ``[pending, d_1..d_K]``, the
  speculative test (Leviathan et al. 2023, Alg. 1) and the token after the accepted prefix.

Random numbers: a round's uniforms are drawn from the request's generator before the round,
in the order the step-by-step round draws them (one float64 per row per sampled token; sd's
acceptance test float32 per drafted token), and enter the round as an input. No generator
runs inside a graph, and on a CPU generator (where ``k`` draws of ``n`` equal one draw of
``k * n``) a fused round draws exactly what the step-by-step round draws: the same tokens,
weights and resampling for a seed (``tests/test_fused_rounds.py``). Errors that the
step-by-step round raises at once (NaN logits, a distribution with no mass) come back as an
``ok`` flag, read with the round's outputs and raised then.

Each round also carries a :class:`~smcspec.decoding.program.Join`: the same body over the
rows of every slot of a bank of static caches (:func:`ar_joined`, :func:`sd_joined`,
:func:`smc_joined`), which the scheduler runs as one call for the rounds of concurrent
requests of one kind (``docs/architecture.md``, "Where a round runs").

Fused rounds run where every model of the request runs rounds fused
(:func:`fused_rounds`), its caches are static, and the request needs no host work inside a
round (:func:`plain`: no constraint, no reward, no top-p, whose cut has a data-dependent
shape, no log-probabilities asked for; sd also no ``draft_p_min`` gate and only full K-token
rounds). Everything else runs step by step, as on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from smcspec.backends.base import DecoderModel, KVCache
from smcspec.config import GenerationConfig
from smcspec.decoding.job import Job
from smcspec.decoding.program import Join, Round
from smcspec.errors import NumericalError
from smcspec.sampling.distributions import (
    categorical_from_uniforms,
    draw_uniforms,
    nan_rows,
    point_mass_log_probs,
    step_log_probs,
    tempered_log_probs,
)
from smcspec.sampling.smc_weights import power_target_probs
from smcspec.sampling.tree_verify import TreeVerdict, multi_draft_verify
from smcspec.sampling.truncation import truncate_log_probs

Tensors = dict[str, torch.Tensor]
MIN_WINDOW = 64  # the smallest suffix window: few graphs for short answers


def fused_rounds(*models: DecoderModel | None) -> bool:
    """Whether every model runs rounds fused (a torch model whose ``round_mode`` is
    ``eager`` or ``graphs``; llama.cpp models and torch models in ``steps`` mode do not)."""
    return all(m is not None and getattr(m, "round_mode", "steps") != "steps" for m in models)


def plain(cfg: GenerationConfig) -> bool:
    """Whether a request needs no host work between a round's forwards: no constraint, no
    reward, no top-p (whose cut has a data-dependent shape), and no log-probabilities asked
    for (``cfg.logprobs``, ``cfg.prompt_logprobs``: such requests run step by step, where the
    decoders compute them, rather than as extra outputs of the captured rounds). Each decoder
    adds its own conditions (sd: no ``draft_p_min`` gate)."""
    no_logprobs = cfg.logprobs is None and not cfg.prompt_logprobs
    return cfg.constraint is None and cfg.reward is None and cfg.top_p >= 1 and no_logprobs


def is_static(*caches: KVCache) -> bool:
    """Whether every cache is a static one (the backend gave one: a slot was free)."""
    return all(getattr(c, "graphs", None) is not None for c in caches)


def window(end: int) -> int:
    """The suffix window of a round whose last write ends at position ``end`` (exclusive):
    the power of two >= it (at least :data:`MIN_WINDOW`), so that few graphs serve a
    request."""
    w = MIN_WINDOW
    while w < end:
        w *= 2
    return w


def check_ok(out: Tensors) -> None:
    """Raise what the step-by-step round would have raised inside the round."""
    _raise_unless(bool(out["ok"]))


def read_checked(out: Tensors, name: str) -> list[int]:
    """The round's int64 output ``name`` (1-dim) as a list, read with its ``ok`` flag in one
    host read; raises as :func:`check_ok`."""
    *values, ok = torch.cat((out[name], out["ok"].view(1).long())).tolist()
    _raise_unless(bool(ok))
    return values


def _raise_unless(ok: bool) -> None:
    if not ok:
        raise NumericalError(
            "a fused round met NaN logits or a distribution with no finite positive mass"
        )


def _claim(cache: KVCache, tokens: int) -> int:
    """Account for ``tokens`` positions the round writes on every row; returns the start.
    Raises ContextLengthError (before the round runs) when they do not fit."""
    start = cache.begin_step(tokens)
    cache.end_step()
    return start


def _scalar(value: int, dev: torch.device) -> torch.Tensor:
    return torch.full((), value, dtype=torch.long, device=dev)


Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _cache_forwards(
    job: Job, tcache: KVCache, dcache: KVCache, span: int
) -> tuple[Forward, Forward]:
    """A round's static forwards on one request's caches: ``draft(feed, start)`` (the last
    position's logits) and ``target(block, start)``, attending ``span`` suffix positions."""

    def draft(feed: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return job.draft.decode_static(feed, dcache, start, span, last_only=True)

    def target(block: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return job.target.decode_static(block, tcache, start, span)

    return draft, target


def _bank_forwards(
    job: Job, banks: tuple, keep: torch.Tensor, span: int, prompt_windows: tuple[int, int]
) -> tuple[Forward, Forward]:
    """:func:`_cache_forwards` over every slot of the target's and the draft's banks
    (``banks``, ``prompt_windows``: target first), the slots outside ``keep`` padded."""
    (tbank, dbank), (t_window, d_window) = banks, prompt_windows

    def draft(feed: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return job.draft.decode_bank(feed, dbank, start, keep, span, d_window, True)

    def target(block: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return job.target.decode_bank(block, tbank, start, keep, span, t_window)

    return draft, target


# --------------------------------------------------------------------------- SMC-SD
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
    d_start, t_start = _claim(dcache, w + k - 1), _claim(tcache, k + 1)
    span = window(max(d_start + w + k - 1, t_start + k + 1))
    draws = k if cfg.round_end == "ess" else k + 1  # "ess": the bonus waits for the cut
    inputs = {
        "pending_d": pending_d,
        "pending_t": pending_t,
        "host": host if host is not None else torch.arange(n, device=dev),
        "u": draw_uniforms(draws * n, job.generator, dev).view(draws, n, 1),
        "d_start": _scalar(d_start, dev),
        "t_start": _scalar(t_start, dev),
    }
    consts = (n, k, w, cfg.temperature, cfg.draft_temperature, cfg.alpha, cfg.truncation)
    consts += (job.draft_truncation, job.vocab, cfg.round_end)
    key = ("smc", span, consts, dcache.serial, dcache.prompt_window, tcache.prompt_window)

    def fn(x: Tensors) -> Tensors:
        out = _smc_rounds(job, x, 1, *_cache_forwards(job, tcache, dcache, span))
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

        out = _smc_rounds(job, flat, b, *_bank_forwards(job, banks, keep, span, prompt_windows))
        return {name: t if name == "ok" else t.view(b, n, *t.shape[1:]) for name, t in out.items()}

    return fn


def _smc_rounds(job: Job, x: Tensors, slots: int, draft: Forward, target: Forward) -> Tensors:
    """Steps 3a, 3b and 3d for ``slots`` requests' N particles each, rows slot-major:
    ``pending_d`` ``[S*N, w]``, ``pending_t`` ``[S*N, 1]``, ``host`` ``[S*N]`` (rows of
    the whole batch), ``u`` ``[K+1, S*N, 1]``; ``draft(feed, start)`` and ``target(block,
    start)`` are the models' static forwards. Outputs per row, and ``ok`` bool ``[S]``."""
    cfg, k = job.config, job.config.draft_tokens
    t_t, trunc = cfg.temperature, cfg.truncation
    drafted, draft_lp, bad = _draft_steps(job, x, slots, draft)
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


def _draft_steps(
    job: Job, x: Tensors, slots: int, draft: Forward
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


# ------------------------------------------------------------------------------- ar
def ar_round(job: Job, cache: KVCache, token: torch.Tensor) -> Generator[Round, Tensors, Tensors]:
    """Feed ``token`` (int64 ``[1, 1]`` on the device) to the target and draw the next one
    (tempered, truncated by top-k and min-p, a point mass when greedy) as one :class:`Round`,
    which the scheduler may run batched with other requests' ``ar`` rounds (:class:`Join`,
    :func:`ar_joined`); returns its outputs, still on the device: ``token`` int64 0-dim and
    ``ok`` (read them with :class:`HostCopy`). Raises ContextLengthError (the cache is full)
    before the round."""
    cfg, dev, vocab, target = job.config, job.device, job.vocab, job.target
    start = _claim(cache, 1)
    span = window(start + 1)
    inputs = {
        "token": token,
        "start": _scalar(start, dev),
        "u": draw_uniforms(1, job.generator, dev),
    }
    consts = (cfg.temperature, cfg.greedy, cfg.truncation, vocab)
    key = ("ar", span, *consts, cache.prompt_window)

    def fn(x: Tensors) -> Tensors:
        logits = target.decode_static(x["token"], cache, x["start"], span, last_only=True)
        nxt, ok = _ar_draw(job, logits[0, -1], x["u"])
        return {"token": nxt, "ok": ok}

    join = Join(("ar", *consts), ar_joined(job), span, (cache,))
    return (yield Round(target, cache, key, fn, inputs, join))


def ar_joined(job: Job):
    """The ``ar`` round of every slot of a bank at once (:class:`Join`): inputs ``token``
    ``[B, 1, 1]``, ``start`` ``[B]``, ``u`` ``[B, 1, 1]``, ``keep`` ``[B]``; outputs
    ``token`` int64 ``[B]`` and ``ok`` bool ``[B]``. Only the request's constants are
    taken from ``job`` (the join key names them)."""
    target = job.target

    def fn(banks, x: Tensors, span: int, prompt_windows: tuple[int]) -> Tensors:
        b = x["token"].shape[0]
        tokens = x["token"].view(b, 1)
        keep, p_window = x["keep"], prompt_windows[0]
        logits = target.decode_bank(tokens, banks[0], x["start"], keep, span, p_window, True)
        nxt, ok = _ar_draw(job, logits[:, -1], x["u"].view(b, 1))
        return {"token": nxt, "ok": ok}

    return fn


def _ar_draw(job: Job, logits: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ar``'s draw from the target's ``logits`` ``[..., V']`` with uniforms ``u``: the
    tokens int64 ``[...]`` and bool ``[...]`` (False: NaN logits or no mass)."""
    cfg = job.config
    lp = step_log_probs(logits[..., : job.vocab], cfg.temperature, False)
    lp = truncate_log_probs(lp, *cfg.truncation)
    if cfg.greedy:
        lp = point_mass_log_probs(lp)
    nxt, valid = categorical_from_uniforms(lp.exp(), u)
    return nxt, valid & ~nan_rows(lp)


class HostCopy:
    """A round's outputs on their way to the host while the device runs on.

    On CUDA the copies go into pinned host memory without blocking and an event marks their
    end: :meth:`get` waits for that event only, not for rounds launched after it (the host can
    launch round t+1 before it reads round t). Elsewhere the outputs are already there.

    Args:
        outputs: the round's tensors (what :class:`Round` is answered with).
    """

    def __init__(self, outputs: Tensors) -> None:
        self.event = None
        if any(t.is_cuda for t in outputs.values()):
            self.values = {
                name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
                    t, non_blocking=True
                )
                for name, t in outputs.items()
            }
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.values = outputs

    def get(self) -> Tensors:
        """The outputs on the host, once their copies are done."""
        if self.event is not None:
            self.event.synchronize()
        return self.values


# ------------------------------------------------------------------------------- sd
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
    d_start, t_start = _claim(dcache, w + k - 1), _claim(tcache, k + 1)
    span = window(max(d_start + w + k - 1, t_start + k + 1))
    inputs = {
        "pending_d": torch.tensor([pending_d], dtype=torch.long, device=dev),
        "pending_t": torch.full((1, 1), pending_t, dtype=torch.long, device=dev),
        "u_draft": draw_uniforms(k, generator, dev).view(k, 1, 1),  # as k draws of one
        "u_accept": torch.rand(k, generator=generator, device=dev).view(
            1, k
        ),  # speculative_verify's
        "u_next": draw_uniforms(1, generator, dev),
        "d_start": _scalar(d_start, dev),
        "t_start": _scalar(t_start, dev),
    }
    t_d = 0.0 if cfg.greedy else cfg.draft_temperature
    consts = (k, w, cfg.temperature, t_d, cfg.greedy, cfg.truncation, job.vocab)
    key = ("sd", span, consts, dcache.serial, dcache.prompt_window, tcache.prompt_window)

    def fn(x: Tensors) -> Tensors:
        out = _sd_rounds(job, x, *_cache_forwards(job, tcache, dcache, span))
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

        return _sd_rounds(job, flat, *_bank_forwards(job, banks, keep, span, prompt_windows))

    return fn


def _sd_probs(cfg: GenerationConfig, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """sd's sampling distributions of ``logits`` ``[..., V]``: tempered, truncated by the
    request's filters, a point mass when greedy (float32 probabilities)."""
    lp = truncate_log_probs(step_log_probs(logits, temperature, False), *cfg.truncation)
    return (point_mass_log_probs(lp) if cfg.greedy else lp).exp()


def _sd_drafts(
    job: Job, x: Tensors, draft: Forward
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


def _sd_rounds(job: Job, x: Tensors, draft: Forward, target: Forward) -> Tensors:
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
    """One round of multi-draft sd (:mod:`smcspec.decoding.sd.multi_draft`) as a :class:`Round`,
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
    d_start, t_start = _claim(dcache, w + k - 1), _claim(tcache, k + 1)
    span = window(max(d_start + w + k - 1, t_start + k + 1))
    inputs = {
        "pending_d": torch.tensor([pending_d] * n, dtype=torch.long, device=dev),
        "pending_t": torch.full((n, 1), pending_t, dtype=torch.long, device=dev),
        "u_draft": draw_uniforms(k * n, generator, dev).view(k, n, 1),  # k draws of n
        "u_accept": torch.rand(k * n, generator=generator, device=dev).view(1, k, n),
        "u_next": draw_uniforms(1, generator, dev),
        "d_start": _scalar(d_start, dev),
        "t_start": _scalar(t_start, dev),
    }
    consts = (n, k, w, cfg.temperature, cfg.draft_temperature, cfg.truncation, job.vocab)
    key = ("multi-sd", span, consts, dcache.serial, dcache.prompt_window, tcache.prompt_window)

    def fn(x: Tensors) -> Tensors:
        out = _multi_sd_rounds(job, x, 1, *_cache_forwards(job, tcache, dcache, span))
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
        forwards = _bank_forwards(job, banks, keep, span, prompt_windows)
        return _multi_sd_rounds(job, flat, b, *forwards)

    return fn


def _multi_sd_rounds(job: Job, x: Tensors, slots: int, draft: Forward, target: Forward) -> Tensors:
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
