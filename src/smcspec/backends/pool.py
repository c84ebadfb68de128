"""Shared pools: what a request takes from a model and must give back.

Every model has one :class:`ResourcePool` of named integer resources (the llamacpp
backend: llama.cpp ``sequences`` and unified-KV ``kv_cells``; the torch backend:
``kv_bytes`` of KV storage). A request reserves everything it can ever use when it is
admitted (:meth:`ResourcePool.try_reserve`, all-or-nothing) and holds a :class:`Lease`
until it ends; :meth:`Lease.release` gives it back, idempotently, from a ``finally``.
A :class:`Reservation` is one request's leases on the target and the draft.

Nothing here relies on the garbage collector: a lease that is never released stays
reserved, and :meth:`ResourcePool.leases_of` shows whose it is (the scheduler treats a lease
of its own still held while nothing runs as a leak and turns the server unhealthy).

A backend may keep storage between requests (the torch backend's banks of static KV caches,
:mod:`smcspec.backends.torch.static_cache`): it holds that storage on a lease of its own,
grown and shrunk with it (:meth:`ResourcePool.try_grow`, :meth:`ResourcePool.shrink`), so
that what the pool calls free is never memory something holds; storage no request uses is a
:class:`Reclaimer`'s, which the pool asks to free it when a reservation would fit only then.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from smcspec.errors import SmcspecError


class PoolError(SmcspecError):
    """A pool was asked for a resource it does not have, or a lease was misused."""


@dataclass
class Lease:
    """Amounts reserved from one pool for one request; ``items`` holds backend specifics
    (llama.cpp sequence ids). :meth:`release` gives everything back (idempotent)."""

    pool: ResourcePool
    amounts: dict[str, int]
    items: dict[str, Any] = field(default_factory=dict)
    released: bool = False
    owner: object | None = None  # who reserved it (a scheduler), for leak checks

    def release(self) -> None:
        """Give the lease back to its pool; later calls do nothing."""
        self.pool.release(self)


class Reclaimer(Protocol):
    """Storage kept on a pool that nothing uses now and that can be freed on demand (idle
    banks of static caches). Both methods are called under the pool's lock."""

    def reclaimable(self) -> dict[str, int]:
        """Resource name -> amount :meth:`reclaim` could give back now."""

    def reclaim(self, short: Mapping[str, int]) -> None:
        """Free storage (releasing or shrinking its leases) until ``short`` is given back, or
        all that :meth:`reclaimable` counts."""


