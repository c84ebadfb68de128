"""Decoders as programs: generators that yield the forwards they need.

A decoder is written once as a generator that yields :class:`Prefill` and :class:`Forward`
requests and receives their logits, or, where the backend runs whole rounds on its device,
:class:`Round` requests answered with the round's outputs. :func:`run_program` executes one
program alone (the CLI and ``Engine.generate``); a scheduler can instead gather the pending
forwards of many programs and execute them as one batched forward per model
(:meth:`~smcspec.backends.base.DecoderModel.decode_batch`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from smcspec.backends.base import DecoderModel, KVCache
from smcspec.decoding.logprobs import TokenLogprobs, prompt_logprobs
from smcspec.decoding.output import DecodeOutput, as_prompt_tensor

if TYPE_CHECKING:
    from smcspec.decoding.job import Job

ALL_LOGITS_CHUNK = 64
"""Prompt tokens per forward of a prefill that keeps every position's logits
(:attr:`Prefill.prompt_top`): ``64 x V`` float32 logits at a time (39 MB at Qwen2.5's
151,936 tokens) instead of the whole prompt's."""


@dataclass
class Prefill:
    """Run ``prompt`` (int64 ``[P]``) into ``cache``; answered with logits ``[V]``.

    A scheduler may run it in chunks between other work (:func:`prefill_chunk`); ``done``
    counts the prompt tokens already in the cache. With ``prompt_top`` (not None) the
    prefill also gives the prompt's raw log-probabilities with that many alternatives each
    (:func:`~smcspec.decoding.logprobs.prompt_logprobs`, prompt tokens 1 .. P-1), gathered in
    ``logprobs`` chunk by chunk, over the logits' first ``vocab`` entries (0: all)."""

    model: DecoderModel
    prompt: torch.Tensor
    cache: KVCache
    done: int = 0
    prompt_top: int | None = None
    logprobs: TokenLogprobs | None = None
    vocab: int = 0

    @property
    def remaining(self) -> int:
        """Prompt tokens not yet in the cache."""
        return int(self.prompt.shape[-1]) - self.done


def target_prefill(
    job: Job, cache: KVCache
) -> Generator[Prefill, torch.Tensor, tuple[torch.Tensor, TokenLogprobs | None]]:
    """Prefill ``job``'s prompt on its target; returns the logits ``[V]`` after it and, where
    the request asks for them (``config.prompt_logprobs``, with ``config.logprobs or 0``
    alternatives over the pair's vocabulary), the prompt's log-probabilities, which
    ``job.on_prompt_logprobs`` is also given at once (a stream's echo)."""
    cfg = job.config
    top = (cfg.logprobs or 0) if cfg.prompt_logprobs else None
    prompt = as_prompt_tensor(job.ids, job.target.device)
    step = Prefill(job.target, prompt, cache, prompt_top=top, vocab=job.vocab)
    logits = yield step
    if step.logprobs is not None and job.on_prompt_logprobs is not None:
        job.on_prompt_logprobs(step.logprobs)
    return logits, step.logprobs


@dataclass
class Forward:
    """Append ``tokens`` (int64 ``[R, T]``) to ``cache``; answered with logits ``[R, T|1, V]``."""

    model: DecoderModel
    tokens: torch.Tensor
    cache: KVCache
    last_only: bool = False


@dataclass
class Join:
    """How a :class:`Round` may run together with the rounds of other requests as one
    batched call (``model.run_joined``: the torch backend, whose static caches of one shape
    share a bank of slots).

    ``caches``: the caches the round runs on (the target's first). Rounds whose ``key`` is
    equal (it names every constant ``fn`` depends on) and whose caches lie in the same banks,
    at the same slot in each (``model.joinable``), run as ``fn(banks, inputs,
    suffix_window, prompt_windows) -> outputs``: each input is the members'
    :attr:`Round.inputs` stacked along a new first dimension, one entry per slot (zeros for
    slots no member holds), plus ``keep`` (bool ``[slots]``, True for a member's slot); row
    ``b`` of each output belongs to slot ``b``. ``suffix_window``: the suffix positions this
    round attends (the call takes the members' largest); ``prompt_windows``: per bank, the
    members' largest."""

    key: tuple
    fn: Callable
    suffix_window: int
    caches: tuple[KVCache, ...]


