"""The llamacpp backend against the torch backend, on tiny GGUF files written here.

Both backends load the same file (torch dequantizes it once to float32; llama.cpp runs it as
it is), so their logits must agree, within what llama.cpp's own arithmetic allows: it rounds
some CPU steps to 16 bits, and for Q8_0 weights it quantizes the activations to 8 bits too.
The bounds (max |difference| on logits of magnitude about 20, and the total variation of
the softmax) are stated below with the measured values. Cache edits (reorder with repeated
and overwritten ancestors, truncate) must equal recomputation from scratch within
``ATOL_SAME`` (llama.cpp takes other kernel paths for other batch shapes); batches over
``n_batch`` are chunked.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import make_tiny_gguf

from smcspec.errors import ConfigError, ContextLengthError
from smcspec.models import load_model

pytest.importorskip("llama_cpp")
from smcspec.backends.llamacpp import LlamaCppModel, LlamaCppSettings  # noqa: E402

V = 96
# (max |diff|, max TV, mean TV): measured 0.038, 0.0037, 0.001 for F32;
# 1.16, 0.13, 0.02 for Q8_0 (8-bit activations; a wrong weight layout gives TV near 1)
F32_BOUNDS = (5e-2, 1e-2, 5e-3)
Q8_BOUNDS = (2.0, 0.25, 0.05)
ATOL_SAME = 2e-2  # measured 4e-3; 1.2e-2 when four rows share every cell (one ancestor)
PROMPT = torch.tensor([3, 17, 40, 8, 22, 61, 5, 9, 33, 70, 2, 11])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamacpp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SMCSPEC_CACHE", str(root / "cache"))
        out = {}
        for name, q8 in (("f32", False), ("q8_0", True)):
            path, _ = make_tiny_gguf(root, "qwen2", V, seed=5, q8_0=q8)
            out[name] = (path, load_model(path, backend="torch").model)
    return out


def _llama(path, **settings) -> LlamaCppModel:
    settings = {"threads": 1, "kv_cells": 4096, "kv_type": "f32", **settings}
    return LlamaCppModel(path, LlamaCppSettings(**settings))


def _recompute(model, tokens: list[int]) -> torch.Tensor:
    """Logits after ``PROMPT + tokens`` from a fresh one-row cache."""
    cache = model.new_cache(1, 64)
    logits = model.prefill(PROMPT, cache)
    if tokens:
        logits = model.decode(torch.tensor([tokens]), cache, last_only=True)[0, -1]
    return logits.clone()


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor, bounds) -> None:
    atol, max_tv, mean_tv = bounds
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref.to(got.dtype), atol=atol, rtol=0)
    dist = 0.5 * (got.softmax(-1) - ref.softmax(-1)).abs().sum(-1)
    assert float(dist.max()) < max_tv and float(dist.mean()) < mean_tv


@pytest.mark.parametrize("kind, bounds", [("f32", F32_BOUNDS), ("q8_0", Q8_BOUNDS)])
def test_logits_equal_the_torch_backend(files, kind, bounds):
    path, ref = files[kind]
    model = _llama(path)
    block = torch.tensor([[1, 2, 3, 4], [50, 51, 52, 53], [7, 7, 7, 7]])
    got_cache, ref_cache = model.new_cache(3, 16), ref.new_cache(3, 16)
    first = model.prefill(PROMPT, got_cache)
    assert_logits_close(first, ref.prefill(PROMPT, ref_cache), bounds)
    got = model.decode(block, got_cache).clone()
    assert got.shape == (3, 4, V)
    assert_logits_close(got, ref.decode(block, ref_cache), bounds)
    last = model.decode(block[:, :1], got_cache, last_only=True)
    assert_logits_close(last, ref.decode(block[:, :1], ref_cache, True), bounds)


@pytest.mark.parametrize(
    "ancestors",
    [
        [2, 2, 0, 1],  # row 2 copied twice and overwritten itself; row 1 read and overwritten
        [1, 0, 3, 2],  # two swaps: cycles that need the spare sequence
        [1, 2, 3, 0],  # one 4-cycle
        [3, 3, 3, 3],  # one ancestor
    ],
)
def test_reorder_with_repeated_and_overwritten_ancestors_equals_recomputation(files, ancestors):
    model = _llama(files["f32"][0])
    rows = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    cache = model.new_cache(4, 16)
    model.prefill(PROMPT, cache)
    model.decode(torch.tensor(rows), cache)
    cache.reorder(torch.tensor(ancestors))
    nxt = model.decode(torch.tensor([[20], [21], [22], [23]]), cache, last_only=True).clone()
    for i, a in enumerate(ancestors):
        expect = _recompute(model, rows[a] + [20 + i])
        torch.testing.assert_close(nxt[i, 0], expect, atol=ATOL_SAME, rtol=0)


def test_truncate_equals_recomputation(files):
    model = _llama(files["f32"][0])
    cache = model.new_cache(2, 16)
    model.prefill(PROMPT, cache)
    model.decode(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), cache)
    cache.truncate(1)
    assert cache.length == 1
    nxt = model.decode(torch.tensor([[30, 31], [32, 33]]), cache).clone()
    torch.testing.assert_close(nxt[0, -1], _recompute(model, [1, 30, 31]), atol=ATOL_SAME, rtol=0)
    torch.testing.assert_close(nxt[1, -1], _recompute(model, [5, 32, 33]), atol=ATOL_SAME, rtol=0)


def test_a_batch_over_n_batch_is_chunked(files):
    path = files["f32"][0]
    small, big = _llama(path, n_batch=8, max_sequences=8), _llama(path)
    assert small.n_batch == 8
    block = torch.arange(4 * 5).view(4, 5) + 10  # 20 tokens: three chunks of at most 8
    outs = []
    for model in (small, big):
        cache = model.new_cache(4, 16)
        first = model.prefill(PROMPT, cache)  # 12 prompt tokens: two chunks
        outs.append((first, model.decode(block, cache).clone()))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=ATOL_SAME, rtol=0)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=ATOL_SAME, rtol=0)


def test_decode_batch_of_requests_equals_separate_decodes(files):
    model = _llama(files["f32"][0])
    a, b = model.new_cache(2, 16), model.new_cache(3, 16)
    model.prefill(PROMPT, a)
    model.prefill(PROMPT[:5], b)
    ta, tb = torch.tensor([[1, 2], [3, 4]]), torch.tensor([[5], [6], [7]])
    out_a, out_b = (x.clone() for x in model.decode_batch([(ta, a, False), (tb, b, True)]))
    assert out_a.shape == (2, 2, V) and out_b.shape == (3, 1, V)
    torch.testing.assert_close(out_a[1, -1], _recompute(model, [3, 4]), atol=ATOL_SAME, rtol=0)
    c = model.new_cache(1, 16)
    model.prefill(PROMPT[:5], c)
    expect = model.decode(torch.tensor([[6]]), c, True)[0, 0]
    torch.testing.assert_close(out_b[1, 0], expect, atol=ATOL_SAME, rtol=0)


def test_settings_llama_cpp_would_abort_on_are_refused(files):
    with pytest.raises(ConfigError, match="n_batch"):
        _llama(files["f32"][0], n_batch=8, max_sequences=16)
    # refused before the file is opened (a missing file would otherwise be the error), so
    # nothing is loaded and left unfreed
    bad = (
        ({"kv_type": "q8_0"}, "kv_type"),
        ({"threads": 0}, "threads"),
        ({"gpu_layers": -2}, "gpu_layers"),
        ({"max_sequences": 0}, "max_sequences"),
    )
    for setting, match in bad:
        with pytest.raises(ConfigError, match=match):
            _llama(files["f32"][0].parent / "missing.gguf", **setting)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 7), min_size=1, max_size=8).flatmap(
        lambda xs: st.just([min(a, len(xs) - 1) for a in xs])
    )
)
def test_copy_plan_makes_every_row_a_copy_of_its_ancestor_with_one_spare(ancestors):
    """Simulated on lists: the plan gives row i the old content of row ancestors[i] (a spare
    overwritten while a later copy still read it would leave a wrong row), with at most one
    park per cycle."""
    from smcspec.backends.llamacpp import SPARE, copy_plan

    rows = {i: f"row{i}" for i in range(len(ancestors))} | {SPARE: None}
    plan = copy_plan(ancestors)
    for dst, src in plan:
        assert rows[src] is not None and dst != src
        rows[dst] = rows[src]
    assert [rows[i] for i in range(len(ancestors))] == [f"row{a}" for a in ancestors]
    assert len(plan) <= 2 * len(ancestors)


def test_exhaustion_is_a_context_length_error_and_close_gives_everything_back(files):
    model = _llama(files["f32"][0], max_sequences=5, kv_cells=256)
    full = dict(model.pool.capacity)
    cache = model.new_cache(4, 40)  # 4 sequences and a spare, 160 cells
    assert model.pool.free() == {"sequences": 0, "kv_cells": 96}
    with pytest.raises(ContextLengthError, match="sequence ids or KV cells"):
        model.new_cache(1, 8)
    model.prefill(PROMPT, cache)
    with pytest.raises(ContextLengthError, match="capacity"):
        model.decode(torch.ones(4, 41, dtype=torch.long), cache)
    model.decode(torch.ones(4, 40, dtype=torch.long), cache)
    cache.close()
    cache.close()  # idempotent
    assert model.pool.free() == full and not model.pool.in_use
    with pytest.raises(ContextLengthError, match="released"):
        model.decode(torch.ones(4, 1, dtype=torch.long), cache)
    again = model.new_cache(4, 60)  # the ids and cells are free again, and their KV cleared
    model.prefill(PROMPT, again)
    # a stale cell of the closed cache at the same position would be attended to here
    out = model.decode(torch.full((4, 1), 5), again, last_only=True).clone()
    again.close()
    for row in out:
        torch.testing.assert_close(row[0], _recompute(model, [5]), atol=ATOL_SAME, rtol=0)


def test_a_reservation_gives_a_request_its_sequences_and_cells_until_it_is_released(files):
    """A lease reserved with cache_need holds its ids and cells for the caches made on it;
    releasing it clears them for the next request, whatever happened to the caches."""
    model = _llama(files["f32"][0], max_sequences=8, kv_cells=512)
    need = model.cache_need(4, 20, len(PROMPT))
    assert need == {"sequences": 5, "kv_cells": 12 + 80}
    lease = model.pool.try_reserve(need)
    assert model.pool.try_reserve(model.cache_need(4, 20, len(PROMPT))) is None  # 3 ids left
    cache = model.new_cache(4, 20, lease=lease)
    model.prefill(PROMPT, cache)
    model.decode(torch.ones(4, 20, dtype=torch.long), cache)
    cache.close()  # a cache on a lease gives nothing back itself
    assert model.pool.free()["sequences"] == 3
    lease.release()
    assert not model.pool.in_use
    other = model.pool.try_reserve(need)
    fresh = model.new_cache(4, 20, lease=other)
    logits = model.prefill(PROMPT, fresh)  # the released sequences hold nothing any more
    torch.testing.assert_close(logits, _recompute(model, []), atol=ATOL_SAME, rtol=0)
    other.release()


def test_a_cache_closed_after_its_model_was_released_does_not_touch_the_freed_context(files):
    """Closing a cache, or releasing its lease, after ``release()`` hands its ids back without
    calling into the freed llama.cpp context (before: a segfault, seen on the H200)."""
    model = _llama(files["f32"][0], max_sequences=8, kv_cells=256)
    cache = model.new_cache(2, 8)
    lease = model.pool.try_reserve(model.cache_need(2, 8, len(PROMPT)))
    model.prefill(PROMPT, cache)
    model.release()
    cache.close()
    lease.release()
    assert not model.pool.in_use


def test_a_llamacpp_pair_checks_its_vocabulary_through_llama_cpp(files, tmp_path, monkeypatch):
    """Engine.load loads a llamacpp draft without a tokenizer; the pair's shared vocabulary
    is then compared through llama.cpp's token texts, and a mismatch is still refused."""
    from smcspec import Engine
    from smcspec.errors import ModelFileError

    monkeypatch.setenv("SMCSPEC_CACHE", str(tmp_path / "cache"))
    settings = LlamaCppSettings(threads=1, kv_cells=4096)
    target = load_model(files["f32"][0], backend="llamacpp", llamacpp=settings)
    draft = load_model(files["q8_0"][0], backend="llamacpp", llamacpp=settings, tokenizer=False)
    assert draft.tokenizer is None
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 1  # the target's only
    texts = draft.model.token_texts()
    assert len(texts) == V
    assert [t.decode() for t in texts] == target.tokenizer.convert_ids_to_tokens(list(range(V)))
    engine = Engine(target, draft)
    assert engine.generate("ab", _smc_cfg(), chat=False).new_tokens == 6

    other_path, _ = make_tiny_gguf(tmp_path, "qwen2", 80, seed=5)  # other ids from 79 on
    other = load_model(other_path, backend="llamacpp", llamacpp=settings, tokenizer=False)
    with pytest.raises(ModelFileError, match="vocabularies differ"):
        Engine(target, other)
    with pytest.raises(ConfigError, match="only be paired with a llamacpp model"):
        Engine(load_model(files["f32"][0], backend="torch"), draft)
    with pytest.raises(ConfigError, match="target must be loaded with its tokenizer"):
        Engine(draft)


def _smc_cfg():
    from smcspec import GenerationConfig

    return GenerationConfig(
        method="smc", particles=2, draft_tokens=2, max_new_tokens=6, seed=0, ignore_eos=True
    )
