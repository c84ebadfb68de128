"""Load a model from a Hugging Face directory or a GGUF file.

A GGUF file is converted once into a Hugging Face-style directory in the cache
(``config.json``, ``model.safetensors`` with dequantized float32 weights, tokenizer files
with the chat template); every later start loads that directory. Weight reading uses
``safetensors`` and ``gguf``; tokenizers come from ``transformers``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from smcspec.errors import ModelFileError
from smcspec.models.config import ModelConfig
from smcspec.models.transformer import Transformer, rope_inv_freq

if TYPE_CHECKING:
    from smcspec.backends.base import DecoderModel
    from smcspec.backends.llamacpp import LlamaCppSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


BACKENDS = ("auto", "torch", "llamacpp")


@dataclass
class LoadedModel:
    """A model ready to decode, with its tokenizer and where it came from.

    ``model`` is the backend's model (:class:`~smcspec.backends.base.DecoderModel`);
    ``config`` is the architecture (torch backend only); ``vocab_size`` and
    ``context_length`` are what the engine needs from either backend.
    """

    model: DecoderModel
    tokenizer: object  # transformers.PreTrainedTokenizerBase
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


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32"|"bfloat16"|"float16"`` -> torch dtype. Raises :class:`ConfigError`."""
    from smcspec.errors import ConfigError

    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[name]


def cache_root() -> Path:
    """``$SMCSPEC_CACHE`` or ``~/.cache/smcspec``."""
    return Path(os.environ.get("SMCSPEC_CACHE") or Path.home() / ".cache" / "smcspec")


def resolve_backend(backend: str, path: Path, device: str | torch.device) -> str:
    """``auto`` -> ``llamacpp`` for a GGUF file on the CPU when llama-cpp-python is
    installed, else ``torch``. Raises :class:`ConfigError` for a backend that cannot run it.
    """
    from smcspec.errors import ConfigError

    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    on_cpu = str(device) == "cpu"
    if backend == "auto":
        import importlib.util

        has_llamacpp = importlib.util.find_spec("llama_cpp") is not None
        return "llamacpp" if path.is_file() and on_cpu and has_llamacpp else "torch"
    if backend == "llamacpp" and not path.is_file():
        raise ConfigError(f"the llamacpp backend runs GGUF files; {path} is a directory")
    if backend == "llamacpp" and not on_cpu:
        raise ConfigError("the llamacpp backend runs on the CPU here; use --backend torch")
    return backend


def load_model(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    sha256: str | None = None,
    backend: str = "auto",
    llamacpp: LlamaCppSettings | None = None,
) -> LoadedModel:
    """Load a GGUF file or a Hugging Face directory on a backend.

    Args:
        path: a ``.gguf`` file or a directory with ``config.json``, ``*.safetensors`` and
            ``tokenizer.json``.
        dtype: weight/compute dtype of the torch backend (``float32`` default; ``bfloat16``
            for GPUs); the llamacpp backend computes with the file's own types.
        device: ``cpu`` or ``cuda[:i]``.
        sha256: for a GGUF file, its known SHA-256 (skips hashing it again for the cache key).
        backend: ``auto`` (see :func:`resolve_backend`), ``torch`` or ``llamacpp``.
        llamacpp: settings of the llamacpp backend (threads, KV cells, sequences).
    Raises:
        ModelFileError: missing, truncated or unsupported files. ConfigError: a backend
        that cannot run this file here.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(f"model path does not exist: {p}")
    name = p.stem if p.is_file() else p.name
    if resolve_backend(backend, p, device) == "llamacpp":
        return _load_llamacpp(p, sha256, llamacpp)
    if p.is_file():
        from smcspec.models.gguf_convert import converted_dir

        p = converted_dir(p, cache_root(), sha256=sha256)
    loaded = load_hf_dir(p, dtype, device)
    loaded.name = name
    return loaded


def _load_llamacpp(path: Path, sha256: str | None, settings) -> LoadedModel:
    from transformers import AutoTokenizer

    from smcspec.backends.llamacpp import LlamaCppModel
    from smcspec.models.gguf_convert import tokenizer_dir

    tok_dir = tokenizer_dir(path, cache_root(), sha256=sha256)
    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
    except Exception as exc:
        raise ModelFileError(f"cannot load the tokenizer of {path}: {exc}") from exc
    model = LlamaCppModel(path, settings)
    return LoadedModel(
        model=model,
        tokenizer=tok,
        path=path,
        config=None,
        name=path.stem,
        backend="llamacpp",
        vocab_size=model.n_vocab,
        context_length=model.context_length,
    )


def load_hf_dir(
    directory: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Load a Hugging Face model directory (safetensors weights). See :func:`load_model`."""
    from transformers import AutoTokenizer

    directory = Path(directory)

    dt = resolve_dtype(dtype)
    cfg_file = directory / "config.json"
    if not cfg_file.is_file():
        raise ModelFileError(f"{directory} has no config.json")
    try:
        cfg = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError as exc:
        raise ModelFileError(f"{cfg_file} is not valid JSON: {exc}") from exc
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{directory} has no *.safetensors weight files")
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model = model.to(dt)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)  # float32 buffer, not cast to dtype
    load_weights(model, files)
    model.eval()
    try:
        tok = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # transformers raises many types for a bad tokenizer dir
        raise ModelFileError(f"cannot load the tokenizer in {directory}: {exc}") from exc
    return LoadedModel(model=model, tokenizer=tok, path=directory, config=cfg, name=directory.name)


