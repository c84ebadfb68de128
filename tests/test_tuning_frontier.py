"""The tuner's frontier settings: multi-draft sd (``sd-nN-kK``, exact) and SMC-SD rounds cut
where the ESS falls (``smc-nN-kK-ess``), predicted from the pair's measured statistics
(:mod:`smcspec.tuning.multi_draft`, :func:`smcspec.tuning.predict.predicted_cut_round`),
weighed by ``auto`` and shown by ``bench --predict``."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from test_tuning import hand_costs
from tiny_models import CHAT_TEMPLATE, make_tiny_chat_pair, make_tiny_gguf

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.cli import main
from smcspec.tuning import Setting, TuningGrid, choose, predict, predict_all, sd_tokens_per_round
from smcspec.tuning.measure import (
    ACCEPTANCE_PROMPTS,
    PairProfile,
    pair_log_probs,
    quantiles_of_log_weights,
    top_probabilities,
)
from smcspec.tuning.multi_draft import multi_sd_tokens_per_round, tree_acceptance
from smcspec.tuning.predict import alpha_from_counts, predicted_cut_round, predicted_ess


def _tables(seed: int = 0, positions: int = 40, vocab: int = 24, sharp: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(positions, vocab, generator=g) * sharp, -1)
    noise = torch.randn(positions, vocab, generator=g)
    lq = torch.log_softmax(lp + noise, -1)  # an overlapping draft
    return lp, lq


# ------------------------------------------------------------------ multi-draft sd
@pytest.mark.parametrize("alpha, k", [(0.0, 4), (0.35, 2), (0.8, 4), (0.95, 8), (1.0, 3)])
def test_one_chain_is_chain_sd_exactly(alpha, k):
    """N = 1 never branches and accepts with the chain alpha: Leviathan's eq. 1. Fails on
    anchoring a(m) on the tree's own single-chain acceptance (``1 - rejection[0]``) instead
    of the run-measured alpha."""
    rejection, continuing = tree_acceptance(*_tables())
    got = multi_sd_tokens_per_round(alpha, 1, k, rejection, continuing)
    assert got == pytest.approx(sd_tokens_per_round(alpha, k), rel=1e-12, abs=1e-12)


def test_more_chains_accept_more_and_never_more_than_k_plus_one():
    """With an overlapping draft the accepted length grows with N (recursive rejection only
    adds chances); at most K+1. Fails on a Markov chain that ignores the continuing chains
    (one candidate after depth 1: the N = 8 gain at K = 4 shrinks to that of depth 1)."""
    rejection, continuing = tree_acceptance(*_tables())
    assert all(b <= a for a, b in zip(rejection, rejection[1:], strict=False))
    tokens = [multi_sd_tokens_per_round(0.6, n, 4, rejection, continuing) for n in (1, 2, 4, 8)]
    assert tokens == sorted(tokens) and tokens[-1] <= 5
    a8 = 1 - (1 - 0.6) * rejection[7] / rejection[0]  # accepting at depth 1 with 8 chains
    one_depth = 1 + a8 * sd_tokens_per_round(0.6, 3)  # then one chain: alpha a depth
    assert tokens[-1] > one_depth + 0.1


def test_the_profile_pooled_prompt_by_prompt_equals_the_whole_where_it_is_exact():
    """The calibration is measured one prompt's ``[L, V]`` pair at a time
    (:class:`PairProfile`, so 20 long prompts do not hold gigabytes of float64 log-probs).
    The exact parts (eq. (1)'s rejection, the agreement profiles) pooled from two parts
    equal those of the concatenated positions; one part reproduces the one-shot functions
    draw for draw; the sampled parts of two parts stay close to the whole's. Fails on a
    pooling that weights the parts instead of their positions (parts of 10 and 30)."""
    lp, lq = _tables(positions=40)
    whole_rejection, whole_continuing = tree_acceptance(lp, lq)
    one = PairProfile()
    one.add(lp, lq)
    q1, dtop, ttop, (rej1, cont1) = one.result()
    assert q1 == quantiles_of_log_weights(lp, lq) and (rej1, cont1) == (
        whole_rejection,
        whole_continuing,
    )
    assert dtop == top_probabilities(lq) and ttop == top_probabilities(lp)
    two = PairProfile()
    two.add(lp[:10], lq[:10])
    two.add(lp[10:], lq[10:])
    q2, dtop2, ttop2, (rej2, cont2) = two.result()
    assert rej2 == pytest.approx(whole_rejection, abs=2e-6)  # rounding to 6 digits only
    assert dtop2 == dtop and ttop2 == ttop
    assert q2[50] == pytest.approx(q1[50], abs=0.1)  # the median log-weight, 2,560 draws
    assert cont2[7] == pytest.approx(whole_continuing[7], abs=0.05)


def test_the_pooled_log_weights_are_the_wholes_draw_for_draw():
    """The log-weights pooled part by part (:class:`PairProfile`, three parts of 10, 15 and
    15 positions) are the whole's, draw for draw: the profile's one generator is carried
    across the parts and torch draws the positions' samples row after row, so the stored
    arrays joined equal those of the 40 positions added at once and every one of the 101
    quantiles is equal exactly. Broken variant caught: the pooling keeping the last part's
    weights only (960 of the 2,560 draws; in the test above its median is 0.004 off, inside
    0.1; here the median happens to be equal, other quantiles up to 1.14 off)."""
    lp, lq = _tables(positions=40)
    whole = PairProfile()
    whole.add(lp, lq)
    parts = PairProfile()
    for a, b in ((0, 10), (10, 25), (25, 40)):
        parts.add(lp[a:b], lq[a:b])
    pooled, joined = torch.cat(parts.weights), torch.cat(whole.weights)
    assert pooled.shape == joined.shape and torch.equal(pooled, joined), pooled.shape
    assert parts.result()[0] == whole.result()[0] == quantiles_of_log_weights(lp, lq)


@pytest.fixture(scope="module")
def torch_pair(tmp_path_factory):
    """The tiny chat target (seed 0) drafting for itself at draft temperature 3: an
    overlapping pair (alpha about 0.65), as a real draft is."""
    dirs = make_tiny_chat_pair(tmp_path_factory.mktemp("frontier"))
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[0]))


MEASURED_TOLERANCE = 0.10
"""Relative tolerance of predicted against measured tokens a round at N = 4, K = 4: about
260 rounds (standard error near 3%) and the prediction's independence assumption (measured
when written: N = 2 +2.0%, N = 4 +1.8%, N = 8 +12%: at N = 8 more chains continue together
than independent positions give)."""


def _runs(engine, base, chains, seeds=(1, 2, 3, 4)):
    """Counts of sd runs (``chains`` N, K = 4) over the calibration prompts, and the
    teacher-forced log-probabilities of their outputs."""
    counts, logs = {"accepted": 0, "drafted": 0, "rounds": 0}, []
    for prompt in ACCEPTANCE_PROMPTS:
        ids = engine.encode(prompt, chat=True)
        for seed in seeds:
            cfg = replace(base, method="sd", particles=chains, draft_tokens=4, seed=seed)
            result = engine.generate(ids, cfg)
            for name in counts:
                counts[name] += result.stats[name]
            logs.append(pair_log_probs(engine.target.model, engine.draft.model, ids,
                                       result.token_ids, 1.0, 3.0, engine.vocab))  # fmt: skip
    return counts, logs


def test_multi_draft_tokens_a_round_match_a_measured_run(torch_pair):
    """Predicted tokens a round from alpha and the tree acceptance, both measured on chain sd
    runs (as the tuner measures them), against real multi-draft sd runs of the same prompts
    and seeds (N = 4, K = 4), within :data:`MEASURED_TOLERANCE`. Fails on treating every
    chain as continuing at every depth (N fresh candidates a depth)."""
    base = GenerationConfig(temperature=1.0, draft_temperature=3.0, ignore_eos=True,
                            max_new_tokens=60)  # fmt: skip
    chain, logs = _runs(torch_pair, base, 1)
    alpha = alpha_from_counts(chain["accepted"], chain["drafted"], chain["rounds"])
    lp, lq = torch.cat([p for p, _ in logs]), torch.cat([q for _, q in logs])
    rejection, continuing = tree_acceptance(lp, lq)
    multi, _ = _runs(torch_pair, base, 4)
    measured = 1 + multi["accepted"] / multi["rounds"]
    predicted = multi_sd_tokens_per_round(alpha, 4, 4, rejection, continuing)
    assert predicted > sd_tokens_per_round(alpha, 4)
    assert predicted == pytest.approx(measured, rel=MEASURED_TOLERANCE)


def _tree_costs(per_row: float, gain: bool = True, quantiles=None):
    """Hand costs with a tree acceptance: ``gain``: more chains reject far less and keep
    half their chains; else no gain (rejection flat, one chain continues)."""
    m = 8
    if gain:
        rejection = [0.2 * 0.5**i for i in range(m)]
        continuing = [[1.0]] + [[0.5] + [0.0] * (i - 1) + [0.5] for i in range(1, m)]
    else:
        rejection = [0.2] * m
        continuing = [[1.0] + [0.0] * i for i in range(m)]
    costs = hand_costs(0.02, c=0.1, per_row=per_row, alpha=0.8)
    return replace(costs, tree_rejection=rejection, tree_continuing=continuing,
                   log_weight_quantiles=quantiles)  # fmt: skip


SETTINGS = TuningGrid(max_forward_tokens=10_000).settings(min_particles=1)
COLLAPSING = [-6.0 + 0.09 * i for i in range(101)]
"""Log-weight quantiles spread over 9 nats: an SMC-SD round's weights collapse."""


