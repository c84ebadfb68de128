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
    """Run ``prompt`` (int64 ``[P]``) into ``cache``; answered with logits ``[V]``."""

    model: DecoderModel
    prompt: torch.Tensor
    cache: KVCache


@dataclass
class Forward:
    """Append ``tokens`` (int64 ``[R, T]``) to ``cache``; answered with logits ``[R, T|1, V]``."""

    model: DecoderModel
    tokens: torch.Tensor
    cache: KVCache
    last_only: bool = False


@dataclass
class Round:
    """A whole round as one function of device tensors, ``fn(inputs) -> outputs`` (dicts of
    tensors; no host read inside, its random numbers among the inputs), on static caches;
    answered with ``outputs``. The backend runs it fused, captured as a CUDA graph where it
    can (``model.run_round``; the torch backend on CUDA), and keeps that graph with
    ``cache`` under ``key``, which names every shape and constant ``fn`` depends on.
    Decoders yield one only where :func:`smcspec.decoding.fused.fused_rounds` says the
    models run rounds fused; elsewhere the same round is a sequence of :class:`Forward`
    requests with host work between them."""

    model: DecoderModel
    cache: KVCache
    key: tuple
    fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    inputs: dict[str, torch.Tensor]


Step = Prefill | Forward | Round
Program = Generator[Step, torch.Tensor, DecodeOutput]


def execute(step: Step):
    """Run one step on its own: logits for a prefill or forward, the outputs of a round."""
    if isinstance(step, Prefill):
        return step.model.prefill(step.prompt, step.cache)
    if isinstance(step, Round):
        return step.model.run_round(step.cache, step.key, step.fn, step.inputs)
    return step.model.decode(step.tokens, step.cache, step.last_only)


def run_program(program: Program) -> DecodeOutput:
    """Drive ``program`` to completion, one forward at a time; returns its output."""
    try:
        step = next(program)
        while True:
            step = program.send(execute(step))
    except StopIteration as done:
        return done.value
