"""Model files: the default pair from PyPI packages, GGUF reading and conversion, draft
re-quantization, and loading a file on the backend that runs it (:mod:`smcspec.backends`)."""

from smcspec.models.loading import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
