"""SMC-SD with particle groups (``GenerationConfig.groups``): G groups of N/G particles
weighted, resampled and banked apart, counted equally at the end.

What is checked: the configuration's bounds; the equal-weight combination
(:func:`~smcspec.sampling.resampling.group_normalized_weights`); that no resampling or banking
ever copies a particle across groups; that the returned weights give each group 1/G; and, on
the tiny enumerable models, that N particles in G groups sample exactly as N/G particles in
one group (the groups are independent runs), whether the particles end at different rounds
(banking) or carry a reward. Fixed seeds: the numbers are deterministic; the measured values
are stated beside each bound.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from enumerable import sequence_log_probs, tiny_transformer

import smcspec.decoding.smc.round_end as round_end
from smcspec.config import GenerationConfig
from smcspec.decoding import decode_smc
from smcspec.errors import ConfigError
from smcspec.eval.exact import tilted_log_probs
from smcspec.eval.fidelity import letter_count_reward, sample_outputs
from smcspec.sampling.resampling import group_normalized_weights, normalized_weights

PROMPT = [1, 2, 0]


def _cfg(n: int, groups: int, **kw) -> GenerationConfig:
    base = {"method": "smc", "temperature": 1.0, "draft_temperature": 1.0, "draft_tokens": 2}
    return GenerationConfig(particles=n, groups=groups, **{**base, **kw}).validate()


@pytest.mark.parametrize("n, groups", [(8, 3), (8, 0), (8, 16), (4, -1)])
def test_groups_must_divide_the_particles(n, groups):
    with pytest.raises(ConfigError, match="groups"):
        _cfg(n, groups)


def test_group_weights_count_each_live_group_equally():
    lw = torch.tensor([0.0, math.log(3.0), 5.0, 5.0, -math.inf, -math.inf], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    w, degenerate = group_normalized_weights(lw, ids, 3)
    # group 2 holds no weight: the two live groups share everything, 1/2 each
    assert not degenerate
    assert w.tolist() == pytest.approx([0.125, 0.375, 0.25, 0.25, 0.0, 0.0])


def test_one_group_is_the_plain_normalisation_and_all_dead_is_uniform():
    lw = torch.tensor([0.3, -1.2, 2.0, float("nan")], dtype=torch.float64)
    w, degenerate = group_normalized_weights(lw, torch.zeros(4, dtype=torch.long), 1)
    want, want_degenerate = normalized_weights(lw)
    assert torch.equal(w, want) and degenerate == want_degenerate
    dead = torch.full((4,), -math.inf, dtype=torch.float64)
    w, degenerate = group_normalized_weights(dead, torch.tensor([0, 0, 1, 1]), 2)
    assert degenerate and w.tolist() == [0.25] * 4


@pytest.fixture(scope="module")
def stop_pair():
    """3-token pair with stop token 0 (particles end at different rounds)."""
    target = tiny_transformer(seed=1, vocab=3, scale=0.6)
    draft = tiny_transformer(seed=2, vocab=3, scale=0.6)
    return target, draft


@pytest.mark.parametrize("rule", ["bank", "keep"])
def test_no_particle_is_ever_copied_across_groups(stop_pair, monkeypatch, rule):
    """Resampling at every round (kappa 1) and banking: every ancestor vector keeps each
    particle in its own group, and groups resample on their own."""
    target, draft = stop_pair
    real, seen = round_end._take_ancestors, []

    def spy(ps, anc, reset, *rest):
        seen.append((anc.clone(), reset.clone()))
        real(ps, anc, reset, *rest)

    monkeypatch.setattr(round_end, "_take_ancestors", spy)
    cfg = _cfg(8, 4, max_new_tokens=9, ess_threshold=1.0, finished_particles=rule)
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        decode_smc(target, draft, PROMPT, cfg, frozenset({0}), 3, gen)
    group = torch.arange(8) // 2
    assert len(seen) > 20
    partial = 0
    for anc, reset in seen:
        assert torch.equal(anc // 2, group)
        kept = ~reset
        assert torch.equal(anc[kept], torch.arange(8)[kept])  # not resampled: unchanged
        partial += int(reset.any() and not reset.all())
    assert partial > 0  # some rounds resampled some groups and not others


def test_returned_weights_give_each_group_one_share(stop_pair):
    target, draft = stop_pair
    cfg = _cfg(8, 4, max_new_tokens=9, return_particles=True, finished_particles="keep")
    for seed in range(10):
        out = decode_smc(
            target, draft, PROMPT, cfg, frozenset({0}), 3, torch.Generator().manual_seed(seed)
        )
        w = [p.weight for p in out.particles]
        assert [sum(w[2 * g : 2 * g + 2]) for g in range(4)] == pytest.approx([0.25] * 4)


def test_one_group_is_the_default(stop_pair):
    target, draft = stop_pair
    plain = GenerationConfig(method="smc", particles=8, draft_tokens=2, max_new_tokens=9)
    assert plain.groups == 1
    for seed in range(5):
        outs = [
            decode_smc(
                target, draft, PROMPT, cfg, frozenset({0}), 3, torch.Generator().manual_seed(seed)
            )
            for cfg in (plain, replace(plain, groups=1))
        ]
        assert outs[0].tokens == outs[1].tokens and outs[0].stats == outs[1].stats


RUNS = 1000


@pytest.mark.slow
@pytest.mark.usefixtures("inference_mode")  # conftest: the same draws, less CPU
def test_reward_tilted_groups_sample_as_one_group_of_their_size():
    """R = number of token 1, beta 1.5 (exact tilted mean 1.964). Measured mean R: 32
    particles in 8 groups 0.967, 4 particles 0.957, 32 in one group 1.531 (noise of a mean
    about 0.025)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = tiny_transformer(seed=1)
        draft = tiny_transformer(seed=2, scale=0.1, base=target)
        reward = letter_count_reward(1, 1.5, 4, twisted=True)
        want, _ = tilted_log_probs(sequence_log_probs(target, PROMPT, 3, 1.0), reward)
        exact_mean = sum(math.exp(v) * k.count(1) for k, v in want.items())

        def mean_r(n: int, groups: int) -> float:
            cfg = _cfg(n, groups, max_new_tokens=3, draft_tokens=1, reward=reward)
            counts, _ = sample_outputs(target, draft, PROMPT, cfg, RUNS, seed0=5000)
            return sum(k.count(1) * v for k, v in counts.items()) / RUNS

        grouped, small, whole = mean_r(32, 8), mean_r(4, 1), mean_r(32, 1)
    finally:
        torch.set_num_threads(threads)
    assert exact_mean == pytest.approx(1.964, abs=1e-3)
    assert abs(grouped - small) < 0.1
    assert whole > grouped + 0.4
