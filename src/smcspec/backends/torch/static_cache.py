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

Caches of one shape (rows, capacity, prompt capacity) live in one :class:`SlotBank`: each is
a view of one slot of the bank's tensors (suffix ``[layers, slots * rows, ...]``, prompt
``[layers, slots, ...]``, prompt lengths ``[slots]``). A request's round runs on its own
cache's views; the rounds of several requests whose caches share a bank run as one batched
forward over the whole bank (:meth:`~smcspec.backends.torch.transformer.Transformer.
decode_bank`), which reads every weight once for all of them.

:class:`StaticSlots` keeps a model's banks between requests: a request takes a free slot of
its row count that is large enough (sizes rounded up to powers of two, so that few banks and
few graphs serve many requests) and gives it back when its cache is closed. A bank with no
free slot doubles (its tensors are copied and every cache's views moved; the graphs that
read the old tensors are dropped and its caches get new serials, so no key names them
again). Distinct rows (:mod:`smcspec.backends.shared_rows`) are off in a static cache: a
captured round computes every row.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from smcspec.backends.pool import Lease
from smcspec.backends.shared_rows import RowHistories
from smcspec.backends.torch.kv_cache import ParticleKVCache
from smcspec.errors import ContextLengthError

_SERIALS = itertools.count(1)  # identities in graph keys (ids of dead objects recur)

MIN_BUCKET = 64
"""Smallest capacity and attention window of a static cache (tokens)."""


def bucket(n: int, least: int = MIN_BUCKET) -> int:
    """The power of two ``>= max(n, least)``: static capacities and attention windows."""
    b = least
    while b < n:
        b *= 2
    return b


