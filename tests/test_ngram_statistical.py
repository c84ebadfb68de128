"""Exact speculative decoding with n-gram drafts (:mod:`smcspec.decoding.sd.ngram`).

The n-gram proposal is a point mass; the exact rule accepts a drafted token with probability
``p(x)`` and resamples from ``p`` without it on a rejection, so the output must follow the
target exactly, whatever is drafted. Checked on a tiny enumerable target (4 tokens, a prompt
whose n-grams recur, so that most rounds draft): chi-square over the 256 sequences of 4
tokens at T = 1, at T = 0.5 with top-k, with the adaptive draft length and with the gate of
``draft_p_min`` (drafting only while the target backs the proposals); a broken rule that
accepts every drafted token must fail the same test. At T = 0 the output equals greedy
``ar``'s. Fixed seeds throughout.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from enumerable import (
    processed_sequence_log_probs,
    sequence_log_probs,
    tiny_transformer,
    total_variation,
    until_decided,
)

import smcspec.decoding.sd.chain as sd_module
from smcspec.config import GenerationConfig
from smcspec.decoding import decode_ar, decode_ngram_sd
from smcspec.decoding.registry import decoder_for
from smcspec.decoding.sd.ngram import NgramGate, NgramIndex, next_draft_length
from smcspec.errors import ConfigError

# the slow tier (pyproject.toml); CI runs it; one torch thread (tiny forwards), inference mode
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread", "inference_mode")]

PROMPT = [1, 2, 0, 3, 1, 2, 0, 3, 1, 2]
V, LENGTH, RUNS = 4, 4, 3000


@pytest.fixture(scope="module")
def target():
    return tiny_transformer(seed=1, vocab=V, scale=1.0)


def _cfg(**kw) -> GenerationConfig:
    # ungated, fixed length, unless a test says otherwise (the defaults: NGRAM_DRAFT_P_MIN,
    # draft_schedule "confidence")
    base = dict(method="sd", draft="ngram", max_new_tokens=LENGTH, draft_tokens=2,
                temperature=1.0, draft_p_min=0.0, draft_schedule="fixed")  # fmt: skip
    return GenerationConfig(**{**base, **kw}).validate()


def pooled_chisquare_p(exact: dict, counts: Counter, runs: int) -> float:
    """Chi-square p-value of ``counts`` against ``exact`` log-probs, the sequences expected
    fewer than 5 times pooled into one cell (so that the test keeps its calibration)."""
    from scipy.stats import chisquare

    big = [k for k in exact if math.exp(exact[k]) * runs >= 5]
    rest = [k for k in exact if k not in set(big)]
    observed = [counts.get(k, 0) for k in big] + [sum(counts.get(k, 0) for k in rest)]
    expected = [math.exp(exact[k]) * runs for k in big]
    expected.append(runs - sum(expected))
    return float(chisquare(observed, expected).pvalue)


def _sample(
    target, cfg: GenerationConfig, runs: int = RUNS, seed0: int = 0
) -> tuple[Counter, int, int]:
    """Output counts, drafted tokens and gated rounds over ``runs`` requests seeded from
    ``seed0``."""
    counts: Counter = Counter()
    drafted = gated = 0
    for i in range(seed0, seed0 + runs):
        g = torch.Generator().manual_seed(i)
        out = decode_ngram_sd(target, PROMPT, cfg, frozenset(), V, g)
        counts[tuple(out.tokens)] += 1
        drafted += out.stats.drafted
        gated += out.stats.gated_rounds or 0
    return counts, drafted, gated


def test_the_index_proposes_the_longest_recent_match():
    index = NgramIndex(n_max=3)
    index.extend([5, 6, 7, 8, 9, 6, 7, 1, 5, 6, 7])
    assert index.propose(2) == [8, 9]  # the longest match, "5 6 7", continued with 8 9
    # (the shorter "6 7" continued more recently, with 1: the longest n-gram wins)
    index.extend([8])
    assert index.propose(3) == [9, 6, 7]  # "6 7 8" recurs once
    empty = NgramIndex()
    empty.extend([1, 2, 3])
    assert empty.propose(4) == []  # nothing recurs
    assert NgramIndex().propose(2) == []
    bigrams = NgramIndex(n_min=2)
    bigrams.extend([4, 9, 4])
    assert bigrams.propose(2) == []  # only the 1-gram "4" recurs
    bigrams.extend([9])
    assert bigrams.propose(2) == [4, 9]  # "4 9" recurs: what followed it
    with pytest.raises(ValueError):
        NgramIndex(n_max=2, n_min=3)


def test_the_index_proposes_the_most_recent_occurrence():
    """An n-gram that recurred with different continuations proposes what followed it last
    (the text copies its most recent context), for every n-gram length matched.

    Broken variant it catches: an index that keeps each n-gram's first occurrence
    (``setdefault`` in ``extend``: proposes [4, 1] then [4], [9] and [4])."""
    index = NgramIndex(n_max=3)
    index.extend([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3])
    assert index.propose(2) == [5, 1]  # "1 2 3" continued with 4, then with 5
    bigram = NgramIndex(n_max=2)
    bigram.extend([7, 8, 4, 7, 8, 6, 0, 7, 8])
    assert bigram.propose(1) == [6]
    unigram = NgramIndex(n_max=1)
    unigram.extend([2, 9, 2, 5, 2])
    assert unigram.propose(1) == [5]
    later = NgramIndex(n_max=3)  # the occurrence registered last wins as tokens arrive
    for t in [6, 6, 4, 6, 6, 0, 6, 6]:
        later.extend([t])
    assert later.propose(1) == [0]


@pytest.mark.parametrize(
    "kw",
    # adaptive: 5 tokens, so that a round after a rejection drafts 1 where fixed drafts 2
    [
        {},
        {"temperature": 0.5, "top_k": 3},
        {"draft_schedule": "adaptive", "max_new_tokens": 5},
        {"draft_p_min": 0.3, "max_new_tokens": 5, "draft_tokens": 1},
        {"draft_p_min": 0.3, "max_new_tokens": 5, "draft_schedule": "confidence"},
    ],
    ids=["T=1", "T=0.5,top_k=3", "adaptive", "gated", "confidence"],
)
def test_ngram_sd_samples_the_target_exactly(target, kw):
    cfg = _cfg(**kw)
    length = cfg.max_new_tokens
    # T=0.5, top-k 3: 81 sequences kept, the mass on few of them: 1,000 runs reach a TV
    # (0.032) about half the bound; the other settings 3,000 runs
    runs = 1000 if "top_k" in kw else RUNS
    if "top_k" in kw:
        exact = processed_sequence_log_probs(target, PROMPT, length, cfg.temperature,
                                             top_k=cfg.top_k)  # fmt: skip
    else:
        exact = sequence_log_probs(target, PROMPT, length, 1.0)
    counts, drafted, gated = _sample(target, cfg, runs)
    if "draft_p_min" in kw:  # 1 token a round: the gate closes in some runs, not in others
        assert drafted >= runs and gated >= 0.2 * runs
    else:
        assert drafted >= 1.5 * runs  # most runs drafted 2 tokens in their one round
    exact = {seq: lp for seq, lp in exact.items() if lp > -math.inf}  # top-k's kept sets
    assert set(counts) <= set(exact)  # nothing outside them is ever drawn
    # chi-square over the sequences (those expected fewer than 5 times pooled), p > 1e-3;
    # measured p 0.13 (T=1), 0.093 (T=0.5, top-k 3, 1,000 runs; 0.79 at 3,000), 0.145
    # (adaptive, which drafted 10,620 tokens against fixed K's 11,151 on the same seeds),
    # 0.28 (gated: 4,239 tokens drafted, 4,699 proposals kept from drafting); TV at sampling
    # noise (0.033, 0.032 (0.015 at 3,000), 0.049 over 1,024 sequences, 0.046); confidence:
    # p 0.35, TV 0.046 (its cut is rare here: the next test forces it). A rule accepting
    # every drafted token, at T=0.5 with top-k 3 over these 1,000 runs: 2 sequences
    # outside the kept sets, TV 0.999
    assert pooled_chisquare_p(exact, counts, runs) > 1e-3
    assert total_variation(exact, counts, runs) < 0.06


def test_rounds_the_gate_cuts_short_stay_exact(target, monkeypatch):
    """``draft_schedule="confidence"`` drafts a prefix of the proposal. On this tiny target
    the real gate's cut is rare in 5-token runs, so the gate's length is replaced by a rule
    that cuts most rounds, from the past only (the number of first-position observations):
    the decoder's partial drafts, verified by the exact rule, must still sample the target."""
    from smcspec.decoding.sd import ngram

    cuts = Counter()

    def cut(gate: NgramGate, k: int) -> int:
        n = min(k, len(gate.positions[0]) % (k + 1)) if gate.positions else k
        cuts["partial"] += 0 < n < k
        return n

    monkeypatch.setattr(ngram.NgramGate, "length", cut)
    cfg = _cfg(draft_p_min=0.3, max_new_tokens=5, draft_tokens=3, draft_schedule="confidence")
    exact = sequence_log_probs(target, PROMPT, cfg.max_new_tokens, 1.0)
    counts, drafted, _ = _sample(target, cfg)
    assert cuts["partial"] >= 0.1 * RUNS and drafted >= RUNS
    # measured: p 0.52 (TV 0.049 over 1,024 sequences), 541 rounds cut short, 10,518 drafted
    assert pooled_chisquare_p(exact, counts, RUNS) > 1e-3
    assert total_variation(exact, counts, RUNS) < 0.06