class ResourcePool:
    """Integer resources of one model, reserved all-or-nothing and released explicitly.

    Args:
        name: for messages and metrics (``target``, ``draft`` or a file name).
        capacity: resource name -> total amount (> 0).
        on_take: called under the pool's lock with a new lease (to attach concrete items).
        on_release: called under the pool's lock with a lease being released (to clear
            and return its items) before its amounts are returned.
    ``reclaimers``: :class:`Reclaimer` s asked, in order, to free idle storage when a
    reservation or a growth fits only with it (:meth:`try_reserve`, :meth:`try_grow`).
    Thread-safe: one re-entrant lock per pool (:attr:`lock`), which the reclaimers hold too.
    """

    def __init__(
        self,
        name: str,
        capacity: Mapping[str, int],
        on_take: Callable[[Lease], None] | None = None,
        on_release: Callable[[Lease], None] | None = None,
    ) -> None:
        self.name = name
        self.capacity = dict(capacity)
        self._free = dict(capacity)
        self._leases = 0
        self._owners: dict[int, object | None] = {}
        self._on_take, self._on_release = on_take, on_release
        self._lock = threading.RLock()
        self.reclaimers: list[Reclaimer] = []

    @property
    def lock(self) -> threading.RLock:
        """The pool's re-entrant lock: held by every change of its amounts (hold it across
        several calls that must not interleave with other threads')."""
        return self._lock

    def _check(self, amounts: Mapping[str, int]) -> None:
        unknown = set(amounts) - set(self.capacity)
        if unknown:
            raise PoolError(f"pool {self.name!r} has no resource {sorted(unknown)[0]!r}")
        if any(v < 0 for v in amounts.values()):
            raise PoolError("amounts must be >= 0")

    def never_fits(self, amounts: Mapping[str, int]) -> str | None:
        """Why ``amounts`` exceed the whole pool (a request that can never run), or None."""
        self._check(amounts)
        for k, v in amounts.items():
            if v > self.capacity[k]:
                return (
                    f"{self.name} needs {v} {k.replace('_', ' ')}, the pool has {self.capacity[k]}"
                )
        return None

    def try_reserve(self, amounts: Mapping[str, int], owner: object | None = None) -> Lease | None:
        """Reserve ``amounts`` if all are free now; None (nothing taken) otherwise.
        ``owner``: who holds the lease (see :meth:`leases_of`)."""
        self._check(amounts)
        with self._lock:
            if not self._fits(amounts):
                return None
            lease = Lease(self, dict(amounts), owner=owner)
            for k, v in amounts.items():
                self._free[k] -= v
            self._leases += 1
            self._owners[id(lease)] = owner
            if self._on_take is not None:
                try:
                    self._on_take(lease)
                except BaseException:
                    for k, v in amounts.items():
                        self._free[k] += v
                    self._leases -= 1
                    self._owners.pop(id(lease), None)
                    raise
            return lease

    def _fits(self, amounts: Mapping[str, int]) -> bool:
        """Whether ``amounts`` are free now, after the reclaimers freed idle storage where
        that is enough (called holding the lock)."""
        short = {k: v - self._free[k] for k, v in amounts.items() if v > self._free[k]}
        if not short:
            return True
        idle: dict[str, int] = {}
        for r in self.reclaimers:
            for k, v in r.reclaimable().items():
                idle[k] = idle.get(k, 0) + v
        if any(v > idle.get(k, 0) for k, v in short.items()):
            return False  # freeing every idle bank would not be enough: keep them
        for r in self.reclaimers:
            short = {k: v - self._free[k] for k, v in amounts.items() if v > self._free[k]}
            if not short:
                break
            r.reclaim(short)
        return all(v <= self._free[k] for k, v in amounts.items())

    def _held(self, lease: Lease, amounts: Mapping[str, int]) -> None:
        self._check(amounts)
        if lease.pool is not self:
            raise PoolError("this lease belongs to another pool")
        if lease.released:
            raise PoolError("this lease was released")

    def try_grow(self, lease: Lease, amounts: Mapping[str, int]) -> bool:
        """Add ``amounts`` to a held ``lease`` if all are free now (idle storage reclaimed
        where that makes them fit); False (nothing taken) otherwise.

        Raises:
            PoolError: a lease of another pool, or released; an unknown resource.
        """
        with self._lock:
            self._held(lease, amounts)
            if not self._fits(amounts):
                return False
            for k, v in amounts.items():
                self._free[k] -= v
                lease.amounts[k] = lease.amounts.get(k, 0) + v
            return True

    def shrink(self, lease: Lease, amounts: Mapping[str, int]) -> None:
        """Give ``amounts`` of a held ``lease`` back to the pool now (the rest stays held).

        Raises:
            PoolError: a lease of another pool, or released; more than the lease holds.
        """
        with self._lock:
            self._held(lease, amounts)
            if any(v > lease.amounts.get(k, 0) for k, v in amounts.items()):
                raise PoolError(
                    f"cannot give back {dict(amounts)}: the lease holds {lease.amounts}"
                )
            for k, v in amounts.items():
                lease.amounts[k] -= v
                self._free[k] += v

    def release(self, lease: Lease) -> None:
        """Return ``lease`` (idempotent)."""
        if lease.pool is not self:
            raise PoolError("this lease belongs to another pool")
        with self._lock:
            if lease.released:
                return
            lease.released = True
            try:
                if self._on_release is not None:
                    self._on_release(lease)
            finally:
                for k, v in lease.amounts.items():
                    self._free[k] += v
                self._leases -= 1
                self._owners.pop(id(lease), None)

    def free(self) -> dict[str, int]:
        """Resource name -> amount free now."""
        with self._lock:
            return dict(self._free)

    @property
    def in_use(self) -> bool:
        """Whether any lease is held."""
        with self._lock:
            return self._leases > 0 or self._free != self.capacity

    @property
    def leases(self) -> int:
        """How many leases are held now, by every owner."""
        with self._lock:
            return self._leases

    def leases_of(self, owner: object) -> int:
        """How many leases ``owner`` holds now."""
        with self._lock:
            return sum(1 for o in self._owners.values() if o is owner)


