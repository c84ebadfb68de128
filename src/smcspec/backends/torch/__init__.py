"""The torch backend: our PyTorch Llama-family transformer (CPUs and GPUs, Hugging Face
directories, GGUF files dequantized once) and the reference implementation the llamacpp
backend is checked against.

* :mod:`.transformer`: the model, prefill and ``[rows, tokens]`` decode.
* :mod:`.kv_cache`: the particle KV cache (shared prompt, per-row suffix, ``reorder``,
  ``truncate``).
* :mod:`.config`: the architecture read from ``config.json``.
* :mod:`.weights`: a Hugging Face directory loaded into the model.
"""

from smcspec.backends.torch.architecture import ModelConfig
from smcspec.backends.torch.kv_cache import ParticleKVCache
from smcspec.backends.torch.transformer import Transformer
from smcspec.backends.torch.weights import load_hf_dir

__all__ = ["ModelConfig", "ParticleKVCache", "Transformer", "load_hf_dir"]