def test_a_rule_that_accepts_every_drafted_token_fails(target, monkeypatch):
    """Sequential: looks after 250, 500 and 1,000 runs, stopping at the first where the
    chi-square p-value is below 1e-6 (the test above needs > 1e-3); decided at 250 runs
    (p 4e-257)."""

    def accept_all(draft_tokens, draft_probs, target_probs, generator):
        k = draft_tokens.shape[0]
        return k, int(torch.multinomial(target_probs[k], 1, generator=generator))

    monkeypatch.setattr(sd_module, "speculative_verify", accept_all)
    exact = sequence_log_probs(target, PROMPT, LENGTH, 1.0)
    counts, runs = until_decided(
        lambda start, m: _sample(target, _cfg(), m, seed0=start)[0],
        lambda c, n: pooled_chisquare_p(exact, c, n) < 1e-6,
        1000,
    )
    assert pooled_chisquare_p(exact, counts, runs) < 1e-6


def test_the_adaptive_draft_length_follows_acceptance():
    assert next_draft_length(4, 8, drafted=4, accepted=4) == 6  # all accepted: 2 more
    assert next_draft_length(7, 8, drafted=7, accepted=7) == 8  # never past draft_tokens
    assert next_draft_length(4, 8, drafted=4, accepted=1) == 3  # a rejection: 1 fewer
    assert next_draft_length(1, 8, drafted=1, accepted=0) == 1  # never below 1
    assert next_draft_length(5, 8, drafted=0, accepted=0) == 5  # nothing drafted: unchanged
    assert next_draft_length(3, 8, drafted=2, accepted=2) == 5  # a short match, all accepted


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("schedule", ["fixed", "adaptive", "gated", "confidence"])
def test_greedy_ngram_sd_equals_greedy_ar(target, seed, schedule):
    prompt = [int(t) for t in torch.randint(0, V, (12,), generator=torch.Generator()
                                            .manual_seed(seed))]  # fmt: skip
    gate = {"draft_p_min": 0.5} if schedule == "gated" else {"draft_schedule": schedule}
    if schedule == "confidence":
        gate["draft_p_min"] = 0.5
    cfg = _cfg(temperature=0.0, max_new_tokens=24, **gate)
    g = torch.Generator().manual_seed(seed)
    ngram = decode_ngram_sd(target, prompt, cfg, frozenset(), V, g)
    ar_cfg = GenerationConfig(method="ar", temperature=0.0, max_new_tokens=24)
    ar = decode_ar(target, prompt, ar_cfg, frozenset(), V, g)
    assert ngram.tokens == ar.tokens
    assert ngram.stats.drafted > 0


