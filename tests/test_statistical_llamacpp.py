"""The statistical suite on the llamacpp backend: tiny GGUF models run by llama.cpp.

Target and draft are 1-layer qwen2 GGUF files with a 4-token vocabulary (written here);
the exact target distribution over the first 3 generated tokens is enumerated with the
same llama.cpp model. Sampling at T = 8 spreads it over about 25 sequences (at T = 1 one
sequence holds 92% of the mass and no test could tell a wrong rule apart). Exact SD must
match it; a wrong acceptance rule must fail the same test; SMC-SD's error must fall with N.
Seeds are fixed, so the tests are deterministic; the bounds are stated beside each check.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from enumerable import chisquare_p, total_variation, tv_lower_bound, until_decided
from tiny_models import make_tiny_gguf

import smcspec.decoding.sd.chain as sd_module
from smcspec.config import GenerationConfig
from smcspec.decoding import decode_sd, decode_smc
from smcspec.decoding.sd.multi_sd import decode_multi_sd

pytest.importorskip("llama_cpp")
from smcspec.backends.llamacpp import LlamaCppModel, LlamaCppSettings  # noqa: E402

pytestmark = pytest.mark.slow  # the slow tier (pyproject.toml); CI runs it

PROMPT = [1, 2, 0]
LENGTH, T, V = 3, 8.0, 4


def _position_log_probs(model: LlamaCppModel, seq: tuple[int, ...]) -> torch.Tensor:
    """float64 ``[LENGTH, V]``: the model's ``log p_T`` at each position of ``seq``."""
    cache = model.new_cache(1, LENGTH + 1)
    first = model.prefill(torch.tensor(PROMPT), cache)
    rest = model.decode(torch.tensor([seq[:-1]]), cache)[0]
    return torch.log_softmax(torch.cat((first[None], rest)).double()[:, :V] / T, -1)


def exact_log_probs(model: LlamaCppModel) -> dict[tuple[int, ...], float]:
    """``log p_T(x_1..x_3 | PROMPT)`` of every sequence, from the model's own logits."""
    out = {}
    for seq in itertools.product(range(V), repeat=LENGTH):
        lp = _position_log_probs(model, seq)
        out[seq] = float(lp[torch.arange(LENGTH), torch.tensor(seq)].sum())
    return out


def plain_drafting_log_probs(target: LlamaCppModel, draft: LlamaCppModel) -> dict:
    """SMC-SD with one particle and K=2 over 3 tokens: x0 from the target, x1 and x2 from
    the draft (whatever the weight), from the models' own logits."""
    out = {}
    for seq in itertools.product(range(V), repeat=LENGTH):
        p, q = _position_log_probs(target, seq), _position_log_probs(draft, seq)
        out[seq] = float(p[0, seq[0]] + q[1, seq[1]] + q[2, seq[2]])
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("stat-llamacpp")
    settings = LlamaCppSettings(
        threads=1, kv_cells=1024, kv_type="f32", max_sequences=64, n_batch=256
    )
    target, draft = (
        LlamaCppModel(make_tiny_gguf(root, "qwen2", V, seed=s, num_hidden_layers=1)[0], settings)
        for s in (1, 2)
    )
    return target, draft, exact_log_probs(target)


def _sample(decode, target, draft, cfg, runs: int, seed0: int = 0) -> Counter:
    counts: Counter = Counter()
    for i in range(seed0, seed0 + runs):
        out = decode(target, draft, PROMPT, cfg, frozenset(), V, torch.Generator().manual_seed(i))
        counts[tuple(out.tokens)] += 1
    return counts


SD_CFG = GenerationConfig(
    method="sd", max_new_tokens=LENGTH, draft_tokens=2, temperature=T, draft_temperature=T
)


def test_draft_differs_from_target(pair):
    target, draft, exact = pair
    other = exact_log_probs(draft)
    tv = 0.5 * sum(abs(math.exp(exact[k]) - math.exp(other[k])) for k in exact)
    assert tv > 0.5  # measured 0.58: a wrong rule shows


