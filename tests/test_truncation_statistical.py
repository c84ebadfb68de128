"""Statistical checks of top-k / top-p / min-p in the decoders, on tiny enumerable models.

The processed target ``p~`` (the tempered target truncated and renormalised at every step)
has an exactly computable distribution over the first 3 generated tokens
(:func:`enumerable.processed_sequence_log_probs`, brute force, independent of the
implementation). AR and exact SD must reproduce it; SMC-SD's error must fall with N; a
deliberately wrong rule must fail the same test. Runs are seeded (deterministic); the
thresholds are stated next to each assertion. One torch thread and inference mode keep a run
at a few milliseconds (the tiny forwards are overhead-bound).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from enumerable import (
    one_particle_log_probs,
    processed_sequence_log_probs,
    reference_kept,
    sequence_log_probs,
    tiny_transformer,
    total_variation,
    until_decided,
)
from scipy.stats import chisquare

import smcspec.decoding.sd.chain as sd_module
import smcspec.decoding.smc.block as smc_block
from smcspec.config import GenerationConfig
from smcspec.decoding import decode_ar, decode_sd, decode_smc
from smcspec.sampling.truncation import truncate_log_probs

pytestmark = pytest.mark.slow  # the slow tier (pyproject.toml); CI runs it

PROMPT = [1, 2, 0]
T = 1.0
LENGTH = 3
VOCAB = 4
SETTINGS = {
    "top_k=2": {"top_k": 2},
    "top_p=0.8": {"top_p": 0.8},
    "min_p=0.3": {"min_p": 0.3},
    "top_p=0.8,min_p=0.3": {"top_p": 0.8, "min_p": 0.3},
}


@pytest.fixture(scope="module")
def pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target, draft = tiny_transformer(seed=1), tiny_transformer(seed=2)
    exact = {name: _exact(target, s) for name, s in SETTINGS.items()}
    yield target, draft, exact
    torch.set_num_threads(threads)


def _exact(model, setting: dict) -> dict:
    return processed_sequence_log_probs(model, PROMPT, LENGTH, T, **setting)


def _cfg(method: str, setting: dict, **kw) -> GenerationConfig:
    base = {"max_new_tokens": LENGTH, "draft_tokens": 2, "temperature": T, "draft_temperature": T}
    return GenerationConfig(method=method, **{**base, **setting, **kw}).validate()


def _sample(decode, models, cfg, runs: int, seed0: int = 0, **kw) -> Counter:
    counts: Counter = Counter()
    with torch.inference_mode():
        for i in range(runs):
            g = torch.Generator().manual_seed(seed0 + i)
            out = decode(*models, PROMPT, cfg, frozenset(), VOCAB, g, **kw)
            counts[tuple(out.tokens)] += 1
    return counts


def _chisquare_p(exact: dict, counts: Counter, runs: int) -> float:
    """Goodness of fit over the sequences ``p~`` can produce; a sample outside them is a
    failure by itself, so it gives p = 0."""
    support = [k for k in sorted(exact) if exact[k] > -math.inf]
    if any(k not in exact or exact[k] == -math.inf for k in counts):
        return 0.0
    expected = [math.exp(exact[k]) * runs for k in support]
    observed = [counts.get(k, 0) for k in support]
    scale = sum(observed) / sum(expected)  # exact probs sum to 1 up to rounding
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def _tv_exact(a: dict, b: dict) -> float:
    keys = set(a) | set(b)
    return 0.5 * sum(
        abs(math.exp(a.get(k, -math.inf)) - math.exp(b.get(k, -math.inf))) for k in keys
    )


@pytest.mark.parametrize("name", list(SETTINGS))
def test_settings_really_cut_and_match_the_implementation(pair, name):
    target, _, exact = pair
    untruncated = sequence_log_probs(target, PROMPT, LENGTH, T)
    support = sum(v > -math.inf for v in exact[name].values())
    # each setting removes sequences and moves at least 0.15 of the probability mass
    # (measured: TV 0.66, 0.35, 0.18, 0.47 for the four settings; supports 8, 26, 38, 19 of 64)
    assert support < VOCAB**LENGTH
    assert _tv_exact(untruncated, exact[name]) > 0.15
    # the float32 implementation keeps the same sets as the float64 brute force at every
    # context of the enumeration (so no decision sits on a rounding boundary)
    with torch.inference_mode():
        for ctx in ([], [0], [1], [2], [3], [3, 1], [1, 2], [0, 0]):
            cache = target.new_cache(1, 4)
            logits = target.prefill(torch.tensor(PROMPT + ctx), cache)
            lp = truncate_log_probs(torch.log_softmax(logits.float() / T, -1), **SETTINGS[name])
            ref = reference_kept(torch.softmax(logits.double() / T, -1).numpy(), **SETTINGS[name])
            assert torch.isfinite(lp).tolist() == ref.tolist()


AR_RUNS = 1500


@pytest.mark.parametrize("name", ["top_k=2", "top_p=0.8", "min_p=0.3"])
def test_ar_matches_the_processed_target(pair, name):
    target, _, exact = pair
    counts = _sample(decode_ar, (target,), _cfg("ar", SETTINGS[name]), AR_RUNS)
    # chi-square over the support of p~ (fixed seeds): p-value bound 1e-3
    assert _chisquare_p(exact[name], counts, AR_RUNS) > 1e-3
    # TV at sampling-noise level: about 0.02-0.06 for 8-38 sequences at 1500 runs
    assert total_variation(exact[name], counts, AR_RUNS) < 0.08


SD_RUNS = 2000


@pytest.mark.parametrize("name", ["top_k=2", "top_p=0.8,min_p=0.3"])
def test_sd_matches_the_processed_target(pair, name):
    target, draft, exact = pair
    # the draft's own kept set differs a lot from the target's here (TV between their
    # processed sequence distributions 1.0 and 0.97): acceptance and residual both matter
    assert _tv_exact(_exact(draft, SETTINGS[name]), exact[name]) > 0.9
    counts = _sample(decode_sd, (target, draft), _cfg("sd", SETTINGS[name]), SD_RUNS)
    assert _chisquare_p(exact[name], counts, SD_RUNS) > 1e-3  # p-value bound 1e-3
    assert total_variation(exact[name], counts, SD_RUNS) < 0.07  # noise about 0.02-0.04


def _unprocessed_target_in_verification(log_probs, top_k, top_p, min_p):
    """A wrong SD rule: truncation for the first token and the draft (1-D rows) but not for
    the target's block ``[K+1, V]`` that the accept/reject rule and the residual use."""
    if log_probs.dim() == 2:
        return log_probs
    return truncate_log_probs(log_probs, top_k, top_p, min_p)


