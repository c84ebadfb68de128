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

What the banks allocate is charged to the model's ``kv_bytes`` pool
(:mod:`smcspec.backends.pool`), so that the pool never calls free what a bank holds: each
bank holds a lease of exactly its K and V bytes (:attr:`SlotBank.nbytes`), taken before
its tensors are allocated and grown before it doubles (by the new tensors' bytes and, for
the copy, the old ones' too: both live at once). A request reserves on admission what a
fresh slot of its shape allocates (``Transformer.cache_need``: the bucketed capacity and
prompt storage, more than the ordinary cache it falls back to needs); the slot it takes is
paid by its bank, so that part of its reservation goes back to the pool when it takes it,
and pays for the bank's new slot where the bank is made or grown for it. A bank or a growth
the pool cannot pay is not made: the request takes an ordinary cache on its reservation.
Banks no request holds are freed when a reservation fits only without them
(:meth:`StaticSlots.reclaim`) or when their slots are needed for another shape; a bank
dropped by :meth:`StaticSlots.release` while a request holds one of its caches is freed
when the last one is closed. Freeing a bank drops its tensors from the bank and from every
cache's views (the bank and its caches refer to each other: nothing waits for the garbage
collector) before its lease is released.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

import torch

from smcspec.backends.pool import Lease, PoolError, ResourcePool
from smcspec.backends.shared_rows import RowHistories
from smcspec.backends.torch.graphs import RoundGraphs
from smcspec.backends.torch.kv_cache import ParticleKVCache
from smcspec.errors import ContextLengthError

_SERIALS = itertools.count(1)  # identities in graph keys (ids of dead objects recur)

MIN_BUCKET = 64
"""Smallest capacity and attention window of a static cache (tokens)."""

KV = "kv_bytes"  # the pool's resource


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
    rounds captured over the whole bank; ``serial``: unique in the process. ``lease``: the
    pool's lease of its :attr:`nbytes` (set by :class:`StaticSlots`; None for a bank made
    on its own); ``retired``: dropped from its :class:`StaticSlots` while a cache of it was
    in use (freed when the last one closes); ``freed``: its tensors are gone.
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
        self.graphs = RoundGraphs()
        self.serial = next(_SERIALS)
        self.lease: Lease | None = None
        self.retired = self.freed = False
        self._allocate(1)
        self.caches.append(StaticKVCache(self, 0))

    @property
    def slots(self) -> int:
        return len(self.caches)

    @property
    def capacity(self) -> int:
        return self._dims[2]

    @property
    def prefix_capacity(self) -> int:
        return self._dims[3]

    @property
    def device(self) -> torch.device:
        return self.suffix_k.device

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot's K and V (suffix rows x capacity and prompt storage, every
        layer): ``2 * layers * kv_heads * head_dim * itemsize * (prefix_capacity + rows *
        capacity)``."""
        layers, heads, cap, pcap, dim = self._dims
        itemsize = self._kind["dtype"].itemsize
        return 2 * layers * heads * dim * itemsize * (pcap + self.rows * cap)

    @property
    def nbytes(self) -> int:
        """Bytes of the bank's K and V tensors now (0 once freed): :attr:`slot_nbytes` per
        slot (``prompt_len_t``, 8 bytes a slot, is not counted)."""
        if self.freed:
            return 0
        return sum(t.nbytes for t in (self.suffix_k, self.suffix_v, self.prefix_k, self.prefix_v))

    def free_storage(self) -> None:
        """Drop the bank's tensors, its caches' views of them and every graph that read them,
        then release its lease (only for a bank none of whose caches is in use)."""
        if any(c.in_use for c in self.caches):
            raise RuntimeError("a bank is freed while a request holds one of its caches")
        self.drop_graphs()
        for cache in self.caches:
            cache.detach()
        self.suffix_k = self.suffix_v = self.prefix_k = self.prefix_v = None
        self.prompt_len_t = None
        self.freed = True
        if self.lease is not None:
            self.lease.release()

    def closed(self) -> None:
        """A cache of this bank was given back: a retired bank with none in use is freed."""
        if self.retired and not self.freed and not any(c.in_use for c in self.caches):
            self.free_storage()

    def _allocate(self, slots: int) -> None:
        layers, heads, cap, pcap, dim = self._dims
        suffix = (layers, slots * self.rows, heads, cap, dim)
        prefix = (layers, slots, heads, pcap, dim)
        made = [torch.zeros(shape, **self._kind) for shape in (suffix, suffix, prefix, prefix)]
        lengths = torch.zeros(slots, dtype=torch.long, device=self._kind["device"])
        # assigned together: a failed allocation (out of memory) leaves the bank as it was
        self.suffix_k, self.suffix_v, self.prefix_k, self.prefix_v = made
        self.prompt_len_t = lengths

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
        self.graphs = RoundGraphs()
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

    def detach(self) -> None:
        """Drop this cache's views and graphs (its bank is being freed)."""
        self.suffix_k = self.suffix_v = self.prefix_store_k = self.prefix_store_v = None
        self.prefix_k = self.prefix_v = self.prompt_len_t = None
        self.graphs.clear()

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
        """Give the slot back for the next request (a retired bank's last one frees it)."""
        lease = self.bank.lease
        if lease is None:
            self.in_use = False
            return
        with lease.pool.lock:
            self.in_use = False
            self.bank.closed()


