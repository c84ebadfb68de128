"""The eval baselines (smcspec.eval.baselines): best-of-n against its closed form on a tiny
enumerable model, self-consistency's choice, batched samples through the scheduler, and the
method names of the steered and baseline settings."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from enumerable import chisquare_p, sequence_log_probs, tiny_transformer
from tiny_models import make_tiny_chat_pair

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.decoding import run_program
from smcspec.decoding.job import job_for
from smcspec.decoding.registry import decoder_for
from smcspec.errors import ConfigError
from smcspec.eval import baselines
from smcspec.eval.harness import REWARD_BETA, method_specs

PROMPT, LENGTH = [1, 2, 0], 3


def test_best_of_n_and_self_consistency_choices() -> None:
    assert baselines.best_of_n([0.5, 1.0, 1.0, 0.2]) == 1  # the first best
    assert baselines.self_consistency(["7", None, "8", "8", "7", "8"]) == 2
    assert baselines.self_consistency([None, None]) is None
    with pytest.raises(ValueError):
        baselines.best_of_n([])


def test_best_of_n_closed_form_sums_to_one_and_reduces_to_p() -> None:
    probs = {"a": 0.5, "b": 0.3, "c": 0.2}
    reward = {"a": 0.0, "b": 1.0, "c": 1.0}
    one = baselines.best_of_n_probs(probs, reward, 1)
    assert one == pytest.approx(probs)
    three = baselines.best_of_n_probs(probs, reward, 3)
    assert sum(three.values()) == pytest.approx(1.0)
    assert three["a"] == pytest.approx(0.5**3)  # every sample must be "a"
    assert three["b"] / three["c"] == pytest.approx(0.3 / 0.2)  # ties share in proportion


@pytest.mark.slow
@pytest.mark.usefixtures("inference_mode")  # conftest: the same draws, less CPU
def test_best_of_n_samples_its_closed_form() -> None:
    """Best-of-3 of real ``ar`` samples (the AR decoder on a tiny model, seeded), reranked by
    R = number of token 1: its answers follow the closed form (chi-square p > 1e-3 over 64
    outcomes, 3000 picks); the plain target fails the same test."""
    torch.set_num_threads(1)
    target = tiny_transformer(seed=1)
    exact = sequence_log_probs(target, PROMPT, LENGTH, 1.0)
    cfg = GenerationConfig(method="ar", max_new_tokens=LENGTH, temperature=1.0).validate()
    decoder, runs, n = decoder_for(cfg), 3000, 3
    picks: Counter = Counter()
    for i in range(runs):
        samples = []
        for j in range(n):
            g = torch.Generator().manual_seed(i * n + j)
            program = decoder.program(job_for(target, None, PROMPT, cfg, frozenset(), 4, g))
            samples.append(tuple(run_program(program).tokens))
        picks[samples[baselines.best_of_n([float(s.count(1)) for s in samples])]] += 1
    probs = {k: math.exp(v) for k, v in exact.items()}
    law = baselines.best_of_n_probs(probs, {k: float(k.count(1)) for k in probs}, n)
    want = {k: math.log(p) for k, p in law.items() if p > 0}
    assert chisquare_p(want, picks, runs) > 1e-3
    assert chisquare_p(exact, picks, runs) < 1e-6


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    dirs = make_tiny_chat_pair(tmp_path_factory.mktemp("baselines"))
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))


def test_sample_batch_equals_separate_requests(engine) -> None:
    """n samples decoded together give what n separate requests with the same seeds give
    (sample 0 is the plain request's answer)."""
    cfg = GenerationConfig(method="ar", max_new_tokens=6, seed=11)
    got = baselines.sample_batch(engine, "ab", cfg, 3)
    alone = [
        engine.generate("ab", GenerationConfig(method="ar", max_new_tokens=6, seed=s)).text
        for s in (11, 11 + baselines.SAMPLE_SEED_STRIDE, 11 + 2 * baselines.SAMPLE_SEED_STRIDE)
    ]
    assert got.texts == alone and got.seconds > 0
    assert got.new_tokens == sum(r.new_tokens for r in got.results)


def test_method_names() -> None:
    base = GenerationConfig()
    specs = {s.name: s for s in method_specs(
        "ar-greedy,ar-sc-n8,ar-bon-n4,smc-n8-k2-a2-vote,smc-n16-k2-reward,smc-n8-k2-keep-reward3",
        base,
    )}  # fmt: skip
    assert specs["ar-greedy"].config.temperature == 0 and specs["ar-greedy"].config.method == "ar"
    assert (specs["ar-sc-n8"].samples, specs["ar-sc-n8"].select) == (8, "sc")
    assert (specs["ar-bon-n4"].samples, specs["ar-bon-n4"].select) == (4, "bon")
    a2 = specs["smc-n8-k2-a2-vote"]
    assert (a2.config.alpha, a2.vote, a2.reward_beta) == (2.0, True, None)
    assert specs["smc-n16-k2-reward"].reward_beta == REWARD_BETA
    keep = specs["smc-n8-k2-keep-reward3"]
    assert keep.reward_beta == 3.0 and keep.config.finished_particles == "keep"
    with pytest.raises(ConfigError, match="unknown method"):
        method_specs("smc-n8-k2-bogus", base)
    with pytest.raises(ConfigError, match="n must be"):
        method_specs("ar-sc-n0", base)