def test_sd_with_the_target_unprocessed_in_verification_fails(pair, monkeypatch):
    """Sequential: looks after 250, 500, ... runs (at most SD_RUNS), stopping at the first
    where the exactness bounds above fail beyond doubt: chi-square p < 1e-6, and the TV above
    0.2 with confidence 1 - 1e-3: the TV is at least the mass outside p~'s support, whose
    share of the runs is at most ``sqrt(ln(1e3) / 2n)`` below it (Hoeffding). Decided at 250
    runs: 104 outside p~'s support (bound 0.30), TV 0.42; 2,000 runs measured 884, TV 0.44."""
    target, draft, exact = pair
    monkeypatch.setattr(sd_module, "truncate_log_probs", _unprocessed_target_in_verification)
    name = "top_k=2"
    cfg = _cfg("sd", SETTINGS[name])

    def fails(counts: Counter, runs: int) -> bool:
        outside = sum(c for k, c in counts.items() if exact[name].get(k, -math.inf) == -math.inf)
        return (
            _chisquare_p(exact[name], counts, runs) < 1e-6
            and outside / runs - math.sqrt(math.log(1e3) / (2 * runs)) > 0.2
        )

    counts, runs = until_decided(
        lambda start, m: _sample(decode_sd, (target, draft), cfg, m, seed0=start), fails, SD_RUNS
    )
    assert fails(counts, runs)


SMC_RUNS = 1500
SMC_SETTING = "top_k=2"


def _unprocessed_target_weights(log_probs, top_k, top_p, min_p):
    """A wrong SMC-SD rule: weights from ``log p_T`` of the drafted tokens (the target's
    ``[N, K, V]`` block) instead of ``log p~``; x0 and the bonus still from ``p~``."""
    if log_probs.dim() == 3:
        return log_probs
    return truncate_log_probs(log_probs, top_k, top_p, min_p)


