"""The KV caches a decoder's program opens, and how they are given back.

Every program opens the caches its decoder lists (``caches(cfg, prompt_len)``, a
:class:`~smcspec.backends.pool.CacheNeed` each) on the request's reservation and closes them
however the program ends (:func:`run_on_caches`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import replace
from typing import Any

from smcspec.backends.base import DecoderModel, KVCache
from smcspec.backends.pool import CacheNeed, Reservation


def cache_capacity(max_new_tokens: int, draft_tokens: int) -> int:
    """Generated-token KV capacity for a request (one round may overshoot the budget)."""
    return max_new_tokens + draft_tokens + 2


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
            slot = next((c.slot for c in caches if getattr(c, "slot", None) is not None), None)
            if need.static and slot is not None:  # the same slot in every bank: rounds join
                extra["slot"] = slot
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


def close_caches(caches: list[KVCache]) -> None:
    """Give back what each cache reserved itself (nothing for caches made on a lease)."""
    for cache in caches:
        cache.close()