def test_sd_matches_the_target_on_llamacpp(pair):
    target, draft, exact = pair
    runs = 3000
    counts = _sample(decode_sd, target, draft, SD_CFG, runs)
    # chi-square over the 64 sequences, p-value bound 1e-3; TV at sampling noise (~0.06)
    assert chisquare_p(exact, counts, runs) > 1e-3
    assert total_variation(exact, counts, runs) < 0.1


def test_a_wrong_acceptance_rule_fails_on_llamacpp(pair, monkeypatch):
    target, draft, exact = pair

    def accept_all(draft_tokens, draft_probs, target_probs, generator):
        k = draft_tokens.shape[0]
        return k, int(torch.multinomial(target_probs[k], 1, generator=generator))

    monkeypatch.setattr(sd_module, "speculative_verify", accept_all)

    def fails(counts: Counter, runs: int) -> bool:
        # chi-square p < 1e-6 (the test above needs > 1e-3); the TV above 0.1 (the bound
        # the test above meets) with confidence 1 - 1e-3
        return (
            chisquare_p(exact, counts, runs) < 1e-6
            and tv_lower_bound(exact, counts, runs, outcomes=V**LENGTH, delta=1e-3) > 0.1
        )

    # sequential: looks after 250, 500 and 1,000 runs, stopping at the first that fails
    # (decided at 500: p 3e-195, TV 0.42, its bound 0.16; at 250 the bound was 0.07)
    counts, runs = until_decided(
        lambda start, m: _sample(decode_sd, target, draft, SD_CFG, m, start), fails, 1000
    )
    assert fails(counts, runs)


def test_smc_error_falls_with_particles_on_llamacpp(pair):
    target, draft, exact = pair
    runs = 1500

    def tv(n: int) -> float:
        cfg = GenerationConfig(
            method="smc", max_new_tokens=LENGTH, particles=n, draft_tokens=2,
            temperature=T, draft_temperature=T,
        )  # fmt: skip
        return total_variation(exact, _sample(decode_smc, target, draft, cfg, runs), runs)

    # N=1 is plain drafting: its distribution enumerated from the models' logits (exact TV
    # 0.480; 1,500 sampled runs measured 0.50)
    one = plain_drafting_log_probs(target, draft)
    tv1 = 0.5 * sum(abs(math.exp(one[k]) - math.exp(exact[k])) for k in exact)
    tv16 = tv(16)
    # measured 0.11 at N=16 (3000 runs); sampling noise at 1500 runs is about 0.08
    assert tv1 > 0.35
    assert tv16 < 0.25 and tv16 < tv1 / 2


def test_multi_draft_sd_matches_the_target_on_llamacpp(pair):
    """Multi-draft sd (N=4 chains of K=1) over 4 tokens: two rounds, the second on caches
    that took the accepting chain's rows (llama.cpp sequence copies) and rolled back."""
    target, _, _ = pair
    draft = pair[1]
    length = 4
    exact = {}
    for seq in itertools.product(range(V), repeat=length):
        cache = target.new_cache(1, length + 1)
        first = target.prefill(torch.tensor(PROMPT), cache)
        rest = target.decode(torch.tensor([seq[:-1]]), cache)[0]
        lp = torch.log_softmax(torch.cat((first[None], rest)).double()[:, :V] / T, -1)
        exact[seq] = float(lp[torch.arange(length), torch.tensor(seq)].sum())
    cfg = GenerationConfig(
        method="sd", particles=4, max_new_tokens=length, draft_tokens=1, temperature=T,
        draft_temperature=T,
    )  # fmt: skip
    runs = 3000
    counts = _sample(decode_multi_sd, target, draft, cfg, runs)
    # chi-square over the 256 sequences (expected counts 3-80), p-value bound 1e-3; TV at
    # sampling noise (about 0.1 at 3000 runs over these sequences)
    assert chisquare_p(exact, counts, runs) > 1e-3
    assert total_variation(exact, counts, runs) < 0.15