def _hf_names(i: int) -> dict[str, str]:
    pre = f"model.layers.{i}."
    return {
        "q": pre + "self_attn.q_proj",
        "k": pre + "self_attn.k_proj",
        "v": pre + "self_attn.v_proj",
        "o": pre + "self_attn.o_proj.weight",
        "gate": pre + "mlp.gate_proj.weight",
        "up": pre + "mlp.up_proj.weight",
        "down": pre + "mlp.down_proj.weight",
        "attn_norm": pre + "input_layernorm.weight",
        "mlp_norm": pre + "post_attention_layernorm.weight",
    }


def load_weights(model: Transformer, files: list[Path]) -> None:
    """Copy Hugging Face-named tensors from safetensors ``files`` into ``model``.

    q/k/v and gate/up are fused on the fly; one tensor is in memory at a time beside the
    model. Raises :class:`ModelFileError` for a missing tensor or a shape mismatch.
    """
    handles = {}
    index: dict[str, object] = {}
    try:
        for f in files:
            h = safe_open(str(f), framework="pt", device="cpu")
            handles[f] = h
            for k in h.keys():
                index[k] = h
    except Exception as exc:
        raise ModelFileError(f"cannot read safetensors file: {exc}") from exc

    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        used.add(name)
        if name not in index:
            raise ModelFileError(f"weight {name!r} missing from {', '.join(map(str, files))}")
        return index[name].get_tensor(name)

    def put(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
        if dst.shape != src.shape:
            raise ModelFileError(f"weight {name}: shape {tuple(src.shape)} != {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(src)

    cfg = model.cfg
    put(model.embed.weight, get("model.embed_tokens.weight"), "embed_tokens")
    put(model.norm.weight, get("model.norm.weight"), "norm")
    if not cfg.tie_word_embeddings:
        name = "lm_head.weight" if "lm_head.weight" in index else "model.embed_tokens.weight"
        put(model.lm_head.weight, get(name), name)
    for i, blk in enumerate(model.layers):
        n = _hf_names(i)
        qkv_w = torch.cat([get(n[x] + ".weight") for x in "qkv"])
        put(blk.qkv.weight, qkv_w, f"layer {i} qkv")
        if cfg.qkv_bias:
            put(blk.qkv.bias, torch.cat([get(n[x] + ".bias") for x in "qkv"]), f"layer {i} bias")
        put(blk.o.weight, get(n["o"]), n["o"])
        if cfg.o_bias:
            bias = n["o"].replace(".weight", ".bias")
            put(blk.o.bias, get(bias), bias)
        put(blk.gate_up.weight, torch.cat([get(n["gate"]), get(n["up"])]), f"layer {i} gate_up")
        put(blk.down.weight, get(n["down"]), n["down"])
        put(blk.attn_norm.weight, get(n["attn_norm"]), n["attn_norm"])
        put(blk.mlp_norm.weight, get(n["mlp_norm"]), n["mlp_norm"])
    ignorable = ("rotary_emb.inv_freq", "lm_head.weight")
    unused = sorted(k for k in index if k not in used and not k.endswith(ignorable))
    if unused:
        raise ModelFileError(
            f"{len(unused)} weights in the checkpoint are not used by this architecture "
            f"(e.g. {unused[0]!r}); refusing to load a model it would compute wrongly"
        )
