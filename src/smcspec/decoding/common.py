"""Types and helpers shared by the decoders."""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass, replace
from typing import Any

import torch

from smcspec.backends.base import DecoderModel, KVCache
from smcspec.backends.pool import CacheNeed, Reservation

TokenCallback = Callable[[list[int]], None]
"""Called with token ids as soon as they are final (they will be in the output)."""


@dataclass
class ParticleOutput:
    """One SMC particle at the end of decoding."""

    tokens: list[int]
    weight: float  # normalised importance weight


@dataclass
class DecodeOutput:
    """What a decoder returns: the new tokens and its statistics (its own typed record,
    :mod:`smcspec.decoding.stats`)."""

    tokens: list[int]
    stats: Any
    particles: list[ParticleOutput] | None = None
    log_normalizer: float | None = None


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


def cache_capacity(max_new_tokens: int, draft_tokens: int) -> int:
    """Generated-token KV capacity for a request (one round may overshoot the budget)."""
    return max_new_tokens + draft_tokens + 2


def as_prompt_tensor(prompt: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Token ids as a 1-D ``torch.long`` tensor ``[P]`` on ``device``."""
    return torch.as_tensor(prompt, dtype=torch.long, device=device).view(-1)


def open_caches(
    needs: list[CacheNeed], models: dict[str, DecoderModel], reservation: Reservation | None
) -> list[KVCache]:
    """The caches ``needs`` lists, in order, drawing on ``reservation`` (a request admitted
    by the scheduler, or :meth:`Engine.generate`); without one each cache reserves its own
    (closed by :func:`close_caches`)."""
    caches: list[KVCache] = []
    try:
        for need in needs:
            lease = reservation.lease(need.role) if reservation is not None else None
            model = models[need.role]
            extra = {"static": True, "prompt_len": need.prompt_len} if need.static else {}
            caches.append(
                model.new_cache(
                    need.rows, need.capacity, lease=lease, shared_rows=need.shared_rows, **extra
                )
            )
    except BaseException:
        close_caches(caches)
        raise
    return caches


def with_caches(
    needs: list[CacheNeed],
    models: dict[str, DecoderModel],
    reservation: Reservation | None,
    body: Callable[..., Generator],
) -> Generator:
    """Open the caches of ``needs`` (:func:`open_caches`), run the program ``body(*caches)``
    and close them however it ends (completion, error, or the program being closed)."""
    caches = open_caches(needs, models, reservation)
    try:
        return (yield from body(*caches))
    finally:
        close_caches(caches)


def run_on_caches(
    job: Any, needs: list[CacheNeed], body: Callable[..., Generator], fused: bool = False
) -> Generator:
    """Every decoder's program: open the caches of ``needs`` on ``job``'s models and
    reservation (static caches, at fixed addresses, where ``fused``: the decoder's rounds run
    fused, :mod:`smcspec.decoding.fused`) and run ``body(job, *caches)``; the caches close
    however it ends."""
    if fused:
        needs = [replace(n, static=True, shared_rows=False) for n in needs]
    return (yield from with_caches(needs, job.models, job.reservation, lambda *c: body(job, *c)))


def distinct_row_stats(**caches: KVCache) -> dict[str, float]:
    """``distinct_rows_<role>``: the rows each cache's forwards computed over the rows they
    were fed (:mod:`smcspec.backends.shared_rows`), 1.0 for a cache never fed."""
    out = {}
    for role, cache in caches.items():
        h = cache.histories
        out[f"distinct_rows_{role}"] = h.computed / h.fed if h.fed else 1.0
    return out


def close_caches(caches: list[KVCache]) -> None:
    """Give back what each cache reserved itself (nothing for caches made on a lease)."""
    for cache in caches:
        cache.close()
