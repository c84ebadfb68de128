"""Tiny random Llama/Qwen2 models (and GGUF files made from them) for tests.

Everything is built locally from seeded random weights; nothing is downloaded.

* :func:`make_tiny_hf_model` writes a Hugging Face directory (``config.json``,
  ``model.safetensors``, a byte-level BPE ``tokenizer.json``) that ``smcspec.models.load_hf_dir``
  and ``transformers.AutoModelForCausalLM.from_pretrained`` both load.
* :func:`make_tiny_gguf` writes the same weights as a llama.cpp GGUF file (q/k permuted for
  the ``llama`` architecture, as ``convert_hf_to_gguf.py`` does) with byte-level BPE tokenizer
  metadata that ``transformers`` can turn back into a tokenizer.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

EOS_TOKEN = "<|im_end|>"

DEFAULTS = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA: 2 query heads per kv head
    "intermediate_size": 128,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
}
FAMILY_DEFAULTS = {
    "llama": {"rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False},
    "qwen2": {"rope_theta": 123456.0, "tie_word_embeddings": True},
}


def tiny_config(family: str, vocab_size: int = 96, **overrides):
    """A transformers ``LlamaConfig``/``Qwen2Config`` for a tiny GQA model."""
    from transformers import LlamaConfig, Qwen2Config

    if family not in FAMILY_DEFAULTS:
        raise ValueError(f"unknown family {family!r}")
    kwargs = {**DEFAULTS, **FAMILY_DEFAULTS[family], **overrides, "vocab_size": vocab_size}
    eos_id = vocab_size - 1
    kwargs.setdefault("eos_token_id", eos_id)
    kwargs.setdefault("bos_token_id", None)
    cls = LlamaConfig if family == "llama" else Qwen2Config
    return cls(**kwargs)


def init_weights(model: torch.nn.Module, seed: int, zero_o_bias: bool = False) -> None:
    """Seeded init, scaled so that attention and next-token distributions are far from uniform.

    Linear weights ~ N(0, 0.2^2), embeddings ~ N(0, 1), biases ~ N(0, 0.1^2), norm weights
    ~ 1 + N(0, 0.1^2) (so a norm weight that is not loaded changes the logits).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif "embed_tokens" in name:
                val = torch.randn(p.shape, generator=gen)
            elif name.endswith(".bias"):
                val = 0.1 * torch.randn(p.shape, generator=gen)
                if zero_o_bias and "o_proj" in name:
                    val.zero_()
            else:
                val = 0.2 * torch.randn(p.shape, generator=gen)
            p.copy_(val.to(p.dtype))


def build_tiny_hf_model(family: str, vocab_size: int = 96, seed: int = 0, **overrides):
    """An in-memory float32 ``*ForCausalLM`` with seeded weights (see :func:`init_weights`).

    ``zero_o_bias=True`` (llama with ``attention_bias``) sets the o_proj bias to zero.
    """
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    zero_o_bias = overrides.pop("zero_o_bias", False)
    cfg = tiny_config(family, vocab_size, **overrides)
    cls = LlamaForCausalLM if family == "llama" else Qwen2ForCausalLM
    torch.manual_seed(seed)  # the constructor's own init is overwritten below anyway
    model = cls(cfg).to(torch.float32).eval()
    init_weights(model, seed, zero_o_bias=zero_o_bias)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def bpe_vocab(vocab_size: int, extra: str = "") -> tuple[list[str], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of exactly ``vocab_size`` tokens and its merges.

    Ids: 0-25 the letters ``a``-``z``, 26 ``\u0120`` (a space in the GPT-2 byte alphabet),
    then two-letter merges (``aa``, ``bb``, ...), and the eos token ``<|im_end|>`` at
    ``vocab_size - 1``. Every token but eos is spelled in the GPT-2 byte alphabet.
    ``extra``: printable ASCII characters added as tokens after the space (e.g. JSON
    punctuation and digits for the structured-output tests); the default adds none.
    """
    letters = [chr(ord("a") + i) for i in range(26)]
    merges: list[tuple[str, str]] = []
    if vocab_size < 29:  # tiny vocabularies: letters and one merge (llama.cpp needs merges)
        tokens = letters[: vocab_size - 2] + [letters[0] + letters[1]]
        return tokens + [EOS_TOKEN], [(letters[0], letters[1])]
    tokens = letters + ["\u0120"] + [c for c in dict.fromkeys(extra) if c not in letters]
    i = 0
    while len(tokens) < vocab_size - 1:
        a, b = letters[i % 26], letters[(i // 26 + i) % 26]
        if a + b not in tokens:
            tokens.append(a + b)
            merges.append((a, b))
        i += 1
    return tokens + [EOS_TOKEN], merges


def make_tokenizer(vocab_size: int, extra: str = ""):
    """A byte-level BPE ``PreTrainedTokenizerFast`` over :func:`bpe_vocab` (eos = ``V-1``).

    Byte-level BPE (not word-level) because ``AutoTokenizer`` loads a ``qwen2`` directory
    with ``Qwen2Tokenizer``, which rebuilds a byte-level BPE from ``tokenizer.json``'s
    vocabulary and merges. pad/unk are the eos token so no token beyond ``V`` is added.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens, merges = bpe_vocab(vocab_size, extra)
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, unk_token=EOS_TOKEN
    )


