"""Static KV caches: particle caches at fixed addresses, for rounds captured as CUDA graphs.

A CUDA graph replays the kernels it recorded on the memory it recorded, so the caches a
captured round reads and writes must outlive the request and serve the next one at the same
addresses. :class:`StaticKVCache` is a :class:`~smcspec.backends.torch.kv_cache.ParticleKVCache`
whose prompt storage is preallocated too (``prefix_store_k/v``, ``[layers, 1, kv_heads,
prefix_capacity, head_dim]``); ``prefix_k/v`` are views of its first ``prompt_len``
positions, so every eager forward of the backend works on it unchanged. The static forward
(:meth:`~smcspec.backends.torch.transformer.Transformer.decode_static`) instead reads fixed
windows of both stores and hides what lies past the prompt and past each query's position
with masks built from device scalars (``prompt_len_t`` and the round's start), so that one
graph serves every prompt and suffix length up to its windows.

:class:`StaticSlots` keeps a model's static caches between requests: a request takes a free
slot of its row count that is large enough (sizes rounded up to powers of two, so that few
slots and few graphs serve many requests) and gives it back when its cache is closed.
Distinct rows (:mod:`smcspec.backends.shared_rows`) are off in a static cache: a captured
round computes every row.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from smcspec.backends.pool import Lease
from smcspec.backends.shared_rows import RowHistories
from smcspec.backends.torch.kv_cache import ParticleKVCache
from smcspec.errors import ContextLengthError

_SERIALS = itertools.count(1)  # a cache's identity in graph keys (ids of dead objects recur)

MIN_BUCKET = 64
"""Smallest capacity and attention window of a static cache (tokens)."""


def bucket(n: int, least: int = MIN_BUCKET) -> int:
    """The power of two ``>= max(n, least)``: static capacities and attention windows."""
    b = least
    while b < n:
        b *= 2
    return b


class StaticKVCache(ParticleKVCache):
    """A :class:`ParticleKVCache` whose tensors never move: prompt storage preallocated for
    ``prefix_capacity`` tokens, suffix for ``capacity`` per row, both zeroed once (masked
    positions must hold finite values: ``0 * inf`` would be NaN).

    ``prompt_len_t``: int64 0-dim device tensor holding the prompt length (what a captured
    forward reads). ``owner``: the :class:`StaticSlots` the cache returns to on
    :meth:`close`. ``serial``: unique in the process (graph keys name caches by it).
    ``graphs``: the captured rounds whose first cache this is (kept with it, so that they
    serve the next request that takes the slot and die with it); ``rounds_run`` counts the
    fused rounds run with it, captured or not. Raises
    :class:`ContextLengthError` from :meth:`begin_prefill` for a prompt longer than
    ``prefix_capacity``.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        rows: int,
        capacity: int,
        prefix_capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, rows, capacity, dtype, device, False)
        shape = (num_layers, 1, num_kv_heads, prefix_capacity, head_dim)
        self.prefix_store_k = torch.zeros(shape, dtype=dtype, device=device)
        self.prefix_store_v = torch.zeros(shape, dtype=dtype, device=device)
        self.prompt_len_t = torch.zeros((), dtype=torch.long, device=device)
        self.owner: StaticSlots | None = None
        self.in_use = False
        self.serial = next(_SERIALS)
        self.graphs: dict[tuple, Any] = {}
        self.rounds_run = 0  # fused rounds run with this cache first, over its life

    @property
    def prefix_capacity(self) -> int:
        return self.prefix_store_k.shape[3]

    @property
    def prompt_window(self) -> int:
        """Prompt positions a static forward attends: the prompt length's bucket."""
        return bucket(self.prompt_len)

    def begin_prefill(self, prompt_len: int) -> None:
        """Use the first ``prompt_len`` positions of the prompt storage (no allocation)."""
        if self.prefix_k is not None:
            raise RuntimeError("this cache already holds a prompt")
        if prompt_len > self.prefix_capacity:
            raise ContextLengthError(
                f"prompt of {prompt_len} tokens > static cache capacity {self.prefix_capacity}"
            )
        self.prefix_k = self.prefix_store_k[:, :, :, :prompt_len]
        self.prefix_v = self.prefix_store_v[:, :, :, :prompt_len]
        self.prompt_len_t.fill_(prompt_len)

    def reset(self) -> None:
        """Empty the cache for the next request (the stored values stay; they are masked)."""
        self.prefix_k = self.prefix_v = None
        self.length = self._pending = 0
        self.histories = RowHistories(self.rows, shared=False)

    def fits(self, rows: int, capacity: int, prompt_len: int) -> bool:
        """Whether a request of ``rows`` x ``capacity`` after ``prompt_len`` can use it."""
        return (
            rows == self.rows and capacity <= self.capacity and prompt_len <= self.prefix_capacity
        )

    def close(self) -> None:
        """Give the cache back to its slots for the next request."""
        if self.owner is not None:
            self.owner.give_back(self)


class StaticSlots:
    """A model's static caches, kept between requests (at most ``max_slots``).

    Args:
        make: ``(rows, capacity, prefix_capacity) -> StaticKVCache`` (the model's).
        max_slots: how many caches may exist at once; :meth:`take` returns None beyond it
            (the request then runs on an ordinary cache, step by step).
    """

    def __init__(self, make, max_slots: int = 8) -> None:
        self._make = make
        self.max_slots = max_slots
        self.slots: list[StaticKVCache] = []

    def take(
        self, rows: int, capacity: int, prompt_len: int, lease: Lease | None = None
    ) -> StaticKVCache | None:
        """A free cache for ``rows`` x ``capacity`` after ``prompt_len`` tokens, reset; a new
        one (sizes bucketed) when none fits and there is room, or in place of a free one when
        the slots are full (a graph of another cache that named the dropped one is never
        replayed again: serials are not reused); else None. ``lease``: accounting only (the
        request's reservation)."""
        free = [c for c in self.slots if not c.in_use]
        cache = next((c for c in free if c.fits(rows, capacity, prompt_len)), None)
        if cache is None:
            if len(self.slots) >= self.max_slots:
                if not free:
                    return None
                dropped = free.pop(0)
                self.slots.remove(dropped)  # its memory goes back before the new one's
                dropped.graphs.clear()
                del dropped
            cache = self._make(rows, bucket(capacity), bucket(prompt_len))
            cache.owner = self
            self.slots.append(cache)
        cache.reset()
        cache.in_use = True
        return cache

    def give_back(self, cache: StaticKVCache) -> None:
        """Mark ``cache`` free (its request ended)."""
        cache.in_use = False
