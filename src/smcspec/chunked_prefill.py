"""Chunked prefill: the scheduler runs long prompts in pieces, a few each step.

A prompt's prefill is one forward over all its tokens. Run whole, a long prompt is one
scheduler step of many seconds on a CPU (a 3,000-token prompt held the default pair for a
minute on a 2-core machine), and the scheduler can do nothing else meanwhile: other requests
do not advance and a request whose client left cannot be dropped (it is cancelled between
steps). :class:`ChunkedPrefill` runs a prefill as chunks instead, each in a step of its own
with the other requests' forwards, as vLLM's and llama.cpp's servers do (``--enable-chunked-
prefill``, ``n_batch``).

Chunks: a prompt is cut every ``max_tokens`` tokens, always at the same places, whatever
the model's speed, the machine's load or the other requests, so that its logits do not
depend on timing and a seeded request draws the same first token alone or beside others, on
this server or a fresh one (on llama.cpp, for a prompt longer than one chunk, where its
chunks' KV cells fall in the shared cache still counts: ``docs/usage/server.md``,
Reproducibility). Issue 87: the chunk size once followed the speed just measured, so that
the first prompt of a fresh server ran whole (64 tokens at most) and later ones in pieces of
16 on a slow machine; llama.cpp's logits of the real pair's 37-token chat prompt differed by
up to 0.45 between the two, and at temperature 2 the first token with them.

The measured speed (prompt tokens a second in the model's last chunk of at least
:data:`MIN_MEASURED` tokens) decides only how many chunks a step runs: a step runs chunks of
the prompts waiting for one in turn, the least recently served first (a prompt may get
several), while the next chunk's expected time keeps the step's prefill within ``step_s``
(the first chunk always runs, so a step lasts at least one chunk: lower ``max_tokens`` for
shorter steps on a slow model). A fast model (a GPU) runs a long prompt in few steps.

A prompt within one chunk is prefilled exactly as before (one ``model.prefill``); a chunked
one's logits equal the whole prompt's up to float rounding (the same arithmetic, grouped
differently).
"""

from __future__ import annotations

import time

import torch

from smcspec.decoding.program import Prefill, prefill_chunk
from smcspec.errors import ConfigError

MIN_MEASURED = 16  # prompt tokens: a shorter chunk (a prompt's tail) measures overheads


CPU_CHUNK = 128
"""The default chunk on a CPU: the default pair's target prefilled 97 tokens/s in chunks of
128 against 71 in chunks of 512 on a 2-core AMD EPYC VM (llama.cpp, 2 threads, idle; 32:
85, 64: 95, 256: 82), and a step of one chunk then takes about 1.3 s instead of 5-7 s."""

GPU_CHUNK = 512
"""The default chunk on a GPU (and other accelerators): what vLLM's and llama.cpp's
physical batch use; a forward's rows are nearly free there up to hundreds of tokens."""


def default_chunk(device: object) -> int:
    """:data:`CPU_CHUNK` for a model on the CPU, else :data:`GPU_CHUNK` (``device``: a torch
    device or its name). The chunk is fixed per server: every prompt is cut at the same
    places, whatever the timing."""
    return CPU_CHUNK if str(device) == "cpu" else GPU_CHUNK


class ChunkedPrefill:
    """How prompts are prefilled in chunks (see the module notes).

    Args:
        max_tokens: the chunk: prompts are cut every ``max_tokens`` tokens (default 512,
            what vLLM and llama.cpp's physical batch use).
        step_s: seconds of prefill a scheduler step aims at (a step stops starting chunks
            once its prefills are expected to run longer).
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

    def next_chunk(self, step: Prefill) -> int:
        """Prompt tokens the next chunk of ``step`` runs: up to the next multiple of
        ``max_tokens``, or the prompt's end (the cuts depend on nothing else)."""
        return min(step.remaining, self.max_tokens - step.done % self.max_tokens)

    def expected_s(self, step: Prefill) -> float:
        """Seconds the next chunk of ``step`` is expected to take at its model's last
        measured speed (inf on a model not measured yet)."""
        rate = self._rates.get(id(step.model))
        return float("inf") if rate is None else self.next_chunk(step) / rate

    def run(self, step: Prefill) -> tuple[torch.Tensor | None, int, float]:
        """Run the next chunk of ``step`` (:func:`~smcspec.decoding.program.prefill_chunk`)
        and measure its model's speed. Returns ``(logits or None, tokens run, seconds)``:
        logits ``[V]`` once the prompt is whole. Raises whatever the forward raises."""
        before, t0 = step.done, time.perf_counter()
        out = prefill_chunk(step, self.next_chunk(step))
        seconds = time.perf_counter() - t0
        tokens = step.done - before
        if tokens >= MIN_MEASURED or id(step.model) not in self._rates:
            self._rates[id(step.model)] = tokens / max(seconds, 1e-9)
        return out, tokens, seconds
