"""One request's particles in a llama.cpp context: a sequence id per row
(:class:`SequenceCache`), resampled and rolled back by sequence operations on KV cells in the
order :func:`copy_plan` gives."""

from __future__ import annotations

import weakref
from collections import Counter
from typing import TYPE_CHECKING

import torch

from smcspec.backends.pool import Lease
from smcspec.backends.shared_rows import RowHistories
from smcspec.errors import ContextLengthError

if TYPE_CHECKING:
    from smcspec.backends.llamacpp.model import LlamaCppModel


SPARE = -1  # the spare sequence of a copy plan


def copy_plan(ancestors: list[int]) -> list[tuple[int, int]]:
    """Sequence copies that make row ``i`` a copy of row ``ancestors[i]`` for every ``i``,
    with one spare sequence (:data:`SPARE`) at most in use at any time.

    Returns ``(dst, src)`` pairs to run in order (``seq_rm(dst)`` then ``seq_cp(src, dst)``);
    ``dst == SPARE`` parks a row that is about to be overwritten while others still read it.
    Rows that nobody reads are overwritten first (peeling the trees of the ancestor graph);
    what is left are disjoint cycles, each broken by parking one row in the spare, which is
    free again once that cycle is done.
    """
    src = {i: a for i, a in enumerate(ancestors) if a != i}
    readers = Counter(src.values())
    ready = sorted((i for i in src if readers[i] == 0), reverse=True)
    ops: list[tuple[int, int]] = []
    while src:
        if not ready:  # only cycles remain: park one of their rows in the spare
            if readers[SPARE]:
                raise AssertionError("the spare is still read")  # cannot happen (see above)
            j = min(src)
            ops.append((SPARE, j))
            for i in src:
                if src[i] == j:
                    src[i] = SPARE
            readers[SPARE], readers[j] = readers[j], 0
            ready.append(j)
            continue
        i = ready.pop()
        s = src.pop(i)
        ops.append((i, s))
        readers[s] -= 1
        if s != SPARE and readers[s] == 0 and s in src:
            ready.append(s)
    return ops


class SequenceCache:
    """The KV state of one request's ``rows`` particles: one llama.cpp sequence id each,
    plus a spare id for resampling when ``rows > 1``.

    ``length`` generated tokens are stored per row, at positions
    ``prompt_len .. prompt_len + length - 1`` (all rows advance together). The ids come
    from ``lease`` (a request's reservation, released by its owner) or, without one, from
    a lease of the cache's own that :meth:`close` releases. ``histories`` tracks which rows
    hold identical tokens (:class:`~smcspec.backends.shared_rows.RowHistories`; with
    ``shared_rows`` off every row is computed).
    """

    def __init__(
        self,
        model: LlamaCppModel,
        lease: Lease,
        rows: int,
        capacity: int,
        owned: bool,
        shared_rows: bool = True,
    ):
        taken = lease.items.setdefault("taken", 0)
        need = rows + (1 if rows > 1 else 0)
        ids = lease.items["ids"][taken : taken + need]
        if len(ids) < need:
            raise ContextLengthError(
                f"the request reserved {len(lease.items['ids'])} llama.cpp sequences and "
                f"needs {taken + need}"
            )
        lease.items["taken"] = taken + need
        self.model, self.lease, self.capacity, self._owned = model, lease, capacity, owned
        self.ids, self.spare = ids[:rows], (ids[rows] if rows > 1 else None)
        self.prompt_len = 0  # set once the whole prompt is in
        self.prefilled = 0  # prompt positions decoded so far (a prompt may run in chunks)
        self.length = 0
        self.histories = RowHistories(rows, shared=shared_rows)
        if owned:  # a direct user's cache: close() gives it back, collection as a last resort
            weakref.finalize(self, lease.release)

    @property
    def rows(self) -> int:
        return len(self.ids)

    def close(self) -> None:
        """Release the cache's own lease (a cache made without one); otherwise nothing: the
        request's reservation is released by its owner."""
        if self._owned:
            self.lease.release()

    def _check_open(self) -> None:
        if self.lease.released:
            raise ContextLengthError("this KV cache's sequences were released")

    def truncate(self, length: int) -> None:
        """Roll every row back to ``length`` generated tokens (speculative rollback)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to {length} (filled {self.length})")
        self._check_open()
        if length == self.length:  # nothing was rejected: no sequence operation
            return
        with self.model._lock:
            mem = self.model._memory
            for s in self.ids:
                self.model._lib.llama_memory_seq_rm(mem, s, self.prompt_len + length, -1)
        self.histories.truncate(self.length - length)
        self.length = length

    def reorder(self, ancestors: torch.Tensor) -> None:
        """Make row ``i`` a copy of row ``ancestors[i]`` (resampling), by sequence operations.

        ``seq_cp`` adds the destination to the source's cells (a union, no KV is copied), so
        a destination is cleared first; the order and the one spare come from
        :func:`copy_plan`.
        """
        anc = [int(a) for a in ancestors.tolist()]
        if self.length == 0 or all(a == i for i, a in enumerate(anc)):
            return  # rows hold the same prompt: nothing to do
        self._check_open()
        lib, mem = self.model._lib, self.model._memory
        seq = {i: s for i, s in enumerate(self.ids)} | {SPARE: self.spare}
        with self.model._lock:
            try:
                for dst, src in copy_plan(anc):
                    lib.llama_memory_seq_rm(mem, seq[dst], -1, -1)
                    lib.llama_memory_seq_cp(mem, seq[src], seq[dst], -1, -1)
            finally:
                lib.llama_memory_seq_rm(mem, self.spare, -1, -1)
        self.histories.reorder(anc)