def test_auto_takes_multi_draft_sd_where_it_is_predicted_fastest():
    """Rows free (a memory-bound GPU), a tree that gains and SMC-SD held under the floor:
    auto is multi-draft sd, even under a floor of 16 particles (it is exact: no floor).
    Without a gain, chain sd (the same tokens, fewer rows). Fails on applying the particle
    floor to multi-draft sd (``Setting.weighted`` true for chains)."""
    preds = predict_all(SETTINGS, _tree_costs(0.0, quantiles=COLLAPSING))
    assert any(p.setting.chains for p in preds)
    pick = choose(preds, "auto", min_particles=16, min_ess=4.0)
    assert pick.setting.chains and pick.setting.name.startswith("sd-n")
    fastest_sd = max(
        (p for p in preds if not p.setting.weighted), key=lambda p: p.tokens_per_second
    )
    assert pick == fastest_sd
    assert pick.setting.apply(GenerationConfig()).particles == pick.setting.particles
    flat = predict_all(SETTINGS, _tree_costs(1.0, gain=False, quantiles=COLLAPSING))
    assert not choose(flat, "auto", min_particles=16, min_ess=4.0).setting.chains


def test_a_pair_without_the_tree_acceptance_predicts_no_multi_draft_setting():
    preds = predict_all(SETTINGS, hand_costs(0.02, c=0.1, per_row=0.0))
    assert preds and not any(p.setting.chains or p.setting.cut for p in preds)


