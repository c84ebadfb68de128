"""Decoders as programs: generators that yield the forwards they need.

A decoder is written once as a generator that yields :class:`Prefill` and :class:`Forward`
requests and receives their logits. :func:`run_program` executes one program alone (the
CLI and ``Engine.generate``); a scheduler can instead gather the pending forwards of many
programs and execute them as one batched forward per model
(:meth:`~smcspec.backends.base.DecoderModel.decode_batch`).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

from smcspec.backends.base import DecoderModel, KVCache
from smcspec.decoding.common import DecodeOutput


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


Step = Prefill | Forward
Program = Generator[Step, torch.Tensor, DecodeOutput]


def execute(step: Step) -> torch.Tensor:
    """Run one step on its own."""
    if isinstance(step, Prefill):
        return step.model.prefill(step.prompt, step.cache)
    return step.model.decode(step.tokens, step.cache, step.last_only)


def run_program(program: Program) -> DecodeOutput:
    """Drive ``program`` to completion, one forward at a time; returns its output."""
    try:
        step = next(program)
        while True:
            step = program.send(execute(step))
    except StopIteration as done:
        return done.value
