"""The ``ar`` round as one function of device tensors (:mod:`smcspec.decoding.fused`).

* :func:`ar_round`: one target forward and the next token's draw; the ar decoder launches
  the next round before it reads this one's token (:class:`HostCopy`).
* :func:`ar_joined`: the same over every slot of a bank (the scheduler's joined rounds).
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from smcspec.backends.base import KVCache
from smcspec.decoding.fused import Tensors, claim, scalar, window
from smcspec.decoding.job import Job
from smcspec.decoding.program import Join, Round
from smcspec.sampling.distributions import (
    categorical_from_uniforms,
    draw_uniforms,
    nan_rows,
    point_mass_log_probs,
    step_log_probs,
)
from smcspec.sampling.truncation import truncate_log_probs


def ar_round(job: Job, cache: KVCache, token: torch.Tensor) -> Generator[Round, Tensors, Tensors]:
    """Feed ``token`` (int64 ``[1, 1]`` on the device) to the target and draw the next one
    (tempered, truncated by top-k and min-p, a point mass when greedy) as one :class:`Round`,
    which the scheduler may run batched with other requests' ``ar`` rounds (:class:`Join`,
    :func:`ar_joined`); returns its outputs, still on the device: ``token`` int64 0-dim and
    ``ok`` (read them with :class:`HostCopy`). Raises ContextLengthError (the cache is full)
    before the round."""
    cfg, dev, vocab, target = job.config, job.device, job.vocab, job.target
    start = claim(cache, 1)
    span = window(start + 1)
    inputs = {
        "token": token,
        "start": scalar(start, dev),
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
