"""Convert a GGUF file (llama.cpp) into a Hugging Face-style directory in the cache.

The tensors are read and dequantized with the ``gguf`` library, renamed to the Hugging
Face layout, written as float32 safetensors; the tokenizer (vocabulary, merges, special
tokens, chat template) is read from the GGUF metadata by ``transformers`` and saved beside
them. The result is keyed by the GGUF's SHA-256, so it is made once per file.

llama.cpp stores the q/k projections of ``llama``-architecture models permuted for its
interleaved RoPE; they are permuted back here (``qwen2`` files are stored unpermuted).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from smcspec.errors import ModelFileError

_ARCH_TO_HF = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}
_NAME_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
CONVERTER_VERSION = "1"


def sha256_file(path: Path, chunk: int = 1 << 23) -> str:
    """Hex SHA-256 of a file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def converted_dir(gguf_path: Path, root: Path, sha256: str | None = None) -> Path:
    """Return the cached HF directory for ``gguf_path``, converting it on first use."""
    return _built_once(gguf_path, root / "converted", sha256, convert_gguf)


def tokenizer_dir(gguf_path: Path, root: Path, sha256: str | None = None) -> Path:
    """The cached tokenizer files (vocabulary, merges, chat template) of a GGUF file, for
    backends that run the file itself; made once, keyed by the file's SHA-256."""
    return _built_once(gguf_path, root / "tokenizers", sha256, _save_tokenizer)


def _built_once(gguf_path: Path, parent: Path, sha256: str | None, build) -> Path:
    """``parent/<stem>-<sha16>-v<version>``, made by ``build(gguf_path, dir)`` on first use
    (in a temporary directory renamed when complete; a failed build leaves nothing)."""
    digest = sha256 or sha256_file(gguf_path)
    out = parent / f"{gguf_path.stem}-{digest[:16]}-v{CONVERTER_VERSION}"
    if (out / "DONE").is_file():
        return out
    parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        build(gguf_path, tmp)
        (tmp / "DONE").write_text(json.dumps({"source": str(gguf_path), "sha256": digest}))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp ``convert_hf_to_gguf`` q/k permutation (rows = heads * dim)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def gguf_hf_config(reader) -> dict:
    """A Hugging Face ``config.json`` dict from GGUF metadata. Raises ModelFileError."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCH_TO_HF:
        raise ModelFileError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCH_TO_HF)})"
        )

    def req(key: str):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelFileError(f"GGUF metadata lacks {arch}.{key}")
        return v

    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelFileError("GGUF file has no token_embd.weight tensor")
    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    head_dim = _field(reader, f"{arch}.attention.key_length")
    cfg = {
        "model_type": _ARCH_TO_HF[arch],
        "architectures": [
            {
                "llama": "LlamaForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "mistral": "MistralForCausalLM",
            }[arch]
        ],
        "vocab_size": int(names["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": int(req("feed_forward_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim) if head_dim else hidden // heads,
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(req("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if eos is not None:
        cfg["eos_token_id"] = int(eos)
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    return cfg


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write ``config.json``, ``model.safetensors`` and tokenizer files for a GGUF file.

    Raises:
        ModelFileError: the file is not a readable GGUF of a supported architecture.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from tqdm import tqdm

    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as exc:  # gguf raises ValueError/IndexError/... on corrupt files
        raise ModelFileError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc
    cfg = gguf_hf_config(reader)
    arch = _field(reader, "general.architecture")
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {gguf_path.name}", unit="tensor"):
        try:
            arr = dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelFileError(
                f"cannot dequantize tensor {t.name} of {gguf_path}: {exc}"
            ) from exc
        arr = np.asarray(arr, dtype=np.float32).reshape(tuple(int(s) for s in reversed(t.shape)))
        name = _hf_name(t.name)
        if name is None:
            continue
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            arr = _unpermute(arr, cfg["num_attention_heads"])
        elif arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            arr = _unpermute(arr, cfg["num_key_value_heads"])
        tensors[name] = torch.tensor(arr)  # copy: the reader memory-maps the file
    save_file(tensors, str(out_dir / "model.safetensors"))
    del tensors
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    _save_tokenizer(gguf_path, out_dir)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _NAME_MAP:
        return f"model.layers.{parts[1]}.{_NAME_MAP[parts[2]]}.{parts[3]}"
    return None  # e.g. rope_freqs: recomputed from the config


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:
        raise ModelFileError(f"cannot read the tokenizer from {gguf_path}: {exc}") from exc
    tok.save_pretrained(str(out_dir))