class SlotBank:
    """The storage of ``slots`` static caches of one shape, zeroed once (masked positions must
    hold finite values: ``0 * inf`` would be NaN).

    ``suffix_k/v``: ``[layers, slots * rows, kv_heads, capacity, head_dim]`` (slot ``b``
    owns rows ``b * rows .. (b + 1) * rows - 1``); ``prefix_k/v``: ``[layers, slots,
    kv_heads, prefix_capacity, head_dim]``; ``prompt_len_t``: int64 ``[slots]`` on the
    device. ``caches``: one :class:`StaticKVCache` per slot (views); ``graphs``: the batched
    rounds captured over the whole bank; ``serial``: unique in the process.
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
        self.rows = rows
        self._dims = (num_layers, num_kv_heads, capacity, prefix_capacity, head_dim)
        self._kind = dict(dtype=dtype, device=device)
        self.caches: list[StaticKVCache] = []
        self.graphs: dict[tuple, Any] = {}
        self.serial = next(_SERIALS)
        self._allocate(1)
        self.caches.append(StaticKVCache(self, 0))

    @property
    def slots(self) -> int:
        return self.prompt_len_t.shape[0]

    @property
    def capacity(self) -> int:
        return self._dims[2]

    @property
    def prefix_capacity(self) -> int:
        return self._dims[3]

    @property
    def device(self) -> torch.device:
        return self.suffix_k.device

    def _allocate(self, slots: int) -> None:
        layers, heads, cap, pcap, dim = self._dims
        suffix = (layers, slots * self.rows, heads, cap, dim)
        prefix = (layers, slots, heads, pcap, dim)
        self.suffix_k = torch.zeros(suffix, **self._kind)
        self.suffix_v = torch.zeros(suffix, **self._kind)
        self.prefix_k = torch.zeros(prefix, **self._kind)
        self.prefix_v = torch.zeros(prefix, **self._kind)
        self.prompt_len_t = torch.zeros(slots, dtype=torch.long, device=self._kind["device"])

    def grow(self, slots: int) -> None:
        """Make room for ``slots`` caches (``>= self.slots``): the stored values are copied,
        every cache's views moved to the new tensors, and every graph that read the old ones
        dropped (the bank's caches get new serials: no key names them again)."""
        n = self.slots
        old = (self.suffix_k, self.suffix_v, self.prefix_k, self.prefix_v)
        lengths = self.prompt_len_t
        self._allocate(slots)
        for new, was in zip(
            (self.suffix_k, self.suffix_v, self.prefix_k, self.prefix_v), old, strict=True
        ):
            new[:, : was.shape[1]] = was
        self.prompt_len_t[:n] = lengths
        del old, lengths
        self.graphs.clear()
        self.serial = next(_SERIALS)
        for cache in self.caches:
            cache.attach()
        self.caches += [StaticKVCache(self, b) for b in range(n, slots)]

    def drop_graphs(self) -> None:
        """Drop every graph captured on this bank: its batched rounds and its caches'."""
        self.graphs.clear()
        for cache in self.caches:
            cache.graphs.clear()

    def free(self) -> list[StaticKVCache]:
        """The caches no request holds."""
        return [c for c in self.caches if not c.in_use]

    def fits(self, rows: int, capacity: int, prompt_len: int) -> bool:
        """Whether a request of ``rows`` x ``capacity`` after ``prompt_len`` can use a slot."""
        fits_len = capacity <= self.capacity and prompt_len <= self.prefix_capacity
        return rows == self.rows and fits_len


class StaticKVCache(ParticleKVCache):
    """A :class:`ParticleKVCache` whose tensors never move while a request holds it: slot
    ``slot`` of ``bank`` (module notes), prompt storage for ``prefix_capacity`` tokens,
    suffix for ``capacity`` per row.

    ``prompt_len_t``: int64 0-dim device tensor holding the prompt length (what a captured
    forward reads; a view of the bank's). ``serial``: unique in the process (graph keys
    name caches by it). ``graphs``: the captured rounds whose first cache this is (kept
    with it, so that they serve the next request that takes the slot and die with it);
    ``rounds_run`` counts the fused rounds run with it, captured or not. Raises
    :class:`ContextLengthError` from :meth:`begin_prefill` for a prompt longer than
    ``prefix_capacity``.
    """

    def __init__(self, bank: SlotBank, slot: int) -> None:
        self.bank, self.slot = bank, slot
        layers, heads, _, _, dim = bank._dims
        self._num_layers = layers
        self._kv_shape = (heads, dim, bank.suffix_k.dtype, bank.suffix_k.device)
        self.in_use = False
        self.graphs: dict[tuple, Any] = {}
        self.rounds_run = 0  # fused rounds run with this cache first, over its life
        self.attach()
        self.reset()

    def attach(self) -> None:
        """Point this cache's tensors at its slot of the bank (again, after it grew); the
        graphs that read the old ones are dropped and the serial renewed."""
        bank, b, r = self.bank, self.slot, self.bank.rows
        self.suffix_k = bank.suffix_k[:, b * r : (b + 1) * r]
        self.suffix_v = bank.suffix_v[:, b * r : (b + 1) * r]
        self.prefix_store_k = bank.prefix_k[:, b : b + 1]
        self.prefix_store_v = bank.prefix_v[:, b : b + 1]
        self.prompt_len_t = bank.prompt_len_t[b]
        if getattr(self, "prefix_k", None) is not None:
            p = self.prefix_k.shape[3]
            self.prefix_k = self.prefix_store_k[:, :, :, :p]
            self.prefix_v = self.prefix_store_v[:, :, :, :p]
        self.graphs.clear()
        self.serial = next(_SERIALS)

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
        self.length = self._pending = self.prefilled = 0
        self.histories = RowHistories(self.rows, shared=False)

    def close(self) -> None:
        """Give the slot back for the next request."""
        self.in_use = False


class StaticSlots:
    """A model's static caches, kept between requests in banks (at most ``max_slots`` caches
    in all).

    Args:
        make: ``(rows, capacity, prefix_capacity) -> SlotBank`` (the model's, one slot).
        max_slots: how many caches may exist at once; :meth:`take` returns None beyond it
            (the request then runs on an ordinary cache, step by step).
    """

    def __init__(self, make, max_slots: int = 32) -> None:
        self._make = make
        self.max_slots = max_slots
        self.banks: list[SlotBank] = []

    @property
    def slots(self) -> list[StaticKVCache]:
        """Every cache of every bank."""
        return [c for bank in self.banks for c in bank.caches]

    def take(
        self,
        rows: int,
        capacity: int,
        prompt_len: int,
        lease: Lease | None = None,
        slot: int | None = None,
    ) -> StaticKVCache | None:
        """A free cache for ``rows`` x ``capacity`` after ``prompt_len`` tokens, reset: a free
        slot of a bank that fits; else a fitting bank doubled (up to the room left), else a
        new bank (sizes bucketed), dropping a bank no request holds when the slots are full;
        else None. ``slot``: the slot to prefer (the one the request's other model's cache
        took, so that their rounds can join others'; a bank grows to reach it where there
        is room). ``lease``: accounting only (the request's reservation)."""
        cache = self._find(rows, capacity, prompt_len, slot)
        if cache is None:
            return None
        cache.reset()
        cache.in_use = True
        return cache

    def _find(
        self, rows: int, capacity: int, prompt_len: int, slot: int | None
    ) -> StaticKVCache | None:
        fitting = [b for b in self.banks if b.fits(rows, capacity, prompt_len)]
        room = self.max_slots - len(self.slots)
        bank = next((b for b in fitting if b.free()), None)
        if bank is None and fitting and room > 0:
            bank = fitting[0]
            grown = min(bank.slots, room)
            bank.grow(bank.slots + grown)
            room -= grown
        elif bank is None:
            idle = [b for b in self.banks if len(b.free()) == b.slots]
            if room <= 0 and not idle:
                return None
            if room <= 0:
                self.banks.remove(idle[0])  # its memory goes back before the new one's
                room += idle[0].slots
                idle[0].drop_graphs()
            bank = self._make(rows, bucket(capacity), bucket(prompt_len))
            self.banks.append(bank)
            room -= 1
        while slot is not None and slot >= bank.slots and room >= bank.slots:
            room -= bank.slots  # doubled to reach the preferred slot
            bank.grow(2 * bank.slots)
        free = bank.free()
        return next((c for c in free if c.slot == slot), free[0])