def make_tiny_hf_model(
    tmp_path: Path,
    family: str,
    vocab_size: int = 96,
    seed: int = 0,
    extra_tokens: str = "",
    **overrides,
) -> Path:
    """Save a tiny random model plus a working tokenizer under ``tmp_path``; return the dir.

    Args:
        family: ``"llama"`` or ``"qwen2"``.
        overrides: transformers config fields (``tie_word_embeddings``, ``attention_bias``,
            ``rope_theta``, ...) and ``zero_o_bias`` (see :func:`build_tiny_hf_model`).
    """
    model = build_tiny_hf_model(family, vocab_size, seed, **overrides)
    tag = "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
    tag += "-json" if extra_tokens else ""
    tag = re.sub(r"[^\w=.-]+", "_", tag)  # e.g. rope_parameters={...}
    out = Path(tmp_path) / f"{family}-v{vocab_size}-s{seed}{tag}"
    out.mkdir(parents=True, exist_ok=False)
    model.save_pretrained(str(out), safe_serialization=True)
    make_tokenizer(vocab_size, extra_tokens).save_pretrained(str(out))
    return out


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def make_tiny_chat_pair(tmp_path: Path, **overrides) -> list[Path]:
    """Target (seed 0) and draft (seed 1) tiny qwen2 models saved under ``tmp_path`` whose
    tokenizers carry :data:`CHAT_TEMPLATE` (message contents joined by spaces)."""
    from transformers import AutoTokenizer

    dirs = [make_tiny_hf_model(tmp_path, "qwen2", seed=s, **overrides) for s in (0, 1)]
    for d in dirs:
        tok = AutoTokenizer.from_pretrained(str(d))
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(str(d))
    return dirs


TOOL_CHAT_TEMPLATE = (
    "{% for t in tools or [] %}{{ t | tojson }}\n{% endfor %}"
    "{% for m in messages %}{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %} {% endfor %}"
)
"""A chat template that renders ``tools`` (each as JSON) and assistant calls in the
``<tool_call>`` form of Qwen2.5's template (what :func:`smcspec.chat.check_tool_template`
requires), message contents joined by spaces."""


def make_tiny_tool_chat_pair(tmp_path: Path, **overrides) -> list[Path]:
    """Target (seed 0) and draft (seed 1) tiny qwen2 models of 64 tokens for tool calls: the
    BPE letters, JSON punctuation and a newline, eos ``<|im_end|>`` at 61, and
    ``<tool_call>``/``</tool_call>`` added at 62 and 63 (as Qwen2.5's vocabulary has them),
    with :data:`TOOL_CHAT_TEMPLATE`."""
    tok = make_tokenizer(62, extra='{}":,[]_\u010a`')
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = TOOL_CHAT_TEMPLATE
    dirs = []
    for seed in (0, 1):
        model = build_tiny_hf_model("qwen2", vocab_size=64, seed=seed, eos_token_id=61, **overrides)
        out = Path(tmp_path) / f"tools-qwen2-s{seed}"
        model.save_pretrained(str(out), safe_serialization=True)
        tok.save_pretrained(str(out))
        dirs.append(out)
    return dirs


# ---------------------------------------------------------------------------------- GGUF
def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp ``convert_hf_to_gguf.LlamaModel.permute`` for q (n_head) / k (n_kv_head)."""
    dim = w.shape[0]
    return w.reshape(n_head, 2, dim // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_tensor_name(hf_name: str) -> str:
    """Hugging Face tensor name -> llama.cpp GGUF tensor name."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")  # model.layers.{i}.{module...}.{weight|bias}
    assert parts[:2] == ["model", "layers"], hf_name
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{_GGUF_NAMES[module]}.{parts[-1]}"


