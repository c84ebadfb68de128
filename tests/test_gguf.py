"""GGUF loading: tiny GGUF files written here with gguf.GGUFWriter, loaded by smcspec.

The files are made like llama.cpp's ``convert_hf_to_gguf.py`` makes them (``llama`` q/k
rows permuted for llama.cpp's RoPE, ``qwen2`` stored as is), from a seeded random
transformers model, which is the reference: smcspec's logits on the converted model must
match it to ``ATOL`` (float32; for the Q8_0 file the reference holds the dequantized
weights, so the same tolerance applies).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from tiny_models import EOS_TOKEN, llamacpp_permute, make_tiny_gguf

from smcspec.errors import ModelFileError
from smcspec.models import load_model

ATOL = 1e-4
RTOL = 1e-5
V = 96
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"

VARIANTS = {
    "llama-f32": ("llama", {}),
    "llama-f32-tied": ("llama", {"tie_word_embeddings": True}),
    # llama with q/k/v biases (o_proj bias zero): exercises the un-permutation of q/k biases
    "llama-f32-qkv-bias": ("llama", {"attention_bias": True, "zero_o_bias": True}),
    "llama-q8_0": ("llama", {"q8_0": True}),
    "qwen2-f32": ("qwen2", {}),
    "qwen2-q8_0-untied": ("qwen2", {"q8_0": True, "tie_word_embeddings": False}),
}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """variant -> (gguf path, reference transformers model); built lazily, once."""
    root = tmp_path_factory.mktemp("gguf")
    made: dict = {}

    def get(variant: str):
        if variant not in made:
            family, ov = VARIANTS[variant]
            made[variant] = make_tiny_gguf(
                root, family, V, seed=3, chat_template=CHAT_TEMPLATE, **ov
            )
        return made[variant]

    return get


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "smcspec-cache"
    monkeypatch.setenv("SMCSPEC_CACHE", str(d))
    return d


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


def _smc_logits(model, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """Logits ``[T - prefix + 1, V]`` after ``ids[:prefix]``, ..., after all of ``ids``."""
    cache = model.new_cache(1, ids.shape[0])
    first = model.prefill(ids[:prefix], cache)
    rest = model.decode(ids[prefix:][None], cache)[0]
    return torch.cat([first[None], rest])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_logits_match_original(gguf_files, cache_dir, variant):
    path, hf = gguf_files(variant)
    family, ov = VARIANTS[variant]
    lm = load_model(path, backend="torch")
    cfg = lm.config
    assert cfg.model_type == family
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (4, 2, 16, 2)
    assert cfg.vocab_size == V
    assert cfg.rope_theta == pytest.approx(hf.config.rope_parameters["rope_theta"])
    assert cfg.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps, rel=1e-6)
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert cfg.qkv_bias == (family == "qwen2" or ov.get("attention_bias", False))
    assert lm.path.is_relative_to(cache_dir)

    ids = _ids(13, seed=4)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    got = _smc_logits(lm.model, ids, prefix=5)
    torch.testing.assert_close(got, ref[4:], atol=ATOL, rtol=RTOL)


def test_llama_gguf_really_is_permuted(gguf_files):
    """Guards the test above: the stored q/k rows differ from the HF rows (so a missing or
    wrong un-permutation would change the logits), and undo to exactly them."""
    from gguf import GGUFReader

    path, hf = gguf_files("llama-f32-qkv-bias")
    reader = GGUFReader(str(path))
    t = {x.name: np.asarray(x.data) for x in reader.tensors}
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    for kind, hf_kind, heads in (("q", "q", 4), ("k", "k", 2)):
        for suffix in ("weight", "bias"):
            stored = t[f"blk.0.attn_{kind}.{suffix}"]
            orig = sd[f"model.layers.0.self_attn.{hf_kind}_proj.{suffix}"]
            assert stored.shape == orig.shape
            assert not np.array_equal(stored, orig)
            assert np.array_equal(stored, llamacpp_permute(orig, heads))


def test_gguf_tokenizer(gguf_files, cache_dir):
    path, _ = gguf_files("qwen2-f32")
    tok = load_model(path, backend="torch").tokenizer
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == V - 1
    # bpe_vocab: a..z = 0..25, "\u0120" (space) = 26, then merges "aa"=27, "bb"=28, ...
    assert tok("ab cd" + EOS_TOKEN, add_special_tokens=False).input_ids == [53, 26, 55, V - 1]
    assert tok.decode([53, 26, 55]) == "ab cd"
    assert tok.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False)
    assert text == "ab" + EOS_TOKEN


# --------------------------------------------------------------------------- corrupt
def _assert_model_file_error(path, cache_dir):
    with pytest.raises(ModelFileError):
        load_model(path, backend="torch")
    # a failed conversion leaves no (partial or finished) converted directory behind
    conv = cache_dir / "converted"
    assert not conv.exists() or list(conv.iterdir()) == []


def test_truncated_gguf_raises_model_file_error(gguf_files, cache_dir, tmp_path):
    path, _ = gguf_files("llama-f32")
    data = path.read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    _assert_model_file_error(half, cache_dir)


def test_gguf_missing_last_bytes_raises_model_file_error(gguf_files, cache_dir, tmp_path):
    path, _ = gguf_files("llama-f32")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    _assert_model_file_error(cut, cache_dir)


def test_random_bytes_raise_model_file_error(cache_dir, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    _assert_model_file_error(junk, cache_dir)


def test_gguf_header_only_raises_model_file_error(gguf_files, cache_dir, tmp_path):
    path, _ = gguf_files("llama-f32")
    head = tmp_path / "head.gguf"
    head.write_bytes(path.read_bytes()[:64])
    _assert_model_file_error(head, cache_dir)


def test_unsupported_architecture_raises_model_file_error(cache_dir, tmp_path):
    import gguf

    p = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(p), "phi2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_model_file_error(p, cache_dir)


def test_missing_path_raises_model_file_error(cache_dir, tmp_path):
    with pytest.raises(ModelFileError):
        load_model(tmp_path / "nope.gguf", backend="torch")


# ----------------------------------------------------------------------------- cache
def test_second_load_reuses_converted_cache(gguf_files, cache_dir):
    path, _ = gguf_files("qwen2-f32")
    first = load_model(path, backend="torch")
    st = first.path / "model.safetensors"
    assert st.is_file() and (first.path / "DONE").is_file()
    assert first.path.parent == cache_dir / "converted"
    mtime = st.stat().st_mtime_ns
    os.utime(st, ns=(mtime - 10**9, mtime - 10**9))  # so a rewrite would be detectable
    mtime = st.stat().st_mtime_ns

    second = load_model(path, backend="torch")
    assert second.path == first.path
    assert st.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in (cache_dir / "converted").iterdir()) == [first.path.name]
    ids = _ids(6, seed=5)
    torch.testing.assert_close(
        _smc_logits(second.model, ids, 3), _smc_logits(first.model, ids, 3), atol=0, rtol=0
    )