def test_the_gate_drafts_while_the_target_backs_the_proposals():
    gate = NgramGate(0.5, steps=2)
    assert gate.open  # nothing seen yet: draft
    gate.observe(0.9)
    gate.observe(0.2)
    assert gate.open  # mean 0.55
    gate.observe(0.3)
    assert not gate.open  # the last two: mean 0.25
    gate.observe(0.9)
    assert gate.open  # back to 0.6: drafting resumes
    assert NgramGate(0.0).open and NgramGate(0.0, steps=1).open


def test_the_confidence_gate_drafts_the_prefix_the_target_backs():
    """``length(k)``: the longest prefix whose product of per-position recent means is at
    least p_min; a position never seen counts as 1 (drafted, so that it gets measured)."""
    gate = NgramGate(0.6, steps=2)
    assert gate.length(4) == 4  # nothing seen: draft all
    gate.observe([0.9, 0.8, 0.5])  # products 0.9, 0.72, 0.36
    assert gate.length(4) == 2 and gate.length(1) == 1 and gate.length(0) == 0
    gate.observe(0.1)  # a probed round: the first position only, mean (0.9 + 0.1) / 2
    assert gate.length(4) == 0 and not gate.open
    gate.observe([0.95, 0.9])  # first position: (0.1 + 0.95) / 2 = 0.525 < 0.6
    assert gate.length(4) == 0
    gate.observe([1.0, 1.0, 1.0])  # first 0.975, second 0.95, third 0.75: 0.975, 0.93, 0.69
    assert gate.length(4) == 4  # the fourth position has never been seen
    assert NgramGate(0.0).length(3) == 3


