"""The Engine on tiny random HF-directory models: methods, streaming, seeds and bad input."""

from __future__ import annotations

import pytest
import torch
from tiny_models import CHAT_TEMPLATE, make_tiny_hf_model

from smcspec import (
    ConfigError,
    ContextLengthError,
    Engine,
    GenerationConfig,
    ModelFileError,
    NumericalError,
)
from smcspec.backends.torch import load_hf_dir

METHODS = ("ar", "sd", "smc")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return {
        "target": make_tiny_hf_model(root, "qwen2", seed=0),
        "draft": make_tiny_hf_model(root, "qwen2", seed=1),
        "small_vocab": make_tiny_hf_model(root, "qwen2", vocab_size=90, seed=2),
    }


@pytest.fixture(scope="module")
def engine(dirs):
    return Engine(load_hf_dir(dirs["target"]), load_hf_dir(dirs["draft"]))


def cfg(method: str, **kw) -> GenerationConfig:
    base = dict(method=method, max_new_tokens=12, seed=7, particles=4, draft_tokens=3)
    return GenerationConfig(**{**base, **kw})


@pytest.mark.parametrize("method", METHODS)
def test_generates_requested_tokens_and_streams_the_same_text(engine, method):
    pieces: list[str] = []
    r = engine.generate("ab cd ef", cfg(method, ignore_eos=True), chat=False, on_text=pieces.append)
    assert r.new_tokens == 12 and len(r.token_ids) == 12
    assert "".join(pieces) == r.text  # the stream is exactly the final text
    assert r.method == method and r.prompt_tokens > 0 and r.tokens_per_second > 0
    if method == "smc":
        assert r.stats["rounds"] == 3  # x0 + 3 rounds of K+1 = 4 tokens >= 12
        assert 1.0 <= r.stats["min_ess"] <= r.stats["mean_ess"] <= 4.0
    if method == "sd":
        assert 0.0 <= r.stats["acceptance_rate"] <= 1.0
        assert r.stats["mean_accepted_length"] >= 1.0


@pytest.mark.parametrize("method", METHODS)
def test_same_seed_same_output(engine, method):
    a = engine.generate("ab cd", cfg(method), chat=False)
    b = engine.generate("ab cd", cfg(method), chat=False)
    assert a.token_ids == b.token_ids


def test_eos_stops_generation(engine):
    """Seeds 14 and 24 of this pair emit EOS within 40 tokens (found by a search over 0-199,
    finished particles banked; most seeds run to the budget): the answer ends right after
    it, and with ``ignore_eos`` the same seed goes on to the budget."""
    eos = engine.tokenizer.eos_token_id
    for seed in (14, 24):
        pieces: list[str] = []
        r = engine.generate(
            "ab", cfg("smc", max_new_tokens=40, seed=seed), chat=False, on_text=pieces.append
        )
        assert "".join(pieces) == r.text and r.stats["banked"] >= 4  # streamed with banking
        assert eos in r.token_ids, seed
        assert r.token_ids.index(eos) == len(r.token_ids) - 1
        assert r.finish_reason == "stop" and len(r.token_ids) < 40
        on = engine.generate(
            "ab", cfg("smc", max_new_tokens=40, seed=seed, ignore_eos=True), chat=False
        )
        assert len(on.token_ids) == 40


def test_smc_returns_particles_with_normalised_weights(engine):
    r = engine.generate("ab", cfg("smc", particles=5, return_particles=True), chat=False)
    assert len(r.particles) == 5
    assert sum(p["weight"] for p in r.particles) == pytest.approx(1.0, abs=1e-9)
    assert r.text in {p["text"] for p in r.particles}
    assert r.log_normalizer is not None


def test_prompt_over_context_is_refused(engine):
    # tiny models have a 256-token context
    with pytest.raises(ContextLengthError, match="exceeds the model context of 256"):
        engine.generate([5] * 199, cfg("smc", max_new_tokens=60))
    with pytest.raises(ContextLengthError):
        engine.generate([5] * 249, cfg("ar", max_new_tokens=10))


def test_bad_prompts_are_refused(engine):
    with pytest.raises(ConfigError, match="empty"):
        engine.generate("   ", cfg("ar"), chat=False)
    with pytest.raises(ConfigError, match="token ids"):
        engine.generate([1, 2, 10_000], cfg("ar"))
    with pytest.raises(ConfigError, match="chat template"):
        engine.generate("ab", cfg("ar"), chat=True)


def test_method_without_draft_is_refused(dirs):
    solo = Engine(load_hf_dir(dirs["target"]))
    assert solo.generate("ab", cfg("ar"), chat=False).new_tokens >= 1
    with pytest.raises(ConfigError, match="needs a draft"):
        solo.generate("ab", cfg("smc"), chat=False)


def test_different_vocabularies_are_refused(dirs):
    with pytest.raises(ModelFileError, match="vocabularies differ"):
        Engine(load_hf_dir(dirs["target"]), load_hf_dir(dirs["small_vocab"]))


