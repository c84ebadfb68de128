"""What the layers of one static forward read (the forwards of rounds, captured as CUDA graphs).

:class:`StaticView` is built once per forward
(:meth:`~smcspec.backends.torch.transformer.Transformer.decode_static`, ``decode_bank``);
:meth:`StaticView.layer` gives one layer its part, a :class:`LayerView`: tensors only (the
windows of its stores, the positions written, the masks), so that a compiled layer
(:func:`~smcspec.backends.torch.kernels.layer_kernels`) takes the same function for every
layer and every suffix window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from smcspec.backends.torch.flex import ParticleMask, mark_dynamic


@dataclass
class LayerView:
    """One layer's part of a static forward: ``sk``/``sv`` ``[slots * rows, Hkv, Sw, D]``
    the suffix windows of its stores (views: the new keys and values are written into them),
    ``pk``/``pv`` ``[slots, Hkv, Pw, D]`` the prompt windows; ``write_at``, ``scatter_at``,
    ``keep``, ``mask_prefix``, ``mask_suffix``, ``flex``, ``cos``, ``sin`` as in
    :class:`StaticView`."""

    sk: torch.Tensor
    sv: torch.Tensor
    pk: torch.Tensor
    pv: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    write_at: torch.Tensor | None
    scatter_at: torch.Tensor | None
    keep: torch.Tensor | None
    mask_prefix: torch.Tensor | None
    mask_suffix: torch.Tensor | None
    flex: ParticleMask | None

    @property
    def tokens(self) -> int:
        """``T``, the new tokens per row (from a tensor's shape: symbolic when compiled)."""
        return self.write_at.shape[0] if self.write_at is not None else self.scatter_at.shape[2]

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the layer's new keys and values ``[slots * rows, Hkv, T, D]``."""
        for store, new in ((self.sk, k), (self.sv, v)):
            if self.write_at is not None:
                store.index_copy_(2, self.write_at, new)
                continue
            if self.keep is not None:
                new = torch.where(self.keep, new, store.gather(2, self.scatter_at))
            store.scatter_(2, self.scatter_at, new)

    def mark_dynamic(self) -> None:
        """Mark the dims that vary within a request or between requests of one shape (rows,
        tokens, suffix window) as dynamic for ``torch.compile``; sizes 1 stay specialized."""
        dims = [(self.cos, 0), (self.sin, 0), (self.sk, 0), (self.sk, 2), (self.sv, 0)]
        dims += [(self.sv, 2), (self.write_at, 0), (self.scatter_at, 0), (self.scatter_at, 2)]
        dims += [(self.keep, 0), (self.mask_suffix, 1), (self.mask_suffix, 2)]
        for t, dim in dims:
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, dim)
        if self.flex is not None:
            mark_dynamic(self.flex)


@dataclass
class StaticView:
    """What every layer of one static forward reads (built once per forward, all on the
    device): ``slots`` x ``rows`` x ``tokens`` new tokens, rows slot-major, over the suffix
    storage ``suffix_k/v`` ``[layers, slots * rows, Hkv, capacity, D]`` and the prompt
    storage ``prefix_k/v`` ``[layers, slots, Hkv, prefix_capacity, D]`` (one cache: one
    slot; a bank: every slot). Keys and values go to suffix positions ``write_at``: int64
    ``[T]`` for every row, or ``scatter_at`` (int64 ``[slots * rows, Hkv, T, D]``, each
    slot's positions) with ``keep`` (bool ``[slots * rows, 1, 1, 1]``, False: the row's
    stored values are written back unchanged). Attention covers the first ``prefix_window``
    prompt and ``suffix_window`` suffix positions: with the written attention True in
    ``mask_prefix`` ``[slots, Pw]`` and ``mask_suffix`` ``[slots, g*T, Sw]`` (queries ordered
    (head in group, token)) hides one; with the flex attention ``flex`` says what each query
    sees (:class:`~smcspec.backends.torch.flex.ParticleMask`) and the masks are None.
    ``cos``/``sin``: RoPE of every row's positions ``[slots * rows * T, D]``."""

    suffix_k: torch.Tensor
    suffix_v: torch.Tensor
    prefix_k: torch.Tensor
    prefix_v: torch.Tensor
    tokens: int
    prefix_window: int
    suffix_window: int
    cos: torch.Tensor
    sin: torch.Tensor
    mask_prefix: torch.Tensor | None = None
    mask_suffix: torch.Tensor | None = None
    flex: ParticleMask | None = None
    write_at: torch.Tensor | None = None
    scatter_at: torch.Tensor | None = None
    keep: torch.Tensor | None = None

    def layer(self, i: int) -> LayerView:
        """Layer ``i``'s windows and the forward's positions and masks."""
        pw, sw = self.prefix_window, self.suffix_window
        return LayerView(
            self.suffix_k[i, :, :, :sw],
            self.suffix_v[i, :, :, :sw],
            self.prefix_k[i, :, :, :pw],
            self.prefix_v[i, :, :, :pw],
            self.cos,
            self.sin,
            self.write_at,
            self.scatter_at,
            self.keep,
            self.mask_prefix,
            self.mask_suffix,
            self.flex,
        )
