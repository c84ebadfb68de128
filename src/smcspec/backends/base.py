"""What a backend offers the decoders, the scheduler and the engine.

The decoders (:mod:`smcspec.decoding`) are programs that yield prefills and forwards of a
:class:`DecoderModel` and edit its :class:`KVCache`; the scheduler batches the forwards of
many requests with :meth:`DecoderModel.decode_batch`. Two backends implement it: ``torch``
(:class:`smcspec.backends.torch.Transformer`, the reference implementation, GPUs) and
``llamacpp`` (:class:`smcspec.backends.llamacpp.LlamaCppModel`, GGUF files through
llama.cpp's quantized kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from smcspec.backends.pool import Lease, ResourcePool
from smcspec.backends.shared_rows import RowHistories

if TYPE_CHECKING:
    from smcspec.backends.torch.architecture import ModelConfig


class KVCache(Protocol):
    """The KV state of one request's particle rows (all rows advance together).

    ``length`` is the number of generated tokens stored per row; ``histories`` knows which
    rows hold the same tokens (:mod:`smcspec.backends.shared_rows`) and counts the rows
    computed and fed.
    """

    length: int
    histories: RowHistories

    @property
    def rows(self) -> int: ...

    def reorder(self, ancestors: torch.Tensor) -> None:
        """Make row ``i`` a copy of row ``ancestors[i]`` (int64 ``[rows]``): resampling."""

    def truncate(self, length: int) -> None:
        """Roll every row back to ``length`` generated tokens: speculative rollback."""

    def close(self) -> None:
        """Give back what the cache reserved itself (a cache made without a lease)."""


class DecoderModel(Protocol):
    """A language model the decoders can drive.

    Logits are float tensors of the model's full vocabulary ``V``; those returned by
    :meth:`decode` and :meth:`decode_batch` may be views of the backend's buffers, valid
    until the next forward of the same model.
    """

    device: torch.device
    vocab_size: int  # logits per position
    pool: ResourcePool  # what requests reserve on admission (smcspec.backends.pool)

    def cache_need(self, rows: int, capacity: int, prompt_len: int) -> dict[str, int]:
        """The most a cache of ``rows`` x ``capacity`` generated tokens after a
        ``prompt_len``-token prompt can take from :attr:`pool`."""

    def new_cache(
        self, rows: int, capacity: int, lease: Lease | None = None, shared_rows: bool = True
    ) -> KVCache:
        """A cache for ``rows`` particles of up to ``capacity`` generated tokens each, drawing
        on ``lease`` (reserved with :meth:`cache_need`); without one it reserves what it needs
        itself and :meth:`KVCache.close` gives it back. With ``shared_rows`` each forward
        computes the distinct rows only (:mod:`smcspec.backends.shared_rows`)."""

    def prefill(
        self,
        prompt: torch.Tensor,
        cache: KVCache,
        start: int = 0,
        end: int | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor | None:
        """Run ``prompt`` (int64 ``[P]``) into ``cache``, shared by its rows; logits ``[V]``.
        With ``all_logits``, the logits ``[end - start, V]`` of every position of the chunk
        (each chunk, the last included): what a prompt's log-probabilities need.

        With ``start``/``end``, only prompt positions ``start .. end - 1`` (a chunk: a long
        prompt run in pieces between other work, in order, each chunk starting where the
        one before ended); the logits come with the chunk that ends the prompt, None before
        (:func:`smcspec.decoding.program.prefill_chunk`). Raises ValueError for a chunk out
        of range or out of order."""

    def decode(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """Append ``tokens`` (int64 ``[R, T]``) to the rows; logits ``[R, T or 1, V]`` (rows
        with the same history and tokens get equal logits, computed once).

        Raises:
            ContextLengthError: the cache is full.
        """

    def decode_batch(self, items: list[tuple[torch.Tensor, KVCache, bool]]) -> list[torch.Tensor]:
        """:meth:`decode` of several requests' ``(tokens, cache, last_only)`` in one forward."""


@dataclass
class LoadedModel:
    """A model ready to decode, with its tokenizer and where it came from.

    ``model`` is the backend's model (:class:`~smcspec.backends.base.DecoderModel`);
    ``tokenizer`` is a ``transformers`` tokenizer, or None for a llamacpp model loaded with
    ``tokenizer=False`` (a draft: only the target's tokenizer is used, and the pair's shared
    vocabulary is checked through llama.cpp); ``config`` is the architecture (torch backend
    only); ``vocab_size`` and ``context_length`` are what the engine needs from either
    backend.
    """

    model: DecoderModel
    tokenizer: object | None  # transformers.PreTrainedTokenizerBase
    path: Path
    config: ModelConfig | None
    name: str = ""  # the GGUF file's stem or the directory's name
    backend: str = "torch"
    vocab_size: int = 0
    context_length: int = 0

    def __post_init__(self) -> None:
        if self.config is not None:
            self.vocab_size = self.vocab_size or self.config.vocab_size
            self.context_length = self.context_length or self.config.max_position_embeddings
