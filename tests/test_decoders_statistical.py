"""Statistical checks of the decoders on tiny models whose target distribution is enumerable.

Exact SD must reproduce the target's distribution over the first 3 generated tokens; SMC-SD's
distribution must approach it as N grows. All runs are seeded, so the tests are
deterministic; the thresholds are stated next to each assertion. One torch thread (the tiny
forwards are overhead-bound).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from enumerable import (
    one_particle_log_probs,
    sequence_log_probs,
    tiny_transformer,
    total_variation,
    tv_lower_bound,
    until_decided,
)
from scipy.stats import chisquare

import smcspec.decoding.sd.chain as sd_module
from smcspec.config import GenerationConfig
from smcspec.decoding import decode_sd, decode_smc

# the slow tier (pyproject.toml); CI runs it; one torch thread, inference mode (conftest)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread", "inference_mode")]

PROMPT = [1, 2, 0]
T = 1.0
LENGTH = 3


@pytest.fixture(scope="module")
def pair():
    target, draft = tiny_transformer(seed=1), tiny_transformer(seed=2)
    exact = sequence_log_probs(target, PROMPT, LENGTH, T)
    return target, draft, exact


def _sample(decode, target, draft, cfg, runs, seed0=0):
    counts = Counter()
    for i in range(runs):
        g = torch.Generator().manual_seed(seed0 + i)
        out = decode(target, draft, PROMPT, cfg, frozenset(), target.cfg.vocab_size, g)
        counts[tuple(out.tokens)] += 1
    return counts


def _chisquare_p(exact: dict, counts: Counter, runs: int) -> float:
    keys = sorted(exact)
    expected = [math.exp(exact[k]) * runs for k in keys]
    observed = [counts.get(k, 0) for k in keys]
    scale = sum(observed) / sum(expected)  # exact probs sum to 1 up to rounding
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def _wrong_verify(draft_tokens, draft_probs, target_probs, generator):
    """A broken rule that accepts every draft token (output = draft distribution)."""
    k = draft_tokens.shape[0]
    nxt = int(torch.multinomial(target_probs[k], 1, generator=generator))
    return k, nxt


SD_CFG = GenerationConfig(
    method="sd", max_new_tokens=LENGTH, draft_tokens=2, temperature=T, draft_temperature=T
)
SD_RUNS = 5000


def test_draft_differs_from_target(pair):
    target, draft, exact = pair
    draft_exact = sequence_log_probs(draft, PROMPT, LENGTH, T)
    tv = 0.5 * sum(abs(math.exp(exact[k]) - math.exp(draft_exact[k])) for k in exact)
    assert tv > 0.5  # otherwise the tests below could not tell a wrong rule apart


def test_sd_matches_target_distribution(pair):
    target, draft, exact = pair
    counts = _sample(decode_sd, target, draft, SD_CFG, SD_RUNS)
    # chi-square goodness of fit over the 64 sequences: fixed seeds, p-value bound 1e-3
    assert _chisquare_p(exact, counts, SD_RUNS) > 1e-3
    # and the TV distance is at sampling-noise level (~0.05 expected at 5000 runs)
    assert total_variation(exact, counts, SD_RUNS) < 0.08


def test_sd_matches_target_distribution_at_other_temperatures(pair):
    # the evaluations sample at T = 0.7: exactness must hold for any T_t and T_d
    target, draft, _ = pair
    t_t, t_d = 0.7, 0.5
    exact = sequence_log_probs(target, PROMPT, LENGTH, t_t)
    cfg = GenerationConfig(
        method="sd", max_new_tokens=LENGTH, draft_tokens=2, temperature=t_t, draft_temperature=t_d
    )
    counts = _sample(decode_sd, target, draft, cfg, SD_RUNS, seed0=10_000)
    assert _chisquare_p(exact, counts, SD_RUNS) > 1e-3
    assert total_variation(exact, counts, SD_RUNS) < 0.08


def _fails_clearly(exact: dict, counts: Counter, runs: int) -> bool:
    """The exactness bounds above failed beyond doubt: chi-square p < 1e-6 (they need
    > 1e-3), and a lower confidence bound (level 1 - 1e-3) on the TV above 0.15 (they need
    the estimate below 0.08)."""
    return (
        _chisquare_p(exact, counts, runs) < 1e-6
        and tv_lower_bound(exact, counts, runs, outcomes=len(exact), delta=1e-3) > 0.15
    )


def test_wrong_acceptance_rule_fails_the_same_test(pair, monkeypatch):
    """Sequential: looks after 250, 500, ... runs (at most SD_RUNS), stopping at the first
    that shows the failure (decided at 500 runs: measured p 7e-101, TV 0.42, its lower bound
    0.159; at 250 runs the bound was 0.092)."""
    target, draft, exact = pair
    monkeypatch.setattr(sd_module, "speculative_verify", _wrong_verify)
    counts, runs = until_decided(
        lambda start, m: _sample(decode_sd, target, draft, SD_CFG, m, seed0=start),
        lambda c, n: _fails_clearly(exact, c, n),
        SD_RUNS,
    )
    assert _fails_clearly(exact, counts, runs)


def _smc_cfg(n: int) -> GenerationConfig:
    return GenerationConfig(
        method="smc",
        max_new_tokens=LENGTH,
        particles=n,
        draft_tokens=2,
        temperature=T,
        draft_temperature=T,
        ess_threshold=0.5,
    )


def test_smc_error_falls_with_particles(pair):
    target, draft, exact = pair
    runs = 3000
    # N=1 is plain drafting: x0 from the target, the next two tokens from the draft; its
    # distribution is enumerated (exact TV 0.607; 3000 sampled runs measured 0.59)
    one = one_particle_log_probs(target, draft, PROMPT, LENGTH, draft_tokens=2)
    tv1 = 0.5 * sum(abs(math.exp(one[k]) - math.exp(exact[k])) for k in exact)
    tv16 = total_variation(exact, _sample(decode_smc, target, draft, _smc_cfg(16), runs), runs)
    # The error must fall with N: at N=16 below 0.30 and below half of N=1's (measured 0.24
    # with these seeds; sampling noise at 3000 runs is about 0.07).
    assert tv1 > 0.45
    assert tv16 < 0.30
    assert tv16 < tv1 / 2


def test_smc_with_draft_equal_target_is_exact_and_never_resamples(pair):
    target, _, exact = pair
    cfg = GenerationConfig(
        method="smc",
        max_new_tokens=9,
        particles=4,
        draft_tokens=3,
        temperature=T,
        draft_temperature=T,
        return_particles=True,
    )
    for seed in range(5):
        out = decode_smc(
            target, target, PROMPT, cfg, frozenset(), 4, torch.Generator().manual_seed(seed)
        )
        assert out.stats.resamples == 0
        # log p - log q is 0 up to float32 rounding of two forwards of different shapes
        assert all(p.weight == pytest.approx(0.25, abs=1e-5) for p in out.particles)
        assert out.log_normalizer == pytest.approx(0.0, abs=1e-4)
        assert out.stats.min_ess == pytest.approx(4.0)


def _brute_log_weight(
    target, draft, seq: list[int], k: int, alpha: float, t_t: float = T, t_d: float = T
) -> float:
    """sum_k alpha log p_T(d_k) - log q_T(d_k) for the drafted tokens seq[1:k+1]."""
    total = 0.0
    for j in range(1, k + 1):
        ctx = PROMPT + seq[:j]
        lp = []
        for model, temp in ((target, t_t), (draft, t_d)):
            cache = model.new_cache(1, 2)
            logits = model.prefill(torch.tensor(ctx), cache)
            lp.append(torch.log_softmax(logits.double() / temp, -1)[seq[j]].item())
        total += alpha * lp[0] - lp[1]
    return total


@pytest.mark.parametrize("t_t, t_d", [(T, T), (0.7, 0.5), (0.5, 0.7)])
def test_smc_weights_equal_brute_force(pair, t_t, t_d):
    """The weight uses p at T_t and q at T_d; at T_t != T_d, swapping them (or weighting with
    q at T_t) moves these weights far beyond the tolerance (measured 0.038 apart)."""
    target, draft, _ = pair
    k, n = 3, 6
    cfg = GenerationConfig(
        method="smc",
        max_new_tokens=1 + k + 1,
        particles=n,
        draft_tokens=k,
        temperature=t_t,
        draft_temperature=t_d,
        ess_threshold=0.0,
        return_particles=True,
    )
    out = decode_smc(target, draft, PROMPT, cfg, frozenset(), 4, torch.Generator().manual_seed(3))
    got = torch.tensor([p.weight for p in out.particles], dtype=torch.float64)

    def brute(t_p: float, t_q: float) -> torch.Tensor:
        logw = [_brute_log_weight(target, draft, p.tokens, k, 1.0, t_p, t_q) for p in out.particles]
        return torch.softmax(torch.tensor(logw, dtype=torch.float64), 0)

    torch.testing.assert_close(got, brute(t_t, t_d), atol=1e-5, rtol=1e-4)
    assert out.stats.resamples == 0  # kappa = 0 disables resampling
    if t_t != t_d:
        with pytest.raises(AssertionError):
            torch.testing.assert_close(got, brute(t_d, t_t), atol=1e-5, rtol=1e-4)
