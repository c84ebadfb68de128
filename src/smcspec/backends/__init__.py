"""Backends: who computes a forward. ``torch`` (the reference Llama-family transformer in
:mod:`smcspec.models`, CPUs and GPUs) and ``llamacpp`` (:mod:`.llamacpp`, GGUF files through
llama.cpp's quantized kernels). Both offer :class:`~smcspec.backends.base.DecoderModel`."""

from smcspec.backends.base import DecoderModel, KVCache

__all__ = ["DecoderModel", "KVCache"]
