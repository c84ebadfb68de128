"""smcspec's Transformer + ParticleKVCache against transformers, on tiny random models.

Reference: the ``transformers`` LlamaForCausalLM / Qwen2ForCausalLM loaded from the same
directory, full forward over the whole sequence in float32. smcspec logits must match it
within ``ATOL``/``RTOL`` (float32 round-off only; the logits are O(1)-O(30)).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILY_DEFAULTS, make_tiny_hf_model

from smcspec.backends.torch import load_hf_dir
from smcspec.errors import ContextLengthError, ModelFileError
from smcspec.models import load_model

ATOL = 1e-4  # float32, absolute
RTOL = 1e-5
V = 96

VARIANTS = {
    "llama": ("llama", {"tie_word_embeddings": False}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    # attention_bias=True: q/k/v AND o_proj have biases in transformers' Llama.
    "llama-attn-bias": ("llama", {"attention_bias": True}),
    # the same with o_proj.bias = 0: isolates the q/k/v biases.
    "llama-qkv-bias": ("llama", {"attention_bias": True, "zero_o_bias": True}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-untied": ("qwen2", {"tie_word_embeddings": False}),
    # Llama 3.1 RoPE scaling. Original context 64: the RoPE wavelengths 6.3 (kept), 20 and 63
    # (interpolated) and >= 199 (divided by factor) cover all three regimes.
    "llama-rope-llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    # head_dim != hidden_size / num_heads
    "llama-head-dim-32": ("llama", {"head_dim": 32}),
    # multi-query attention (one kv head)
    "qwen2-mqa": ("qwen2", {"num_key_value_heads": 1}),
}


class Zoo:
    """Builds each tiny model directory once per session, and loads it on demand."""

    def __init__(self, root) -> None:
        self.root = root
        self._dirs: dict = {}
        self._smc: dict = {}
        self._hf: dict = {}

    def dir(self, variant: str):
        if variant not in self._dirs:
            family, overrides = VARIANTS[variant]
            self._dirs[variant] = make_tiny_hf_model(self.root, family, V, seed=1, **overrides)
        return self._dirs[variant]

    def smc(self, variant: str):
        if variant not in self._smc:
            self._smc[variant] = load_hf_dir(self.dir(variant))
        return self._smc[variant]

    def hf(self, variant: str):
        if variant not in self._hf:
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(self.dir(variant), dtype=torch.float32)
            self._hf[variant] = m.eval()
        return self._hf[variant]

    @torch.no_grad()
    def ref_logits(self, variant: str, ids: torch.Tensor) -> torch.Tensor:
        """transformers logits ``[T, V]`` for every position of ``ids`` ``[T]``."""
        return self.hf(variant)(ids[None]).logits[0].float()


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return Zoo(tmp_path_factory.mktemp("tiny_models"))


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


def all_logits(model, ids: torch.Tensor, prefix: int = 1, capacity: int = 64) -> torch.Tensor:
    """smcspec logits ``[T, V]`` for every position: prefill ``ids[:prefix]``, decode the rest.

    Row ``j`` is the next-token distribution after ``ids[: j + 1]`` (rows before
    ``prefix - 1`` are not computed by a prefill and are returned as NaN).
    """
    cache = model.new_cache(1, capacity)
    out = torch.full((ids.shape[0], V), float("nan"))
    out[prefix - 1] = model.prefill(ids[:prefix], cache)
    if prefix < ids.shape[0]:
        out[prefix:] = model.decode(ids[prefix:][None], cache)[0]
    return out


def assert_close(actual, expected, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(zoo, variant):
    lm = zoo.smc(variant)
    ids = tokens(14, seed=2)
    ref = zoo.ref_logits(variant, ids)
    # the test model is not degenerate: next-token distributions are far from uniform
    assert ref.softmax(-1).max(-1).values.mean() > 3.0 / V
    family, ov = VARIANTS[variant]
    tied = ov.get("tie_word_embeddings", FAMILY_DEFAULTS[family]["tie_word_embeddings"])
    assert lm.config.tie_word_embeddings == tied
    assert lm.config.qkv_bias == (family == "qwen2" or ov.get("attention_bias", False))

    # prefill of one token, then one decode block of the other 13
    assert_close(all_logits(lm.model, ids, prefix=1), ref)
    # prefill of 6 tokens (GQA causal attention inside the prompt), then decode 8
    got = all_logits(lm.model, ids, prefix=6)
    assert_close(got[5:], ref[5:])
    # prefill of the whole sequence returns the next-token logits after it
    cache = lm.model.new_cache(1, 4)
    last = lm.model.prefill(ids, cache)
    assert last.shape == (V,) and last.dtype == torch.float32
    assert_close(last, ref[-1])


def test_load_model_accepts_hf_directory(zoo):
    lm = load_model(zoo.dir("llama"))
    assert lm.path == zoo.dir("llama")
    ids = tokens(6, seed=2)
    assert_close(all_logits(lm.model, ids), zoo.ref_logits("llama", ids))


def test_unsupported_llama_bias_is_loaded_or_refused(tmp_path):
    """LlamaConfig(mlp_bias=True) adds biases to gate/up/down. smcspec must either use them
    or refuse the model with ModelFileError -- never silently drop them."""
    d = make_tiny_hf_model(tmp_path, "llama", V, seed=1, mlp_bias=True)
    try:
        lm = load_hf_dir(d)
    except ModelFileError:
        return
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = tokens(8, seed=2)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert_close(all_logits(lm.model, ids), ref)


def test_tied_embeddings_share_storage(zoo):
    m = zoo.smc("qwen2-tied").model
    assert m.lm_head.weight.data_ptr() == m.embed.weight.data_ptr()
    m = zoo.smc("qwen2-untied").model
    assert m.lm_head.weight.data_ptr() != m.embed.weight.data_ptr()
    assert not torch.equal(m.lm_head.weight, m.embed.weight)


# ------------------------------------------------------------------ incremental decode
@pytest.mark.parametrize("variant", ["llama", "qwen2-tied"])
@pytest.mark.parametrize("block", [1, 3])
def test_incremental_decode_equals_full_forward(zoo, variant, block):
    model = zoo.smc(variant).model
    ids = tokens(17, seed=3)
    ref = zoo.ref_logits(variant, ids)
    p = 4
    cache = model.new_cache(1, 32)
    got = [model.prefill(ids[:p], cache)[None]]
    for s in range(p, ids.shape[0], block):
        chunk = ids[s : s + block]
        out = model.decode(chunk[None], cache)
        assert out.shape == (1, chunk.shape[0], V)
        got.append(out[0])
    assert cache.length == ids.shape[0] - p
    assert_close(torch.cat(got), ref[p - 1 :])


def test_decode_last_only(zoo):
    model = zoo.smc("llama").model
    ids = tokens(9, seed=4)
    ref = zoo.ref_logits("llama", ids)
    cache = model.new_cache(1, 16)
    model.prefill(ids[:3], cache)
    out = model.decode(ids[3:][None], cache, last_only=True)
    assert out.shape == (1, 1, V)
    assert_close(out[0, 0], ref[-1])
    assert cache.length == 6


# ------------------------------------------------------------------------------ rows
def _fresh_run(model, prompt: torch.Tensor, suffix: torch.Tensor) -> torch.Tensor:
    """R=1 logits after each token of ``suffix`` (``[len(suffix), V]``), one decode block."""
    cache = model.new_cache(1, 32)
    model.prefill(prompt, cache)
    return model.decode(suffix[None], cache)[0]


@pytest.mark.parametrize("variant", ["llama", "qwen2-tied"])
def test_rows_equal_separate_runs(zoo, variant):
    model = zoo.smc(variant).model
    prompt = tokens(5, seed=5)
    suffixes = torch.stack([tokens(6, seed=10 + i) for i in range(4)])  # [4, 6], distinct
    assert len({tuple(r.tolist()) for r in suffixes}) == 4
    cache = model.new_cache(4, 16)
    model.prefill(prompt, cache)
    got = torch.cat([model.decode(suffixes[:, :2], cache), model.decode(suffixes[:, 2:], cache)], 1)
    for i in range(4):
        assert_close(got[i], _fresh_run(model, prompt, suffixes[i]))
        ref = zoo.ref_logits(variant, torch.cat([prompt, suffixes[i]]))
        assert_close(got[i], ref[prompt.shape[0] :])


@pytest.mark.parametrize("ancestors", [[2, 2, 0, 3], [1, 2, 3, 0], [3, 3, 3, 3]])
def test_reorder_equals_recomputation(zoo, ancestors):
    model = zoo.smc("llama").model
    prompt = tokens(5, seed=6)
    hist = torch.stack([tokens(3, seed=20 + i) for i in range(4)])  # [4, 3] per-row history
    nxt = tokens(4, seed=30)[:, None]  # one more token per row after the reorder
    cache = model.new_cache(4, 8)
    model.prefill(prompt, cache)
    model.decode(hist[:, :2], cache)
    model.decode(hist[:, 2:], cache)
    pk, pv = cache.prefix_k, cache.prefix_v
    pk_ptr, pk_val, pv_val = pk.data_ptr(), pk.clone(), pv.clone()

    anc = torch.tensor(ancestors)
    cache.reorder(anc)
    assert cache.length == 3
    assert cache.prefix_k is pk and cache.prefix_k.data_ptr() == pk_ptr
    assert torch.equal(cache.prefix_k, pk_val) and torch.equal(cache.prefix_v, pv_val)

    got = model.decode(nxt, cache)[:, 0]  # [4, V]
    for i in range(4):
        seq = torch.cat([hist[anc[i]], nxt[i]])
        assert_close(got[i], _fresh_run(model, prompt, seq)[-1])


def test_reorder_on_empty_suffix_is_noop(zoo):
    model = zoo.smc("llama").model
    prompt = tokens(4, seed=7)
    cache = model.new_cache(2, 4)
    model.prefill(prompt, cache)
    cache.reorder(torch.tensor([1, 1]))
    out = model.decode(tokens(2, seed=8)[:, None], cache)
    for i, t in enumerate(tokens(2, seed=8)):
        assert_close(out[i, 0], _fresh_run(model, prompt, t[None])[-1])


# -------------------------------------------------------------------------- truncate
@pytest.mark.parametrize("rows", [1, 3])
def test_truncate_then_decode_equals_fresh_run(zoo, rows):
    model = zoo.smc("qwen2-tied").model
    prompt = tokens(4, seed=9)
    first = torch.stack([tokens(5, seed=40 + i) for i in range(rows)])  # [R, 5]
    second = torch.stack([tokens(3, seed=50 + i) for i in range(rows)])  # [R, 3]
    cache = model.new_cache(rows, 8)
    model.prefill(prompt, cache)
    model.decode(first, cache)
    cache.truncate(cache.length - 3)  # rejected: keep 2 of the 5
    assert cache.length == 2
    got = model.decode(second, cache)
    assert cache.length == 5
    for i in range(rows):
        seq = torch.cat([first[i, :2], second[i]])
        assert_close(got[i], _fresh_run(model, prompt, seq)[2:])
        ref = zoo.ref_logits("qwen2-tied", torch.cat([prompt, seq]))
        assert_close(got[i], ref[-3:])


def test_truncate_rejects_growing(zoo):
    model = zoo.smc("llama").model
    cache = model.new_cache(1, 8)
    model.prefill(tokens(3, seed=1), cache)
    model.decode(tokens(2, seed=2)[None], cache)
    with pytest.raises(ValueError):
        cache.truncate(3)
    with pytest.raises(ValueError):
        cache.truncate(-1)
    cache.truncate(0)
    assert cache.length == 0


# ---------------------------------------------------------------------------- layout
def test_shared_prompt_kv_stored_once(zoo):
    lm = zoo.smc("llama")
    cfg = lm.config
    cache = lm.model.new_cache(8, 5)
    prompt = tokens(7, seed=11)
    lm.model.prefill(prompt, cache)
    lm.model.decode(torch.stack([tokens(2, seed=60 + i) for i in range(8)]), cache)
    expect = (cfg.num_layers, 1, cfg.num_kv_heads, 7, cfg.head_dim)
    assert cache.prefix_k.shape == expect and cache.prefix_v.shape == expect
    assert cache.prefix_k.shape[1] == 1
    assert cache.suffix_k.shape == (cfg.num_layers, 8, cfg.num_kv_heads, 5, cfg.head_dim)
    assert cache.rows == 8 and cache.prompt_len == 7 and cache.length == 2


def test_second_prefill_rejected(zoo):
    model = zoo.smc("llama").model
    cache = model.new_cache(1, 4)
    model.prefill(tokens(3, seed=1), cache)
    with pytest.raises(RuntimeError):
        model.prefill(tokens(3, seed=1), cache)


def test_wrong_row_count_rejected(zoo):
    model = zoo.smc("llama").model
    cache = model.new_cache(2, 4)
    model.prefill(tokens(3, seed=1), cache)
    with pytest.raises(ValueError):
        model.decode(tokens(3, seed=2)[:, None], cache)


# -------------------------------------------------------------------- context length
def test_context_length_error_beyond_capacity(zoo):
    model = zoo.smc("llama").model
    prompt = tokens(3, seed=12)
    cont = tokens(6, seed=13)
    cache = model.new_cache(1, 6)
    model.prefill(prompt, cache)
    model.decode(cont[:4][None], cache)
    with pytest.raises(ContextLengthError):
        model.decode(tokens(3, seed=15)[None], cache)  # 4 + 3 > 6
    assert cache.length == 4  # the failed step reserved nothing
    out = model.decode(cont[4:][None], cache)  # exactly fills the cache
    assert cache.length == 6
    ref = zoo.ref_logits("llama", torch.cat([prompt, cont]))
    assert_close(out[0], ref[-2:])
    with pytest.raises(ContextLengthError):
        model.decode(cont[:1][None], cache)

    fresh = model.new_cache(1, 2)
    model.prefill(prompt, fresh)
    with pytest.raises(ContextLengthError):
        model.decode(cont[:3][None], fresh)


# -------------------------------------------------------------------------- bfloat16
def test_bfloat16_close_to_float32(zoo):
    """bf16 weights/activations: loose check against the float32 reference.

    Tolerance: mean |diff| < 0.1 * std of the float32 logits, and argmax agrees on >= 80% of
    the positions (bf16 has ~3 significant digits).
    """
    variant = "qwen2-untied"
    lm16 = load_hf_dir(zoo.dir(variant), dtype="bfloat16")
    assert lm16.model.dtype == torch.bfloat16
    assert lm16.model.inv_freq.dtype == torch.float32
    ids = tokens(16, seed=14)
    ref = zoo.ref_logits(variant, ids)
    got = all_logits(lm16.model, ids, prefix=4)[3:]
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    ref = ref[3:]
    assert (got - ref).abs().mean() < 0.1 * ref.std()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= 0.8, f"argmax agreement {agree:.2f}"
    cache = lm16.model.new_cache(2, 4)
    assert cache.suffix_k.dtype == torch.bfloat16
