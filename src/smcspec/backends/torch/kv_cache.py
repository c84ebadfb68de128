"""Particle KV cache: one shared prompt (prefix) KV plus a private suffix per particle row.

Layout (per cache, all layers in one tensor so that reorder/truncate are single ops):

* ``prefix_k``, ``prefix_v``: ``[layers, 1, kv_heads, prompt_len, head_dim]``. Written once
  by prefill and shared by every row: it is broadcast in attention, never copied, and
  resampling never touches it.
* ``suffix_k``, ``suffix_v``: ``[layers, rows, kv_heads, capacity, head_dim]``, preallocated.
  Row ``i`` owns the KV of the tokens generated on it. All rows have the same filled length
  (SMC-SD rounds and speculative rounds advance every row by the same number of tokens).

A token at suffix position ``j`` of any row sits at absolute position ``prompt_len + j``.

``histories`` (:class:`~smcspec.backends.shared_rows.RowHistories`) knows which rows hold the
same tokens; a forward computes each distinct row once and writes its keys and values into
every row of its group, so rows with the same history always hold the same KV.
"""

from __future__ import annotations

import torch

from smcspec.backends.shared_rows import RowHistories
from smcspec.errors import ContextLengthError


class ParticleKVCache:
    """Preallocated KV storage for ``rows`` particles that share one prompt.

    Args:
        num_layers, num_kv_heads, head_dim: from the model's :class:`ModelConfig`.
        rows: number of particle rows N (>= 1).
        capacity: maximum number of generated-token positions per row.
        dtype, device: storage dtype/device (the model's).
        shared_rows: compute each distinct row of a forward once (``False``: every row).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        rows: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shared_rows: bool = True,
    ) -> None:
        shape = (num_layers, rows, num_kv_heads, capacity, head_dim)
        self.suffix_k = torch.zeros(shape, dtype=dtype, device=device)
        self.suffix_v = torch.zeros(shape, dtype=dtype, device=device)
        self.prefix_k: torch.Tensor | None = None
        self.prefix_v: torch.Tensor | None = None
        self.length = 0  # filled suffix positions, identical for every row
        self.prefilled = 0  # prompt positions stored (a prompt may be prefilled in chunks)
        self._pending = 0  # tokens being written by the forward in progress
        self._num_layers = num_layers
        self._kv_shape = (num_kv_heads, head_dim, dtype, device)
        self.histories = RowHistories(rows, shared=shared_rows)

    @property
    def rows(self) -> int:
        return self.suffix_k.shape[1]

    @property
    def capacity(self) -> int:
        return self.suffix_k.shape[3]

    @property
    def prompt_len(self) -> int:
        return 0 if self.prefix_k is None else self.prefix_k.shape[3]

    def close(self) -> None:
        """Nothing to give back: the tensors are freed with the cache (the request's
        ``kv_bytes`` lease is released by its owner)."""

    # ------------------------------------------------------------------ prefill
    def begin_prefill(self, prompt_len: int) -> None:
        """Allocate the shared prompt KV for ``prompt_len`` tokens (called by the model;
        :attr:`prefilled` counts the positions its prefill has stored so far)."""
        if self.prefix_k is not None:
            raise RuntimeError("this cache already holds a prompt")
        self.prefilled = 0
        kv_heads, head_dim, dtype, device = self._kv_shape
        shape = (self._num_layers, 1, kv_heads, prompt_len, head_dim)
        self.prefix_k = torch.empty(shape, dtype=dtype, device=device)
        self.prefix_v = torch.empty(shape, dtype=dtype, device=device)

    # ------------------------------------------------------------------ decode
    def begin_step(self, num_tokens: int) -> int:
        """Reserve ``num_tokens`` new suffix positions on every row; returns the start index.

        Raises:
            ContextLengthError: the rows would exceed ``capacity``.
        """
        if self.length + num_tokens > self.capacity:
            raise ContextLengthError(
                f"KV cache full: {self.length} + {num_tokens} > capacity {self.capacity}"
            )
        self._pending = num_tokens
        return self.length

    def end_step(self) -> None:
        """Commit the positions reserved by :meth:`begin_step`."""
        self.length += self._pending
        self._pending = 0

    # ------------------------------------------------------------------ edits
    def truncate(self, length: int) -> None:
        """Roll every row back to ``length`` generated positions (speculative rollback)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to {length} (filled {self.length})")
        self.histories.truncate(self.length - length)
        self.length = length

    def reorder(self, ancestors: torch.Tensor) -> None:
        """Make row ``i`` a copy of row ``ancestors[i]`` (resampling).

        Only the filled part of the private suffix is gathered; the shared prompt KV is
        untouched. ``ancestors``: int64 ``[rows]`` on any device.
        """
        if self.length == 0:
            return
        idx = ancestors.to(self.suffix_k.device)
        n = self.length
        self.suffix_k[:, :, :, :n] = self.suffix_k[:, idx, :, :n]
        self.suffix_v[:, :, :, :n] = self.suffix_v[:, idx, :, :n]
        self.histories.reorder(ancestors)
