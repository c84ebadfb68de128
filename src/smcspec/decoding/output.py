"""What decoders take and give: prompts as tensors, streamed tokens, their outputs.

A decoder streams the tokens it has made final through a :data:`TokenCallback` and returns a
:class:`DecodeOutput` (its tokens, its typed stats, and with SMC-SD its particles).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from smcspec.decoding.logprobs import TokenLogprobs

TokenCallback = Callable[[list[int]], None]
"""Called with token ids as soon as they are final (they will be in the output)."""

LogprobCallback = Callable[["TokenLogprobs"], None]
"""Called with the log-probabilities of one final token, just before the
:data:`TokenCallback` that streams it (requests that ask for logprobs)."""


@dataclass
class ParticleOutput:
    """One SMC particle at the end of decoding."""

    tokens: list[int]
    weight: float  # normalised importance weight


@dataclass
class DecodeOutput:
    """What a decoder returns: the new tokens and its statistics (its own typed record,
    :mod:`smcspec.decoding.decoder_stats`); with ``cfg.logprobs`` the tokens'
    log-probabilities (:class:`~smcspec.decoding.logprobs.TokenLogprobs`, one per token),
    with ``cfg.prompt_logprobs`` the prompt's (prompt tokens 1 .. P-1)."""

    tokens: list[int]
    stats: Any
    particles: list[ParticleOutput] | None = None
    log_normalizer: float | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None


def cut_at_stop(tokens: list[int], stop_ids: frozenset[int]) -> tuple[list[int], bool]:
    """Keep tokens up to and including the first stop token; returns ``(kept, stopped)``."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1], True
    return tokens, False


def hit_token_cap(token_ids: list[int], max_new_tokens: int, stop_ids: Collection[int]) -> bool:
    """Whether an answer was cut by the new-token budget rather than ending on its own.

    The rule: the answer has ``max_new_tokens`` tokens (or more) *and* its last token is not a
    stop token (EOS or the chat template's end of turn; decoders keep the stop token that
    ended an answer). An answer whose stop token is exactly the last allowed token ended on
    its own and is not counted. With EOS ignored (``stop_ids`` empty) every answer of full
    length counts as capped.
    """
    return len(token_ids) >= max_new_tokens and not (token_ids and token_ids[-1] in stop_ids)


def as_prompt_tensor(prompt: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Token ids as a 1-D ``torch.long`` tensor ``[P]`` on ``device``."""
    return torch.as_tensor(prompt, dtype=torch.long, device=device).view(-1)
