"""A fitted draft: a base draft plus a LoRA adapter (``smcspec distill``'s output), loaded by
both backends from one folder.

The folder holds ``manifest.json`` (``"kind": "smcspec-fitted-draft"``: the base draft's
name and SHA-256, the adapter file's SHA-256, how it was fitted) and ``draft-lora.gguf``, the
adapter in llama.cpp's LoRA format (``general.type = adapter``; tensors
``blk.<i>.<name>.weight.lora_a`` of shape ``[r, in]`` and ``.lora_b`` of ``[out, r]``; the
update ``(alpha / r) B A``, Hu et al. 2021). The llamacpp backend applies it to the base GGUF
at load (:class:`~smcspec.backends.llamacpp.LlamaCppSettings` ``lora``); the torch backend
loads a Hugging Face folder with the update merged into the base's weights, made once in the
cache (:func:`merged_hf_dir`). The base is the default pair's draft when the SHA-256 says so,
else the manifest's path, hashed and compared before use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from smcspec.errors import ModelFileError

KIND = "smcspec-fitted-draft"
MANIFEST = "manifest.json"
ADAPTER = "draft-lora.gguf"
GGUF_MODULES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def is_fitted_draft(path: Path) -> bool:
    """Whether ``path`` is a folder holding a fitted draft's manifest."""
    m = Path(path) / MANIFEST
    if not m.is_file():
        return False
    try:
        return json.loads(m.read_text()).get("kind") == KIND
    except (OSError, ValueError, AttributeError):
        return False


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a fitted draft, its adapter file checked against its SHA-256.

    Raises:
        ModelFileError: no manifest, not a fitted draft's, no adapter file, or an adapter
            whose SHA-256 differs from the manifest's.
    """
    from smcspec.models.gguf_convert import sha256_file

    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"cannot read {folder / MANIFEST}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
        raise ModelFileError(f"{folder / MANIFEST} is not a fitted draft's manifest")
    adapter = folder / manifest.get("adapter", {}).get("file", ADAPTER)
    if not adapter.is_file():
        raise ModelFileError(f"the fitted draft {folder} has no adapter file {adapter.name}")
    digest = sha256_file(adapter)
    expected = manifest["adapter"].get("sha256")
    if digest != expected:
        raise ModelFileError(
            f"{adapter} has SHA-256 {digest}, the manifest says {expected}: refusing an altered "
            "adapter"
        )
    return manifest


def adapter_path(folder: Path, manifest: dict[str, Any]) -> Path:
    """The adapter GGUF of a fitted draft."""
    return Path(folder) / manifest["adapter"].get("file", ADAPTER)


def base_path(manifest: dict[str, Any], root: Path) -> Path:
    """The base draft's file: the default pair's draft (assembled and verified from its
    packages into the cache ``root``) when the SHA-256 is its, else the manifest's path,
    verified by hashing.

    Raises:
        ModelFileError: the base is missing or its SHA-256 differs.
    """
    from smcspec.models.default_pair import DEFAULT_DRAFT, ensure_packaged_model
    from smcspec.models.gguf_convert import sha256_file

    base = manifest.get("base", {})
    if base.get("sha256") == DEFAULT_DRAFT.sha256:
        return ensure_packaged_model(DEFAULT_DRAFT, root)
    p = Path(base.get("path", ""))
    if not p.exists():
        raise ModelFileError(
            f"the fitted draft's base {base.get('name')!r} is not at {p} (the adapter only "
            "holds the update; the base draft it was fitted on is needed)"
        )
    digest = sha256_file(p) if p.is_file() else dir_fingerprint(p)
    if digest != base.get("sha256"):
        raise ModelFileError(f"{p} is not the base the draft was fitted on (SHA-256 differs)")
    return p


def dir_fingerprint(p: Path) -> str:
    """SHA-256 of a Hugging Face folder's ``config.json`` and its weight files' names and
    sizes (a cheap identity; the weights themselves are not hashed)."""
    import hashlib

    h = hashlib.sha256()
    cfg = Path(p) / "config.json"
    h.update(cfg.read_bytes() if cfg.is_file() else b"")
    for f in sorted(Path(p).glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()


def read_adapter(path: Path) -> tuple[str, float, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """``(architecture, alpha, {gguf base tensor name: (A [r, in], B [out, r])})`` of a
    llama.cpp LoRA GGUF, float32.

    Raises:
        ModelFileError: not a readable LoRA adapter GGUF.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    except Exception as exc:  # gguf raises many types on a corrupt file
        raise ModelFileError(f"{path} is not a readable GGUF file: {exc}") from exc
    if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
        raise ModelFileError(f"{path} is not a LoRA adapter GGUF")
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        base, _, part = t.name.rpartition(".")
        shape = tuple(int(s) for s in reversed(t.shape))
        pairs.setdefault(base, {})[part] = np.asarray(t.data, dtype=np.float32).reshape(shape)
    out = {}
    for base, p in pairs.items():
        if set(p) != {"lora_a", "lora_b"}:
            raise ModelFileError(f"{path}: {base} lacks lora_a or lora_b")
        out[base] = (p["lora_a"], p["lora_b"])
    return str(fields["general.architecture"]), float(fields.get("adapter.lora.alpha", 0.0)), out


def lora_scale(alpha: float, rank: int) -> float:
    """llama.cpp's and PEFT's update scale: ``alpha / rank`` (1 when alpha is 0)."""
    return alpha / rank if alpha else 1.0


def hf_weight_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.

    Raises:
        ModelFileError: a tensor the adapter format does not cover here.
    """
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in GGUF_MODULES:
        raise ModelFileError(f"a LoRA update of {gguf_name} is not supported")
    return f"model.layers.{parts[1]}.{GGUF_MODULES[parts[2]]}.weight"


def merged_hf_dir(folder: Path, manifest: dict[str, Any], root: Path) -> Path:
    """A Hugging Face folder of the fitted draft: the base converted
    (:func:`smcspec.models.gguf_convert.converted_dir`) with ``scale * B @ A`` added to each
    adapted weight (q/k rows un-permuted for ``llama`` files as the conversion does), made
    once in ``root/fitted/`` keyed by the adapter's SHA-256."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from smcspec.models.gguf_convert import _unpermute, converted_dir

    out = root / "fitted" / f"{manifest.get('name', 'draft')}-{manifest['adapter']['sha256'][:16]}"
    if (out / "config.json").is_file():
        return out
    base = base_path(manifest, root)
    if base.is_file():
        base_dir = converted_dir(base, root, sha256=manifest["base"]["sha256"])
    else:
        base_dir = base
    arch, alpha, pairs = read_adapter(adapter_path(folder, manifest))
    cfg = json.loads((base_dir / "config.json").read_text())
    tensors = {}
    for f in sorted(base_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for name, (a, b) in pairs.items():
        delta = lora_scale(alpha, a.shape[0]) * (b.astype(np.float64) @ a.astype(np.float64))
        if arch == "llama" and ".attn_q." in name:
            delta = _unpermute(delta, cfg["num_attention_heads"])
        elif arch == "llama" and ".attn_k." in name:
            delta = _unpermute(delta, cfg["num_key_value_heads"])
        key = hf_weight_name(name)
        tensors[key] = tensors[key] + torch.from_numpy(delta.astype(np.float32))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base_dir, tmp, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file(tensors, str(tmp / "model.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