@dataclass(frozen=True)
class CacheNeed:
    """One KV cache a decoder program will open: ``rows`` particles of up to ``capacity``
    generated tokens each after a prompt of ``prompt_len`` tokens, on the ``role`` model
    (``shared_rows``: its forwards compute distinct rows only, see
    :mod:`smcspec.backends.shared_rows`; ``static``: a cache at fixed addresses for rounds
    captured as CUDA graphs, where the backend has them)."""

    role: str  # "target" or "draft"
    rows: int
    capacity: int
    prompt_len: int
    shared_rows: bool = True
    static: bool = False


class Reservation:
    """One request's leases, by model role; :meth:`release` gives all of them back."""

    def __init__(self, leases: dict[str, Lease]) -> None:
        self.leases = leases

    def lease(self, role: str) -> Lease:
        """The lease reserved on the ``role`` model (``"target"`` or ``"draft"``).

        Raises:
            PoolError: nothing was reserved on that model.
        """
        try:
            return self.leases[role]
        except KeyError:
            raise PoolError(f"nothing was reserved on the {role} model") from None

    def release(self) -> None:
        """Release every lease (idempotent; a failing one does not keep the others)."""
        errors = []
        for lease in self.leases.values():
            try:
                lease.release()
            except Exception as exc:  # pragma: no cover - a backend that cannot clear
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ------------------------------------------------------------- a request on a model pair
def pool_needs(models: Mapping[str, Any], caches: list[CacheNeed]) -> dict[str, dict[str, int]]:
    """What a request opening ``caches`` can ever take from each model's pool: role ->
    resource -> amount (``models``: role -> a model with ``cache_need``, see
    :class:`~smcspec.backends.base.DecoderModel`)."""
    needs: dict[str, dict[str, int]] = {}
    for c in caches:
        amounts = models[c.role].cache_need(c.rows, c.capacity, c.prompt_len)
        total = needs.setdefault(c.role, {})
        for k, v in amounts.items():
            total[k] = total.get(k, 0) + v
    return needs


def never_fits(models: Mapping[str, Any], caches: list[CacheNeed]) -> str | None:
    """Why a request opening ``caches`` can never run on these models' pools (even alone),
    or None. Models that share one pool (two torch models on one device) are summed."""
    shared: dict[int, tuple[ResourcePool, list[str], dict[str, int]]] = {}
    for role, amounts in pool_needs(models, caches).items():
        pool = models[role].pool
        _, roles, total = shared.setdefault(id(pool), (pool, [], {}))
        roles.append(role)
        for k, v in amounts.items():
            total[k] = total.get(k, 0) + v
    for pool, roles, total in shared.values():
        reason = pool.never_fits(total)
        if reason is not None:
            return f"the request can never fit: the {' and '.join(roles)} {reason}"
    return None


def try_reserve(
    models: Mapping[str, Any], caches: list[CacheNeed], owner: object | None = None
) -> Reservation | None:
    """Reserve everything a request opening ``caches`` can ever use on every model,
    all-or-nothing; None when it does not fit now. The caller releases it
    (:meth:`Reservation.release`); ``owner`` tags the leases (a scheduler checks its own
    for leaks)."""
    leases: dict[str, Lease] = {}
    for role, amounts in pool_needs(models, caches).items():
        lease = models[role].pool.try_reserve(amounts, owner=owner)
        if lease is None:
            Reservation(leases).release()
            return None
        leases[role] = lease
    return Reservation(leases)