def test_a_gate_that_never_opens_after_the_first_round_drafts_once(target):
    """p_min 1: no proposal has probability 1 here, so only the first round (nothing seen
    yet) drafts; every later proposal is probed, counted as gated, never verified."""
    cfg = _cfg(max_new_tokens=12, draft_p_min=1.0)
    out = decode_ngram_sd(target, PROMPT, cfg, frozenset(), V, torch.Generator().manual_seed(0))
    assert 0 < out.stats.drafted <= cfg.draft_tokens
    assert out.stats.gated_rounds >= 3
    open_ = decode_ngram_sd(target, PROMPT, _cfg(max_new_tokens=12), frozenset(), V,
                            torch.Generator().manual_seed(0))  # fmt: skip
    assert open_.stats.gated_rounds is None and open_.stats.drafted > out.stats.drafted


def test_smc_and_constraints_refuse_the_ngram_draft():
    with pytest.raises(ConfigError, match="point mass"):  # the decoder table refuses it
        decoder_for(GenerationConfig(method="smc", draft="ngram").validate())
    from smcspec.potentials import Regex

    with pytest.raises(ConfigError, match="constraints"):
        GenerationConfig(method="sd", draft="ngram", constraint=Regex("a+")).validate()
    with pytest.raises(ConfigError, match="unknown draft "):
        GenerationConfig(method="sd", draft="eagle").validate()
    with pytest.raises(ConfigError, match="unknown draft_schedule 'always'"):
        GenerationConfig(method="sd", draft="ngram", draft_schedule="always").validate()
