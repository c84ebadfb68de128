"""Architecture hyper-parameters of a Llama-family decoder, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smcspec.errors import ModelFileError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer of the Llama family.

    Covers Llama 2/3 (incl. Llama 3.1 "llama3" RoPE scaling), Qwen2/Qwen2.5 (q/k/v bias),
    Mistral and SmolLM2: GQA, RoPE, RMSNorm, SwiGLU.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool
    o_bias: bool = False
    rope_scaling: dict[str, Any] | None = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a ``config.json`` dict (transformers 4.x or 5.x layout).

        Raises:
            ModelFileError: unsupported ``model_type`` or a missing required key.
        """
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelFileError(
                f"unsupported model_type {model_type!r}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            rope_params = cfg.get("rope_parameters") or {}
            rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
            rope_scaling = cfg.get("rope_scaling") or (
                rope_params if rope_params.get("rope_type", "default") != "default" else None
            )
            if cfg.get("mlp_bias"):
                raise ModelFileError("mlp_bias=True checkpoints are not supported")
            if rope_scaling is not None:
                kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
                if kind in (None, "default"):
                    rope_scaling = None
                elif kind != "llama3":
                    raise ModelFileError(f"unsupported RoPE scaling {kind!r} (supported: llama3)")
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rope_theta=rope_theta,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
                rope_scaling=dict(rope_scaling) if rope_scaling else None,
            )
        except KeyError as exc:
            raise ModelFileError(f"config.json lacks required key {exc.args[0]!r}") from exc
