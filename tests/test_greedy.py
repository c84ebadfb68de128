"""Greedy decoding (temperature 0) on every method and both backends: ``ar`` takes the
target's argmax, ``sd`` is greedy speculative decoding and ``smc`` runs as greedy ``sd``, so
all three give the same tokens; the draft and the seed change nothing."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_chat_pair, make_tiny_gguf_chat_engine

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.potentials import Regex


@pytest.fixture(scope="module", params=["torch", "llamacpp"])
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"greedy-{request.param}")
    if request.param == "llamacpp":
        pytest.importorskip("llama_cpp")
        return make_tiny_gguf_chat_engine(root)
    dirs = make_tiny_chat_pair(root)
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))


def _greedy(engine, method: str, prompt: str, seed: int, **extra):
    cfg = GenerationConfig(
        method=method,
        temperature=0,
        max_new_tokens=24,
        particles=4,
        draft_tokens=3,
        seed=seed,
        **extra,
    )
    return engine.generate(prompt, cfg, chat=False)


def _argmax_chain(engine, prompt: str, n: int) -> list[int]:
    """The target's argmax, token after token, from full recomputation (no KV cache reuse)."""
    ids = engine.encode(prompt, chat=False)
    out: list[int] = []
    model = engine.target.model
    for _ in range(n):
        cache = model.new_cache(1, 1)
        try:
            logits = model.prefill(torch.tensor(ids + out), cache)[: engine.vocab]
        finally:
            cache.close()
        out.append(int(logits.argmax()))
        if out[-1] in engine.stop_ids:
            break
    return out


@pytest.mark.parametrize("prompt", ["ab cd", "zz top", "hello"])
def test_greedy_ar_sd_and_smc_give_the_same_tokens(engine, prompt):
    ar = _greedy(engine, "ar", prompt, seed=0)
    assert ar.token_ids == _argmax_chain(engine, prompt, len(ar.token_ids))
    for method in ("sd", "smc"):
        for seed in (0, 1):
            out = _greedy(engine, method, prompt, seed)
            assert out.token_ids == ar.token_ids, (method, seed)
    smc = _greedy(engine, "smc", prompt, 0)
    assert smc.stats["greedy"] is True and smc.stats["ran_as"] == "sd"
    assert "rounds" in smc.stats and "mean_ess" not in smc.stats


def test_greedy_with_a_constraint_takes_the_most_likely_allowed_token(engine):
    if engine.target.backend == "llamacpp":
        pytest.skip("llguidance refuses the tiny GGUF's tokenizer (96 ids, 97 tokens)")
    extra = {"constraint": Regex("(ab|cd)+")}
    ar = _greedy(engine, "ar", "ab cd", 0, **extra)
    sd = _greedy(engine, "sd", "ab cd", 3, **extra)
    assert ar.token_ids == sd.token_ids
    assert set(engine.tokenizer.decode(ar.token_ids, skip_special_tokens=True)) <= set("abcd")
