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

import torch

from smcspec.backends.base import DecoderModel, KVCache
from smcspec.decoding.output import DecodeOutput


@dataclass
class Prefill:
    """Run ``prompt`` (int64 ``[P]``) into ``cache``; answered with logits ``[V]``.

    A scheduler may run it in chunks between other work (:func:`prefill_chunk`); ``done``
    counts the prompt tokens already in the cache."""

    model: DecoderModel
    prompt: torch.Tensor
    cache: KVCache
    done: int = 0

    @property
    def remaining(self) -> int:
        """Prompt tokens not yet in the cache."""
        return int(self.prompt.shape[-1]) - self.done


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
    if step.done == 0 and end == n:
        out = step.model.prefill(step.prompt, step.cache)
    else:
        out = step.model.prefill(step.prompt, step.cache, step.done, end)
    step.done = end
    return out if end == n else None


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