@pytest.mark.parametrize("method", METHODS)
def test_nan_logits_raise_a_clear_error(dirs, method):
    broken = load_hf_dir(dirs["target"])
    with torch.no_grad():
        broken.model.layers[0].gate_up.weight[0, 0] = float("nan")
    e = Engine(broken, load_hf_dir(dirs["draft"]))
    with pytest.raises(NumericalError, match="NaN"):
        e.generate("ab", cfg(method), chat=False)


def test_invalid_config_is_refused_before_decoding(engine):
    with pytest.raises(ConfigError):
        engine.generate("ab", GenerationConfig(particles=0), chat=False)


@pytest.mark.parametrize("method", METHODS)
def test_finish_reason_length_or_stop(engine, method):
    r = engine.generate("ab cd", cfg(method, max_new_tokens=5, ignore_eos=True), chat=False)
    assert r.new_tokens == 5 and r.finish_reason == "length"
    every = tuple(range(engine.vocab))  # whatever is drawn first ends the answer
    r = engine.generate("ab cd", cfg(method, max_new_tokens=1, stop_token_ids=every), chat=False)
    assert r.new_tokens == 1 and r.finish_reason == "stop"  # a stop token on the last slot


@pytest.mark.parametrize("method", METHODS)
def test_min_tokens_allows_the_first_stop_at_position_min_tokens(engine, method):
    """``min_tokens`` 3 with every token but one (``t``) a stop token, so that a stop token
    holds nearly all the mass wherever it is allowed: the prepared request's mask forbids
    every stop token at positions 0-2 (``t`` the one token left) and allows them all from
    position 3; a greedy answer is ``t, t, t`` and then a stop token, 4 tokens (the stop
    token not counted in the 3). Broken variant caught: ``min_tokens`` counting the stop
    token (``MinTokens(..., n - 1)``): the mask allows stops at position 2 and the answer
    is 3 tokens; the other tests put the boundary where the stop token has mass 5e-15."""
    t = 10
    stops = tuple(i for i in range(engine.vocab) if i != t)
    c = cfg(method, temperature=0.0, min_tokens=3, stop_token_ids=stops)
    state = engine.prepare("ab cd", c, chat=False).config.constraint.start()
    for pos in range(6):
        allowed = state.allowed()
        assert bool(allowed[t]) and allowed[list(stops)].tolist() == [pos >= 3] * len(stops), pos
        state.consume([t])
    r = engine.generate("ab cd", c, chat=False)
    assert r.token_ids[:3] == [t] * 3 and r.token_ids[3] in stops, r.token_ids
    assert len(r.token_ids) == 4 and r.finish_reason == "stop", r.token_ids


@pytest.mark.parametrize("seed", [2**70, -(2**70), 2**64 + 7])
def test_any_integer_seed_is_used_modulo_2_64(engine, seed):
    a = engine.generate("ab cd", cfg("smc", seed=seed), chat=False)
    b = engine.generate("ab cd", cfg("smc", seed=seed % 2**64), chat=False)
    assert a.token_ids == b.token_ids and a.stats["seed"] == seed % 2**64


@pytest.mark.parametrize(
    "prompt, chat",
    [
        ("ab \ud800 cd", False),
        ([{"role": "user", "content": "a \udfff"}], True),
        ([{"role": "user", "content": None}], True),
        ([{"role": 3, "content": "x"}], True),
        ([], True),
    ],
)
def test_text_that_cannot_be_encoded_is_a_config_error(engine, monkeypatch, prompt, chat):
    monkeypatch.setattr(engine.tokenizer, "chat_template", CHAT_TEMPLATE, raising=False)
    with pytest.raises(ConfigError, match="not valid text|message 0|non-empty list"):
        engine.prepare(prompt, cfg("ar"), chat=chat)


def test_seed_must_be_an_integer():
    for bad in (1.5, "1", True):
        with pytest.raises(ConfigError, match="seed must be an integer"):
            GenerationConfig(seed=bad).validate()


def test_stop_ids_are_special_tokens_never_ordinary_text():
    """Qwen2.5's vocabulary holds ``</s>`` as a plain token (id 128247): a model that writes
    it inside an answer must not end there. Stop ids are the eos token and the chat
    templates' end tokens only where the tokenizer marks them special."""
    from tiny_models import make_tokenizer
    from tokenizers import AddedToken

    from smcspec.engine import stop_token_ids

    tok = make_tokenizer(96)
    tok.add_tokens(["</s>"])  # ordinary text, as in Qwen2.5's vocabulary
    tok.add_tokens([AddedToken("<|endoftext|>", special=True)], special_tokens=True)
    vocab = tok.get_vocab()
    ids = stop_token_ids(tok, len(vocab))
    assert vocab["</s>"] not in ids
    assert ids == {tok.eos_token_id, vocab["<|endoftext|>"]}
    assert stop_token_ids(tok, vocab["<|endoftext|>"]) == {tok.eos_token_id}  # below vocab
