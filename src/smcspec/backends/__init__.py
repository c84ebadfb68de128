"""Backends: who computes a forward. ``torch`` (:mod:`.torch`, the reference Llama-family
transformer, CPUs and GPUs) and ``llamacpp`` (:mod:`.llamacpp`, GGUF files through
llama.cpp's quantized kernels). Both offer :class:`~smcspec.backends.base.DecoderModel`;
:func:`smcspec.models.load_model` picks one for a model file."""

from smcspec.backends.base import DecoderModel, KVCache

__all__ = ["DecoderModel", "KVCache"]
