"""Model layer: the transformer, its particle KV cache, and loading."""

from smcspec.models.config import ModelConfig
from smcspec.models.kv_cache import ParticleKVCache
from smcspec.models.loading import LoadedModel, load_hf_dir, load_model
from smcspec.models.transformer import Transformer

__all__ = [
    "LoadedModel",
    "ModelConfig",
    "ParticleKVCache",
    "Transformer",
    "load_hf_dir",
    "load_model",
]