# ------------------------------------------------------------------ cut rounds
def test_uncut_rounds_are_block_rounds():
    """kappa 0 never cuts: K+1 tokens and block SMC-SD's predicted ESS."""
    tokens, ess = predicted_cut_round(8, 6, COLLAPSING, 0.0)
    assert tokens == 7 and ess == pytest.approx(predicted_ess(8, 6, COLLAPSING))
    tokens, ess = predicted_cut_round(8, 6, COLLAPSING, 0.5)
    assert 2 <= tokens < 7 and ess > predicted_ess(8, 6, COLLAPSING)


def test_cut_rounds_are_under_the_same_floor():
    """With collapsing weights no block or cut setting of N <= 4 keeps 4 effective particles;
    the choice never takes a setting below the floor, and the cut settings it may take meet
    it. Fails on leaving cut rounds without a predicted ESS (they escape the floor)."""
    quantiles = [-3.0 + 0.045 * i for i in range(101)]
    preds = predict_all(SETTINGS, replace(hand_costs(0.02, c=0.1, per_row=0.0),
                                          log_weight_quantiles=quantiles))  # fmt: skip
    cut = [p for p in preds if p.setting.cut]
    assert cut and all(p.ess is not None for p in cut)
    assert {p.setting.name for p in cut} >= {"smc-n8-k8-ess", "smc-n16-k4-ess"}
    for method in ("auto", "smc"):
        pick = choose(preds, method, min_particles=1, min_ess=4.0)
        assert pick.ess is None or pick.ess >= 4.0, pick.setting.name
    small = [p for p in cut if p.setting.particles <= 4]
    assert small and all(p.ess < 4.0 for p in small)
    smc = predict(Setting("smc", 8, 8, round_end="ess"), replace(
        hand_costs(0.02, c=0.1, per_row=0.0), log_weight_quantiles=quantiles))  # fmt: skip
    assert smc.setting.apply(GenerationConfig()).round_end == "ess"
    assert smc.setting.name == "smc-n8-k8-ess" and smc.tokens_per_round < 9


# ------------------------------------------------------------------ bench --predict
@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("frontier-gguf")
    return [
        make_tiny_gguf(root, "qwen2", 96, seed=s, chat_template=CHAT_TEMPLATE)[0] for s in (0, 1)
    ]


def test_bench_predict_lists_multi_draft_and_cut_settings(gguf_pair, tmp_path, monkeypatch,
                                                          capsys):  # fmt: skip
    """Each multi-draft N (2, 4, 8) and cut rounds appear as rows with their N and K. Fails
    on a table that prints N only for settings that weigh particles."""
    monkeypatch.setenv("SMCSPEC_CACHE", str(tmp_path / "cache"))
    target, draft = (str(p) for p in gguf_pair)
    assert main(["bench", "--predict", "--target", target, "--draft", draft,
                 "--threads", "1"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    for n in (2, 4, 8):
        assert re.search(rf"^\| sd \| {n} \| \d+ \| [\d.]+ \|", text, re.M), n
    assert re.search(r"^\| smc \(ess\) \| 8 \| 4 \| [\d.]+ \|.* of 8 \|", text, re.M)
    assert "multi-draft sd (exact, so no fidelity floor)" in text
    assert "smc (ess): rounds cut at the first drafted position" in text
