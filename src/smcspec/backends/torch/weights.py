"""The torch backend's weights: a Hugging Face directory (``config.json``, safetensors,
``tokenizer.json``) loaded into a :class:`~smcspec.backends.torch.transformer.Transformer`.

Weights are read with ``safetensors``, one tensor at a time; tokenizers come from
``transformers``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from smcspec.backends.base import LoadedModel
from smcspec.backends.torch.architecture import ModelConfig
from smcspec.backends.torch.transformer import Transformer, rope_inv_freq
from smcspec.errors import ConfigError, ModelFileError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32"|"bfloat16"|"float16"`` -> torch dtype. Raises :class:`ConfigError`."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[name]


def load_hf_dir(
    directory: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Load a Hugging Face model directory (safetensors weights) on the torch backend.

    See :func:`smcspec.models.load_model` for the arguments. Raises :class:`ModelFileError`
    for a missing ``config.json``, weights or tokenizer, and :class:`ConfigError` for an
    unknown dtype.
    """
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
    model = empty_model(cfg, dt, device)
    load_weights(model, files)
    model.eval()
    try:
        tok = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # transformers raises many types for a bad tokenizer dir
        raise ModelFileError(f"cannot load the tokenizer in {directory}: {exc}") from exc
    return LoadedModel(model=model, tokenizer=tok, path=directory, config=cfg, name=directory.name)


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> Transformer:
    """A :class:`Transformer` of ``cfg`` allocated on ``device`` in ``dtype``, its weights
    uninitialised (built on the meta device, so nothing is allocated twice); tied embeddings
    tied, the RoPE frequencies a float32 buffer."""
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)  # cast on meta: the device holds only `dtype`
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)  # float32 buffer, not cast to dtype
    return model


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