@dataclass
class Round:
    """A whole round as one function of device tensors, ``fn(inputs) -> outputs`` (dicts of
    tensors; no host read inside, its random numbers among the inputs), on static caches;
    answered with ``outputs``. The backend runs it fused, captured as a CUDA graph where it
    can (``model.run_round``; the torch backend on CUDA), and keeps that graph with
    ``cache`` under ``key``, which names every shape and constant ``fn`` depends on.
    Decoders yield one only where :func:`smcspec.decoding.fused.fused_rounds` says the
    models run rounds fused; elsewhere the same round is a sequence of :class:`Forward`
    requests with host work between them. ``join``: how it may run batched with other
    requests' rounds (:func:`execute_rounds`); None: always alone."""

    model: DecoderModel
    cache: KVCache
    key: tuple
    fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    inputs: dict[str, torch.Tensor]
    join: Join | None = None


Step = Prefill | Forward | Round
Program = Generator[Step, torch.Tensor, DecodeOutput]


def execute(step: Step):
    """Run one step on its own: logits for a prefill or forward, the outputs of a round."""
    if isinstance(step, Prefill):
        if step.prompt_top is not None:
            return prefill_chunk(step, step.remaining)
        return step.model.prefill(step.prompt, step.cache)
    if isinstance(step, Round):
        return step.model.run_round(step.cache, step.key, step.fn, step.inputs)
    return step.model.decode(step.tokens, step.cache, step.last_only)


def prefill_chunk(step: Prefill, tokens: int) -> torch.Tensor | None:
    """Run the next ``tokens`` (at least 1) of ``step``'s prompt into its cache
    (``model.prefill`` with ``start``/``end``) and count them in ``step.done``. Returns the
    logits ``[V]`` once the whole prompt is in, None while tokens remain. A prompt that fits
    in one chunk is one plain ``model.prefill(prompt, cache)``, as :func:`execute` runs it."""
    n = int(step.prompt.shape[-1])
    end = min(n, step.done + max(1, tokens))
    if step.prompt_top is not None:
        return _prefill_all_logits(step, end)
    if step.done == 0 and end == n:
        out = step.model.prefill(step.prompt, step.cache)
    else:
        out = step.model.prefill(step.prompt, step.cache, step.done, end)
    step.done = end
    return out if end == n else None


def _prefill_all_logits(step: Prefill, end: int) -> torch.Tensor | None:
    """:func:`prefill_chunk` up to ``end`` keeping every position's logits, in pieces of at
    most :data:`ALL_LOGITS_CHUNK` tokens, each reduced at once to the log-probabilities of
    the prompt tokens it predicts (into ``step.logprobs``)."""
    n = int(step.prompt.shape[-1])
    if step.logprobs is None:
        step.logprobs = TokenLogprobs()
    last = None
    while step.done < end:
        stop = min(end, step.done + ALL_LOGITS_CHUNK)
        logits = step.model.prefill(step.prompt, step.cache, step.done, stop, all_logits=True)
        logits = logits[:, : step.vocab] if step.vocab else logits
        targets = step.prompt[step.done + 1 : stop + 1]  # the tokens these rows predict
        step.logprobs.extend(prompt_logprobs(logits[: len(targets)], targets, step.prompt_top))
        step.done, last = stop, logits[-1]
    return last if end == n else None


def execute_rounds(rounds: list[Round]) -> list[dict[str, torch.Tensor] | Exception]:
    """Run the pending rounds of several requests: those that may join (same model and
    :attr:`Join.key`, caches where ``model.joinable`` puts them together, at least two) as
    one batched call each, the others alone. Returns each round's outputs, or the exception
    that failed it (a joined call that raises fails its members only)."""
    results: list[dict[str, torch.Tensor] | Exception | None] = [None] * len(rounds)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rounds):
        joinable = getattr(r.model, "joinable", None)  # backends that run rounds batched
        place = joinable(r.join) if r.join is not None and joinable is not None else None
        if place is not None:
            groups.setdefault((id(r.model), r.join.key, place), []).append(i)
    joins = [g for g in groups.values() if len(g) > 1]
    joined_rounds = {i for g in joins for i in g}
    for i in (i for i in range(len(rounds)) if i not in joined_rounds):
        try:
            results[i] = execute(rounds[i])
        except Exception as exc:
            results[i] = exc
    for members in joins:
        joined = [rounds[i] for i in members]
        try:
            outs: list = joined[0].model.run_joined([(r.join, r.inputs) for r in joined])
        except Exception as exc:
            outs = [exc] * len(members)
        for i, out in zip(members, outs, strict=True):
            results[i] = out
    return results  # type: ignore[return-value]


def run_program(program: Program) -> DecodeOutput:
    """Drive ``program`` to completion, one forward at a time; returns its output."""
    try:
        step = next(program)
        while True:
            step = program.send(execute(step))
    except StopIteration as done:
        return done.value
