"""What every decoder's fused rounds share: rounds written as single functions of device tensors.

The decoders run a round step by step: each forward is a
:class:`~smcspec.decoding.program.Forward` request and the sampling between forwards runs on
the host side of the generator, reading tokens back (distinct rows need them; so do
constraints). On a GPU that round trip after every draft step, and eager PyTorch's launches,
cost more than the forwards. Each decoder therefore also writes its round as one function of
device tensors, yielded as a :class:`~smcspec.decoding.program.Round` that the torch backend
runs captured as a CUDA graph (:mod:`smcspec.backends.torch.graphs`): its fused body,
beside its program (:mod:`smcspec.decoding.ar.fused`, :mod:`smcspec.decoding.sd.fused`,
:mod:`smcspec.decoding.smc.fused`). This module holds what those bodies share: whether a
request runs fused (:func:`fused_rounds`, :func:`plain`, :func:`is_static`), a round's suffix
window and positions (:func:`window`, :func:`claim`), its static forwards on one request's
caches or a bank's (:func:`cache_forwards`, :func:`bank_forwards`) and the read of its
``ok`` flag (:func:`check_ok`, :func:`read_checked`).

Random numbers: a round's uniforms are drawn from the request's generator before the round,
in the order the step-by-step round draws them (one float64 per row per sampled token; sd's
acceptance test float32 per drafted token), and enter the round as an input. No generator
runs inside a graph, and on a CPU generator (where ``k`` draws of ``n`` equal one draw of
``k * n``) a fused round draws exactly what the step-by-step round draws: the same tokens,
weights and resampling for a seed (``tests/test_fused_rounds.py``). Errors that the
step-by-step round raises at once (NaN logits, a distribution with no mass) come back as an
``ok`` flag, read with the round's outputs and raised then.

Each round also carries a :class:`~smcspec.decoding.program.Join`: the same body over the
rows of every slot of a bank of static caches (``ar_joined``, ``sd_joined``,
``multi_sd_joined``, ``smc_joined``), which the scheduler runs as one call for the rounds of
concurrent requests of one kind (``docs/architecture.md``, "Where a round runs").

Fused rounds run where every model of the request runs rounds fused
(:func:`fused_rounds`), its caches are static, and the request needs no host work inside a
round (:func:`plain`: no constraint, no reward, no top-p, whose cut has a data-dependent
shape, no log-probabilities asked for; sd also no ``draft_p_min`` gate and only full K-token
rounds). Everything else runs step by step, as on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from smcspec.backends.base import DecoderModel, KVCache
from smcspec.config import GenerationConfig
from smcspec.decoding.job import Job
from smcspec.errors import NumericalError

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


def claim(cache: KVCache, tokens: int) -> int:
    """Account for ``tokens`` positions the round writes on every row; returns the start.
    Raises ContextLengthError (before the round runs) when they do not fit."""
    start = cache.begin_step(tokens)
    cache.end_step()
    return start


def scalar(value: int, dev: torch.device) -> torch.Tensor:
    """``value`` as an int64 0-dim tensor on ``dev`` (a round's start position)."""
    return torch.full((), value, dtype=torch.long, device=dev)


StaticForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A model's static forward inside a round: ``(tokens, start) -> logits``."""


def cache_forwards(
    job: Job, tcache: KVCache, dcache: KVCache, span: int
) -> tuple[StaticForward, StaticForward]:
    """A round's static forwards on one request's caches: ``draft(feed, start)`` (the last
    position's logits) and ``target(block, start)``, attending ``span`` suffix positions."""

    def draft(feed: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return job.draft.decode_static(feed, dcache, start, span, last_only=True)

    def target(block: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return job.target.decode_static(block, tcache, start, span)

    return draft, target


def bank_forwards(
    job: Job, banks: tuple, keep: torch.Tensor, span: int, prompt_windows: tuple[int, int]
) -> tuple[StaticForward, StaticForward]:
    """:func:`cache_forwards` over every slot of the target's and the draft's banks
    (``banks``, ``prompt_windows``: target first), the slots outside ``keep`` padded."""
    (tbank, dbank), (t_window, d_window) = banks, prompt_windows

    def draft(feed: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return job.draft.decode_bank(feed, dbank, start, keep, span, d_window, True)

    def target(block: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return job.target.decode_bank(block, tbank, start, keep, span, t_window)

    return draft, target
