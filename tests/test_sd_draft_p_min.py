"""sd with ``draft_p_min``: drafting stops when the draft is unsure, and the output stays exact.

A round drafts until the draft's most likely token has less than ``draft_p_min`` probability
(llama.cpp's ``--draft-p-min``). Whether to go on depends only on the draft's own
distribution, so the accept/reject rule stays exact: chi-square against the enumerated
target. The forward that showed the draft unsure is rolled back, so the draft's KV stays one
step behind: every draft distribution a round verifies is compared with a fresh forward of
the draft over the whole prefix (a KV left one token ahead would shift them, yet leave the
output exact, so only this check can see it).
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from enumerable import chisquare_p, sequence_log_probs, tiny_transformer, total_variation

import smcspec.decoding.sd.chain as sd_module
from smcspec.config import GenerationConfig
from smcspec.decoding import decode_sd
from smcspec.errors import ConfigError

# the slow tier (pyproject.toml); CI runs it; one torch thread (tiny forwards)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = [1, 2, 0]
V, LENGTH, RUNS = 4, 3, 3000


@pytest.fixture(scope="module")
def pair():
    target = tiny_transformer(seed=1, vocab=V, scale=1.0)
    draft = tiny_transformer(seed=2, vocab=V, scale=0.5)
    return target, draft


def _cfg(p_min: float, **kw) -> GenerationConfig:
    base = dict(method="sd", max_new_tokens=LENGTH, draft_tokens=2, temperature=1.0,
                draft_temperature=1.0, draft_p_min=p_min)  # fmt: skip
    return GenerationConfig(**{**base, **kw}).validate()


def test_draft_p_min_keeps_sd_exact_and_drafts_less(pair):
    target, draft = pair
    exact = sequence_log_probs(target, PROMPT, LENGTH, 1.0)
    counts: Counter = Counter()
    drafted = {0.0: 0, 0.58: 0}
    for p_min in drafted:
        for i in range(RUNS if p_min else 300):
            out = decode_sd(target, draft, PROMPT, _cfg(p_min), frozenset(), V,
                            torch.Generator().manual_seed(i))  # fmt: skip
            drafted[p_min] += out.stats.drafted
            if p_min:
                counts[tuple(out.tokens)] += 1
    # the floor stops most rounds here, not all (measured: 9% of the drafts are made)
    assert 0.02 < (drafted[0.58] / RUNS) / (drafted[0.0] / 300) < 0.5
    assert chisquare_p(exact, counts, RUNS) > 1e-3  # 64 sequences; p-value bound 1e-3
    assert total_variation(exact, counts, RUNS) < 0.08


@pytest.mark.parametrize("p_min", [0.0, 0.5, 0.56, 0.58])
def test_every_verified_draft_distribution_matches_a_fresh_forward(pair, monkeypatch, p_min):
    target, draft = pair
    checked = 0
    real = sd_module.speculative_verify

    def checking(draft_tokens, draft_probs, target_probs, generator):
        nonlocal checked
        rounds = sys._getframe(3)  # verify_block <- _round_steps <- _sd_rounds
        assert rounds.f_code.co_name == "_sd_rounds"
        prefix = PROMPT + rounds.f_locals["out"]
        for j, t in enumerate(draft_tokens.tolist()):
            cache = draft.new_cache(1, len(prefix) + j + 1)
            logits = draft.prefill(torch.tensor(prefix + draft_tokens[:j].tolist()), cache)
            want = torch.softmax(logits.double(), -1)
            assert torch.allclose(draft_probs[j].double(), want, atol=1e-5), (prefix, j, t)
            checked += 1
        return real(draft_tokens, draft_probs, target_probs, generator)

    monkeypatch.setattr(sd_module, "speculative_verify", checking)
    cfg = _cfg(p_min, max_new_tokens=12, draft_tokens=3)
    for seed in range(20):
        decode_sd(target, draft, PROMPT, cfg, frozenset(), V, torch.Generator().manual_seed(seed))
    assert checked >= 10


def test_draft_p_min_is_a_probability():
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="draft_p_min"):
            GenerationConfig(draft_p_min=bad).validate()


def test_draft_p_min_defaults_per_draft():
    """Unset (None), the gate is the draft's own default: off with the draft model, the
    measured NGRAM_DRAFT_P_MIN with n-gram drafts; a given value, 0 included, wins."""
    from smcspec.config import NGRAM_DRAFT_P_MIN

    assert GenerationConfig(method="sd").validate().p_min == 0.0
    ngram = GenerationConfig(method="sd", draft="ngram").validate()
    assert ngram.draft_p_min is None and ngram.p_min == NGRAM_DRAFT_P_MIN == 0.8
    assert GenerationConfig(method="sd", draft="ngram", draft_p_min=0).validate().p_min == 0.0
    assert GenerationConfig(method="sd", draft_p_min=0.3).validate().p_min == 0.3
    with pytest.raises(ConfigError, match="draft_p_min must be a number"):
        GenerationConfig(draft_p_min="high").validate()