class StaticSlots:
    """A model's static caches, kept between requests in banks (at most ``max_slots`` caches
    in all), their storage charged to the model's pool (module notes).

    Args:
        make: ``(rows, capacity, prefix_capacity) -> SlotBank`` (the model's, one slot).
        pool: ``() -> ResourcePool``: the model's ``kv_bytes`` pool (read when first needed;
            this object registers there as a :class:`~smcspec.backends.pool.Reclaimer`).
        need: ``(rows, capacity, prefix_capacity) -> bytes`` of one slot of that shape
            (what a request reserves for it: ``Transformer.cache_need``).
        max_slots: how many caches may exist at once; :meth:`take` returns None beyond it
            (the request then runs on an ordinary cache, step by step).
    """

    def __init__(
        self,
        make: Callable[[int, int, int], SlotBank],
        pool: Callable[[], ResourcePool],
        need: Callable[[int, int, int], int],
        max_slots: int = 32,
    ) -> None:
        self._make, self._pool_of, self._need = make, pool, need
        self.max_slots = max_slots
        self.banks: list[SlotBank] = []
        self._pool: ResourcePool | None = None
        self._keep: SlotBank | None = None  # the bank a take works on: never reclaimed

    @property
    def pool(self) -> ResourcePool:
        """The pool the banks are charged to (this object reclaims idle banks for it)."""
        pool = self._pool_of()
        if pool is not self._pool:
            self._pool = pool
            if self not in pool.reclaimers:
                pool.reclaimers.append(self)
        return pool

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
        is room). ``lease``: the request's reservation on this model's pool: up to one
        slot of this shape of it goes to the bank that pays for the slot (module notes);
        every bank made or grown is paid from the pool, and one it cannot pay is not made
        (None where nothing else fits).

        Raises:
            PoolError: ``lease`` is of another pool.
        """
        pool = self.pool
        with pool.lock:
            held = 0 if lease is None or lease.released else lease.amounts.get(KV, 0)
            lent = min(held, self._need(rows, bucket(capacity), bucket(prompt_len)))
            if lent:
                pool.shrink(lease, {KV: lent})  # the slot is the bank's to pay from here on
            try:
                cache = self._find(rows, capacity, prompt_len, slot)
            except BaseException:
                self._give_back(lease, lent)
                raise
            if cache is None:
                self._give_back(lease, lent)
                return None
            cache.reset()
            cache.in_use = True
            return cache

    def _give_back(self, lease: Lease | None, lent: int) -> None:
        """Return to ``lease`` what :meth:`take` lent to the pool for a slot it did not get
        (always free: under the lock nothing else took it, and nothing failed took any)."""
        if lent and not self.pool.try_grow(lease, {KV: lent}):
            raise PoolError("a request's reservation could not be given back its slot")

    def _find(
        self, rows: int, capacity: int, prompt_len: int, slot: int | None
    ) -> StaticKVCache | None:
        fitting = [b for b in self.banks if b.fits(rows, capacity, prompt_len)]
        room = self.max_slots - len(self.slots)
        bank = next((b for b in fitting if b.free()), None)
        if bank is None and fitting and room > 0:
            grown = min(fitting[0].slots, room)
            if self._grow(fitting[0], fitting[0].slots + grown):
                bank, room = fitting[0], room - grown
        if bank is None:
            bank = self._new_bank(rows, capacity, prompt_len, room)
            if bank is None:
                return None
            room = self.max_slots - len(self.slots)
        while slot is not None and slot >= bank.slots and room >= bank.slots:
            room -= bank.slots  # doubled to reach the preferred slot
            if not self._grow(bank, 2 * bank.slots):
                break
        free = bank.free()
        return next((c for c in free if c.slot == slot), free[0])

    def _new_bank(self, rows: int, capacity: int, prompt_len: int, room: int) -> SlotBank | None:
        """A new one-slot bank (sizes bucketed), paid from the pool before it is allocated;
        an idle bank is dropped first where the slots are full. None: no room, or the pool
        cannot pay (with idle banks reclaimed)."""
        idle = [b for b in self.banks if len(b.free()) == b.slots]
        if room <= 0 and not idle:
            return None
        if room <= 0:
            self._drop(idle[0])  # its memory goes back before the new one's
        cap, pcap = bucket(capacity), bucket(prompt_len)
        nbytes = self._need(rows, cap, pcap)
        charge = self.pool.try_reserve({KV: nbytes}, owner=self)
        if charge is None:
            return None
        try:
            bank = self._make(rows, cap, pcap)
        except BaseException:
            charge.release()
            raise
        bank.lease = charge
        self._settle(bank)
        self.banks.append(bank)
        return bank

    def _grow(self, bank: SlotBank, slots: int) -> bool:
        """Double ``bank`` (to ``slots``) if the pool pays for it: the new tensors and, while
        the old ones are copied, the old ones too; False (unchanged) otherwise."""
        new = bank.slot_nbytes * slots
        copying = bank.nbytes
        self._keep = bank
        try:
            if not self.pool.try_grow(bank.lease, {KV: new}):
                return False
        finally:
            self._keep = None
        try:
            bank.grow(slots)
        finally:
            self.pool.shrink(bank.lease, {KV: copying})  # the old tensors are gone (or kept)
            if bank.nbytes != bank.lease.amounts[KV]:
                self._settle(bank)  # failed: only the old tensors are held
        return True

    def _settle(self, bank: SlotBank) -> None:
        """Make ``bank``'s lease hold exactly its bytes (a ``need`` that disagrees with the
        bank's own shapes is corrected here, never left over- or under-charged)."""
        held = bank.lease.amounts.get(KV, 0)
        if bank.nbytes < held:
            self.pool.shrink(bank.lease, {KV: held - bank.nbytes})
        elif bank.nbytes > held and not self.pool.try_grow(bank.lease, {KV: bank.nbytes - held}):
            raise PoolError(f"a static bank holds {bank.nbytes} bytes, the pool paid {held}")

    def _drop(self, bank: SlotBank) -> None:
        """Free an idle bank and take it off the list."""
        self.banks.remove(bank)
        bank.free_storage()

    def reclaimable(self) -> dict[str, int]:
        """Bytes of the banks no request holds (:class:`~smcspec.backends.pool.Reclaimer`)."""
        idle = [b for b in self.banks if b is not self._keep and len(b.free()) == b.slots]
        return {KV: sum(b.nbytes for b in idle)}

    def reclaim(self, short: Mapping[str, int]) -> None:
        """Free idle banks, the oldest first, until ``short`` bytes are given back."""
        freed = 0
        for bank in list(self.banks):
            if freed >= short.get(KV, 0):
                break
            if bank is not self._keep and len(bank.free()) == bank.slots:
                freed += bank.nbytes
                self._drop(bank)

    def release(self) -> None:
        """Drop every bank: the idle ones are freed now, the others when their last cache in
        use is closed (their caches stay valid until then); no graph is kept."""
        with self.pool.lock:
            for bank in self.banks:
                bank.drop_graphs()
                bank.retired = True
                bank.closed()
            self.banks = []
