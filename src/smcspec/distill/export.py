"""Stage 3 of ``smcspec distill``: the fitted adapter as a draft both backends load.

``OUT/draft/`` (:mod:`smcspec.models.fitted_draft` reads it):

* ``draft-lora.gguf``: the adapter in llama.cpp's LoRA format (float16; llama.cpp applies it
  to the base GGUF at load, and the torch backend merges it into the base's weights);
* ``adapter_model.safetensors`` and ``adapter_config.json``: the same adapter as PEFT saves it
  (float32), for ``transformers`` users;
* ``manifest.json``: the base draft's and the target's SHA-256, the objective, the data's
  sources and domain shares, the training's tokens, time and peak memory, and the
  validation figures before and after.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from smcspec.distill.teacher import TEACHER_META, read_records
from smcspec.distill.training import (
    CHECKPOINT,
    TARGET_MODULES,
    VALIDATION,
    draft_source,
    read_checkpoint_state,
)
from smcspec.errors import ConfigError
from smcspec.models.fitted_draft import ADAPTER, GGUF_MODULES, KIND, MANIFEST

DRAFT_DIR = "draft"
_HF_TO_GGUF = {hf.rsplit(".", 1)[-1]: g for g, hf in GGUF_MODULES.items()}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for ``llama`` files (the inverse of
    :func:`smcspec.models.gguf_convert._unpermute`)."""
    dim = w.shape[0]
    return w.reshape(n_head, 2, dim // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def lora_pairs(adapter: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """PEFT's adapter state dict -> ``{gguf base tensor name: (A [r, in], B [out, r])}``."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, t in adapter.items():
        # base_model.model.model.layers.{i}.{self_attn|mlp}.{q_proj|...}.lora_{A|B}.weight
        parts = key.split(".")
        i = parts.index("layers")
        layer, module, which = parts[i + 1], parts[i + 3], parts[i + 4]
        name = f"blk.{layer}.{_HF_TO_GGUF[module]}.weight"
        out.setdefault(name, {})[which] = t.float().numpy()
    return {name: (p["lora_A"], p["lora_B"]) for name, p in out.items()}


def write_adapter_gguf(path: Path, arch: str, alpha: float, pairs: dict, heads: tuple[int, int]):
    """Write a llama.cpp LoRA adapter GGUF (float16 tensors; see
    :mod:`smcspec.models.fitted_draft` for the format); ``heads``: the model's attention and
    KV head counts (``llama`` files store q/k rows permuted)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha))
    for name in sorted(pairs, key=_tensor_order):
        a, b = pairs[name]
        if arch == "llama" and ".attn_q." in name:
            b = _permute(b, heads[0])
        elif arch == "llama" and ".attn_k." in name:
            b = _permute(b, heads[1])
        w.add_tensor(name + ".lora_a", np.ascontiguousarray(a, dtype=np.float16))
        w.add_tensor(name + ".lora_b", np.ascontiguousarray(b, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tensor_order(name: str) -> tuple[int, str]:
    return int(name.split(".")[1]), name


def _validation_figures(out: Path) -> dict:
    """The first and the last validation pass, by domain."""
    path = out / VALIDATION
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return {}
    first, last = min(r["tokens"] for r in rows), max(r["tokens"] for r in rows)
    pick = {}
    for label, tokens in (("before", first), ("after", last)):
        pick[label] = {
            r["domain"]: {k: r[k] for k in ("d2", "kl", "tv", "acceptance", "positions")}
            for r in rows if r["tokens"] == tokens
        }  # fmt: skip
    pick["tokens"] = last
    return pick


def _data_summary(cfg) -> dict:
    records = read_records(cfg.teacher_dir)
    tokens: dict[str, int] = {}
    sources: dict[str, set[str]] = {}
    for r in records:
        if r.split == "train":
            tokens[r.domain] = tokens.get(r.domain, 0) + len(r.ids)
            sources.setdefault(r.domain, set()).add(r.source.split(" ")[0].split(":")[0])
    total = sum(tokens.values()) or 1
    meta = json.loads((cfg.teacher_dir / TEACHER_META).read_text())
    return {
        "answers": sum(r.split == "train" for r in records),
        "domain_tokens": tokens,
        "domain_shares": {d: round(n / total, 4) for d, n in tokens.items()},
        "sources": {d: sorted(s) for d, s in sources.items()},
        "teacher": {
            k: meta[k]
            for k in ("target", "target_sha256", "temperature", "top_k", "max_new_tokens", "seed")
        },  # fmt: skip
    }


def export(cfg, log: Callable[[str], None]) -> Path:
    """Write ``OUT/draft/`` from the finished checkpoint (see the module notes); return it.

    Raises:
        ConfigError: training has not finished in ``cfg.out``.
    """
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file

    from smcspec.models.gguf_convert import sha256_file

    state = read_checkpoint_state(cfg.out)
    if state is None or not state.get("done"):
        raise ConfigError(f"{cfg.out} holds no finished training; run the train stage first")
    adapter = load_file(str(Path(state["folder"]) / "adapter.safetensors"))
    base, base_sha = draft_source(cfg)
    arch, heads = _architecture(base)
    dest = cfg.out / DRAFT_DIR
    dest.mkdir(parents=True, exist_ok=True)
    pairs = lora_pairs(adapter)
    write_adapter_gguf(dest / ADAPTER, arch, cfg.lora_alpha, pairs, heads)
    save_file(adapter, str(dest / "adapter_model.safetensors"))
    LoraConfig(r=cfg.rank, lora_alpha=cfg.lora_alpha, target_modules=list(TARGET_MODULES),
               lora_dropout=0.0, bias="none").save_pretrained(str(dest))  # fmt: skip
    data = _data_summary(cfg)
    name = f"{base.stem if base.is_file() else base.name}-{cfg.objective}"
    manifest = {
        "kind": KIND,
        "version": 1,
        "name": name,
        "base": {
            "name": base.stem if base.is_file() else base.name,
            "sha256": base_sha,
            "path": str(base.resolve()),
        },  # fmt: skip
        "target": {"name": data["teacher"]["target"], "sha256": data["teacher"]["target_sha256"]},
        "adapter": {
            "file": ADAPTER,
            "sha256": sha256_file(dest / ADAPTER),
            "rank": cfg.rank,
            "lora_alpha": cfg.lora_alpha,
            "modules": list(TARGET_MODULES),
            "architecture": arch,
        },  # fmt: skip
        "objective": cfg.objective,
        "temperature": cfg.temperature,
        "data": data,
        "training": {
            "tokens": state["tokens"],
            "steps": state["step"],
            "seconds": round(state["seconds"], 1),
            "peak_rss_mib": round(state.get("peak_rss_mib", 0.0)),
            "lr": cfg.lr,
            "step_tokens": cfg.step_tokens,
            "seed": cfg.seed,
            "checkpoint": CHECKPOINT,
        },
        "validation": _validation_figures(cfg.out),
        "made": time.strftime("%Y-%m-%d"),
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"fitted draft {name} written to {dest}")
    return dest


def _architecture(base: Path) -> tuple[str, tuple[int, int]]:
    """The base's architecture name (llama.cpp's) and (attention heads, KV heads)."""
    if base.is_file():
        from gguf import GGUFReader

        r = GGUFReader(str(base))
        arch = str(r.fields["general.architecture"].contents())
        heads = int(r.fields[f"{arch}.attention.head_count"].contents())
        kv = r.fields.get(f"{arch}.attention.head_count_kv")
        return arch, (heads, int(kv.contents()) if kv is not None else heads)
    cfg = json.loads((base / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    return cfg["model_type"], (heads, int(cfg.get("num_key_value_heads", heads)))