def test_smc_error_falls_with_particles_and_a_wrong_weight_rule_stays_higher(pair, monkeypatch):
    target, draft, exact = pair
    ex = exact[SMC_SETTING]
    setting = SETTINGS[SMC_SETTING]
    # N=1 is plain drafting: x0 from p~, two tokens from the untruncated draft; enumerated
    one = one_particle_log_probs(target, draft, PROMPT, LENGTH, 2, **setting)
    tv = {
        1: _tv_exact(ex, one),
        16: total_variation(
            ex,
            _sample(decode_smc, (target, draft), _cfg("smc", setting, particles=16), SMC_RUNS),
            SMC_RUNS,
        ),
    }
    monkeypatch.setattr(smc_block, "truncate_log_probs", _unprocessed_target_weights)
    cfg16 = _cfg("smc", setting, particles=16)
    wrong = total_variation(ex, _sample(decode_smc, (target, draft), cfg16, SMC_RUNS), SMC_RUNS)
    # N=1 is plain drafting (exact TV 0.901 here: the draft favours tokens the target's
    # top-2 drops; 1,500 sampled runs measured 0.90). The error must fall with N: at N=16
    # below 0.5 and at least 0.3 below N=1's (measured 0.41 with these seeds; noise at 1500
    # runs is about 0.05).
    assert tv[1] > 0.75
    assert tv[16] < 0.5
    assert tv[16] < tv[1] - 0.3
    # weights from the unprocessed target leave drafted tokens outside the kept set alive:
    # clearly higher at N=16 (measured 0.62 vs 0.41; margin 0.1)
    assert wrong > tv[16] + 0.1


def test_smc_with_the_truncated_draft_does_not_converge(pair):
    # The draft proposing from its own truncated q~ (as SD does) cannot propose tokens the
    # target keeps but the draft's filter drops, so SMC-SD's error does not fall with N:
    # why smc drafts from the untruncated q_T. Here (min_p=0.3) its TV is 0.568 at N=16 and
    # at N=64: the p~ mass of the sequences it can never produce, whatever N (vs 0.31 with
    # q_T at N=16); at 400 runs the noise is about 0.08.
    target, draft, exact = pair
    name, runs = "min_p=0.3", 400
    tvs = {}
    for n, trunc in ((16, True), (64, True), (16, False)):
        cfg = _cfg("smc", SETTINGS[name], particles=n)
        counts = _sample(decode_smc, (target, draft), cfg, runs, truncate_draft=trunc)
        tvs[(n, trunc)] = total_variation(exact[name], counts, runs)
    assert tvs[(16, True)] > 0.45 and tvs[(64, True)] > 0.45
    assert tvs[(16, False)] < tvs[(16, True)] - 0.15


def _brute_log_weight(target, draft, seq, k: int, alpha: float, setting: dict) -> float:
    """``sum_j alpha log p~(d_j) - log q_T(d_j)`` over the drafted seq[1:k+1] plus the bonus
    term ``log sum_v p~(v)^alpha`` at position k+1, in float64 with the brute-force sets."""
    total = 0.0
    for j in range(1, k + 2):
        ctx = PROMPT + seq[:j]
        lp = []
        for model in (target, draft):
            logits = model.prefill(torch.tensor(ctx), model.new_cache(1, 2))
            lp.append(torch.log_softmax(logits.double() / T, -1))
        p = lp[0].exp().numpy()
        keep = torch.from_numpy(reference_kept(p, **setting))
        p_tilde = torch.where(keep, lp[0], -math.inf) - math.log(p[keep.numpy()].sum())
        if j <= k:
            total += alpha * float(p_tilde[seq[j]]) - float(lp[1][seq[j]])
        else:
            total += float(torch.logsumexp(alpha * p_tilde, 0))
    return total


@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_smc_weights_equal_brute_force_with_truncation(pair, alpha):
    target, draft, _ = pair
    k, n = 2, 8
    setting = SETTINGS["min_p=0.3"]
    cfg = _cfg(
        "smc",
        setting,
        max_new_tokens=1 + k + 1,
        particles=n,
        ess_threshold=0.0,
        alpha=alpha,
        return_particles=True,
    )
    with torch.inference_mode():
        out = decode_smc(
            target, draft, PROMPT, cfg, frozenset(), VOCAB, torch.Generator().manual_seed(5)
        )
        logw = torch.tensor(
            [_brute_log_weight(target, draft, p.tokens, k, alpha, setting) for p in out.particles],
            dtype=torch.float64,
        )
    assert out.stats.resamples == 0 and out.stats.degenerate_weights == 0
    assert (logw == -math.inf).any() and (logw > -math.inf).any()  # some particles die
    got = torch.tensor([p.weight for p in out.particles], dtype=torch.float64)
    # tolerance 1e-5 absolute: float32 forwards and log-probs against float64 brute force
    torch.testing.assert_close(got, torch.softmax(logw, 0), atol=1e-5, rtol=1e-4)
