"""Chunked prefill: the scheduler runs long prompts in pieces, a few each step.

A prompt's prefill is one forward over all its tokens. Run whole, a long prompt is one
scheduler step of many seconds on a CPU (a 3,000-token prompt held the default pair for a
minute on a 2-core machine), and the scheduler can do nothing else meanwhile: other requests
do not advance and a request whose client left cannot be dropped (it is cancelled between
steps). :class:`ChunkedPrefill` runs a prefill as chunks instead, each in a step of its own
with the other requests' forwards, as vLLM's and llama.cpp's servers do (``--enable-chunked-
prefill``, ``n_batch``).

Chunk size: at most ``max_tokens`` tokens; smaller where the model's measured prefill speed
(prompt tokens a second in its last chunk of at least :data:`MIN_CHUNK` tokens) says a chunk
of ``max_tokens`` would take longer than ``step_s``: then the largest power of two tokens it
runs in ``step_s`` (at least :data:`MIN_CHUNK`), so that a chunk takes about ``step_s`` on
any machine. A model not measured yet starts with :data:`PROBE_CHUNK` tokens. A step runs
chunks of the prompts waiting for one in turn, the least recently served first (a prompt
may get several), while the next chunk's expected time (its tokens at its model's measured
speed) keeps the step's prefill within ``step_s`` (the first chunk always runs): a step
stays short with many long prompts at once, and a fast model (a GPU) runs a long prompt in
few steps.

A prompt that fits in one chunk is prefilled exactly as before (one ``model.prefill``); a
chunked one's logits equal the whole prompt's up to float rounding (the same arithmetic,
grouped differently), so a seeded request's tokens can differ only where that rounding
decides a sample, as with batching.
"""

from __future__ import annotations

import time

import torch

from smcspec.decoding.program import Prefill, prefill_chunk
from smcspec.errors import ConfigError

MIN_CHUNK = 16  # prompt tokens: the smallest chunk a slow model is given
PROBE_CHUNK = 64  # prompt tokens: the first chunk of a model not measured yet


class ChunkedPrefill:
    """How prompts are prefilled in chunks (see the module notes).

    Args:
        max_tokens: the most prompt tokens one chunk runs (default 512, what vLLM and
            llama.cpp's physical batch use).
        step_s: seconds of prefill a scheduler step aims at (chunks shrink on a model
            slower than ``max_tokens / step_s`` tokens a second, and a step stops
            starting chunks once its prefills have run this long).
    Raises:
        ConfigError: ``max_tokens < 1`` or ``step_s <= 0``.
    """

    def __init__(self, max_tokens: int = 512, step_s: float = 1.0) -> None:
        if max_tokens < 1 or not step_s > 0:
            raise ConfigError(
                f"prefill chunks need max_tokens >= 1 and step_s > 0, got {max_tokens}, {step_s}"
            )
        self.max_tokens, self.step_s = max_tokens, step_s
        self._rates: dict[int, float] = {}  # id(model) -> prompt tokens/s, last chunk

    def chunk_size(self, model: object) -> int:
        """Prompt tokens the next chunk on ``model`` runs (before the prompt's end)."""
        rate = self._rates.get(id(model))
        if rate is None:
            return min(self.max_tokens, PROBE_CHUNK)
        fits = int(rate * self.step_s)
        if fits >= self.max_tokens:
            return self.max_tokens
        return min(self.max_tokens, max(MIN_CHUNK, 1 << max(fits.bit_length() - 1, 0)))

    def expected_s(self, step: Prefill) -> float:
        """Seconds the next chunk of ``step`` is expected to take (inf on a model not
        measured yet)."""
        rate = self._rates.get(id(step.model))
        tokens = min(step.remaining, self.chunk_size(step.model))
        return float("inf") if rate is None else tokens / rate

    def run(self, step: Prefill) -> tuple[torch.Tensor | None, int, float]:
        """Run the next chunk of ``step`` (:func:`~smcspec.decoding.program.prefill_chunk`)
        and measure its model's speed. Returns ``(logits or None, tokens run, seconds)``:
        logits ``[V]`` once the prompt is whole. Raises whatever the forward raises."""
        before, t0 = step.done, time.perf_counter()
        out = prefill_chunk(step, self.chunk_size(step.model))
        seconds = time.perf_counter() - t0
        tokens = step.done - before
        if tokens >= MIN_CHUNK or id(step.model) not in self._rates:
            self._rates[id(step.model)] = tokens / max(seconds, 1e-9)
        return out, tokens, seconds