def make_tiny_gguf(
    tmp_path: Path,
    family: str,
    vocab_size: int = 96,
    seed: int = 0,
    q8_0: bool = False,
    chat_template: str | None = None,
    **overrides,
):
    """Write a GGUF file of a tiny random model; return ``(gguf_path, hf_model)``.

    The GGUF holds the weights of ``hf_model`` (the in-memory float32 transformers model,
    see :func:`build_tiny_hf_model` for ``overrides``) as F32. With ``q8_0=True`` the 2-D
    ``blk.*`` matrices are stored as Q8_0 (embeddings, output, norms and biases stay F32) and
    ``hf_model`` gets their dequantized values, so it stays the exact reference. ``llama`` q/k
    weights and biases are permuted like llama.cpp's ``convert_hf_to_gguf.py`` does;
    ``qwen2`` tensors are stored as they are. Tokenizer metadata: byte-level BPE
    (``tokenizer.ggml.model = gpt2``) over :func:`bpe_vocab`, eos = bos = ``V-1`` (CONTROL).
    """
    import gguf
    from gguf.quants import dequantize, quantize

    model = build_tiny_hf_model(family, vocab_size, seed, **overrides)
    cfg = model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    tag = re.sub(r"[^\w=.-]+", "_", "".join(f"-{k}={v}" for k, v in sorted(overrides.items())))
    path = Path(tmp_path) / f"tiny-{family}-s{seed}{'-q8_0' if q8_0 else ''}{tag}.gguf"
    writer = gguf.GGUFWriter(str(path), family)
    writer.add_name(f"tiny-{family}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(cfg.hidden_size // n_head)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8_0 else gguf.LlamaFileType.ALL_F32)

    tokens, merges = bpe_vocab(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if family == "qwen2" else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (vocab_size - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges([f"{a} {b}" for a, b in merges])
    writer.add_eos_token_id(vocab_size - 1)
    writer.add_bos_token_id(vocab_size - 1)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    state = model.state_dict()  # shares storage with the parameters
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp omits output.weight for tied embeddings
        arr = tensor.detach().to(torch.float32).numpy().copy()
        if family == "llama" and ".q_proj." in name:
            arr = llamacpp_permute(arr, n_head)
        elif family == "llama" and ".k_proj." in name:
            arr = llamacpp_permute(arr, n_kv)
        gname = gguf_tensor_name(name)
        if q8_0 and arr.ndim == 2 and gname.startswith("blk."):
            q8 = gguf.GGMLQuantizationType.Q8_0
            qarr = quantize(arr, q8)
            # Give the reference model the weights the file really holds. Q8_0 blocks run along
            # rows, so quantizing commutes with llama.cpp's row permutation of q/k.
            roundtrip = dequantize(quantize(tensor.detach().numpy(), q8), q8)
            if family == "llama" and ".q_proj." in name:
                assert np.array_equal(llamacpp_permute(roundtrip, n_head), dequantize(qarr, q8))
            tensor.copy_(torch.from_numpy(roundtrip))
            writer.add_tensor(gname, qarr, raw_dtype=q8)
        else:
            writer.add_tensor(gname, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model


def make_tiny_gguf_chat_engine(tmp_path: Path, llamacpp=None, **overrides):
    """An Engine over a tiny qwen2 GGUF target (seed 0) and draft (seed 1) with
    :data:`CHAT_TEMPLATE`, run by the llamacpp backend (tokenizers cached under ``tmp_path``);
    ``llamacpp``: its :class:`LlamaCppSettings` (default: 1 thread, 131072 KV cells).
    """
    import os

    from smcspec import Engine
    from smcspec.backends.llamacpp import LlamaCppSettings
    from smcspec.models import load_model

    settings = llamacpp or LlamaCppSettings(threads=1, kv_cells=131072)
    paths = [
        make_tiny_gguf(tmp_path, "qwen2", 96, seed=s, chat_template=CHAT_TEMPLATE, **overrides)[0]
        for s in (0, 1)
    ]
    # a module-scoped fixture runs before the per-test cache is set: the tokenizer goes to a
    # cache under tmp_path for the load only (a lasting os.environ change once sent the real
    # pair's tests, later in the session, to convert multi-GB models into a temporary folder)
    with pytest.MonkeyPatch.context() as mp:
        if "SMCSPEC_CACHE" not in os.environ:
            mp.setenv("SMCSPEC_CACHE", str(Path(tmp_path) / "cache"))
        target = load_model(paths[0], backend="llamacpp", llamacpp=settings)
        # as Engine.load does: the draft without a tokenizer, the vocabulary checked in llama.cpp
        draft = load_model(paths[1], backend="llamacpp", llamacpp=settings, tokenizer=False)
    return Engine(target, draft)


def make_tiny_chat_engine(backend: str, tmp_path: Path, **overrides):
    """An Engine over the tiny chat pair on ``backend``: ``"torch"``
    (:func:`make_tiny_chat_pair`, the HF files loaded by the torch backend) or
    ``"llamacpp"`` (:func:`make_tiny_gguf_chat_engine`; skips the test without
    llama-cpp-python). ``overrides``: the models' config (e.g. ``max_position_embeddings``)."""
    from smcspec import Engine
    from smcspec.backends.torch import load_hf_dir

    if backend == "llamacpp":
        pytest.importorskip("llama_cpp")
        return make_tiny_gguf_chat_engine(tmp_path, **overrides)
    dirs = make_tiny_chat_pair(tmp_path, **overrides)
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))
