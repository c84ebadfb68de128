"""SMC-SD rounds cut where the ESS falls (``round_end="ess"``) and the epsilon stop.

Checked cheaply here: where a round is cut (:func:`smcspec.decoding.smc.cut.cut_position`
on hand-made weights); after every cut round each particle's target and draft KV rows and
its matcher hold exactly its tokens (fresh computations), which a round that forgets to roll
the caches back fails; the fused round draws what the step path draws (bank and keep rules,
groups, alpha, truncation); the epsilon stop ends a request only when the running mass is
below epsilon (over groups, their masses' arithmetic mean), and then the bank holds at least
``1 - epsilon``. The output distributions
(TV falling with N, the epsilon bound) are in ``test_smc_cut_statistical.py`` (slow tier).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from enumerable import tiny_transformer

import smcspec.decoding.smc.cut as cut
import smcspec.decoding.smc.program as program
import smcspec.decoding.smc.round_end as round_end
from smcspec.config import GenerationConfig
from smcspec.decoding import decode_smc
from smcspec.decoding.smc.cut import cut_position
from smcspec.decoding.smc.particles import Bank, Block, Particles
from smcspec.errors import ConfigError, ContextLengthError
from smcspec.eval.automaton import NextTokenAutomaton

PROMPT = [1, 2, 0]
REAL_BONUS, REAL_ROUNDS = cut.deferred_bonus, program._smc_rounds


class _Job:
    """What :func:`cut_position` reads of a job."""

    def __init__(self, cfg: GenerationConfig) -> None:
        self.config, self.device = cfg, torch.device("cpu")
        self.stop_tensor = torch.tensor([9])


def _particles(logw: list[float], finished: list[bool] | None = None) -> Particles:
    n = len(logw)
    z = torch.zeros(n, dtype=torch.float64)
    one = torch.zeros(n, 1, dtype=torch.long)
    return Particles(
        tokens=torch.zeros(n, 8, dtype=torch.long), lengths=torch.ones(n, dtype=torch.long),
        finished=torch.tensor(finished or [False] * n),
        logw=torch.tensor(logw, dtype=torch.float64), pending_t=one, pending_d=one, phi=z,
        log_z=torch.zeros(1), bank=Bank(torch.zeros(1)),
    )  # fmt: skip


def test_the_round_is_cut_at_the_first_position_whose_ess_falls():
    cfg = GenerationConfig(particles=4, draft_tokens=4, ess_threshold=0.5, max_new_tokens=50)
    job = _Job(cfg)
    drafted = torch.zeros(4, 4, dtype=torch.long)
    # increments: equal at positions 1-2, then particle 0 gains 5 nats at position 3
    target_lp = torch.zeros(4, 4)
    target_lp[0, 2] = 5.0
    b = Block(drafted, torch.zeros(4, 4), None, None, target_lp)
    assert cut_position(job, _particles([0.0] * 4), b) == 3
    # no fall: the whole block
    b.target_lp = torch.zeros(4, 4)
    assert cut_position(job, _particles([0.0] * 4), b) == 4
    # a stop token at position 2 ends particle 0's weight there: the gain after it is not counted
    drafted[0, 1] = 9
    b.target_lp = target_lp
    assert cut_position(job, _particles([0.0] * 4), b) == 4
    # a finished particle gains nothing; weights already unequal count from the start
    drafted[0, 1] = 0
    assert cut_position(job, _particles([0.0] * 4, [True, False, False, False]), b) == 4
    assert cut_position(job, _particles([9.0, 0.0, 0.0, 0.0]), Block(
        drafted, torch.zeros(4, 4), None, None, torch.zeros(4, 4))) == 1  # fmt: skip
    # kappa 0 never resamples: never cut
    assert cut_position(_Job(replace(cfg, ess_threshold=0.0)), _particles([0.0] * 4), b) == 4


@pytest.fixture(scope="module")
def pair():
    return tiny_transformer(seed=1, vocab=8), tiny_transformer(seed=2, vocab=8)


def _run(pair, mode, cfg, stop=frozenset({7}), seed=5):
    for m in pair:
        m.rounds = mode
    try:
        return decode_smc(*pair, PROMPT, cfg, stop, 8, torch.Generator().manual_seed(seed))
    finally:
        for m in pair:
            m.rounds = "auto"


ESS = GenerationConfig(
    method="smc", particles=8, draft_tokens=6, max_new_tokens=40, temperature=1.0,
    draft_temperature=0.8, round_end="ess", return_particles=True,
)  # fmt: skip


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"alpha": 2.0},
        {"groups": 2},
        {"finished_particles": "keep"},
        {"top_k": 4, "min_p": 0.05},
    ],
    ids=["bank", "alpha", "groups", "keep", "truncated"],
)
def test_fused_cut_rounds_draw_what_the_steps_draw(pair, extra):
    cfg = replace(ESS, **extra)
    steps, fused = _run(pair, "steps", cfg), _run(pair, "eager", cfg)
    assert fused.tokens == steps.tokens
    sa, sb = steps.stats.to_dict(), fused.stats.to_dict()
    for key, value in sa.items():
        if not key.startswith("distinct_rows"):
            assert sb[key] == (
                pytest.approx(value, rel=1e-5) if isinstance(value, float) else value
            )
    assert 0 < sa["cut_rounds"] <= sa["rounds"]
    wa = torch.tensor([p.weight for p in steps.particles])
    torch.testing.assert_close(torch.tensor([p.weight for p in fused.particles]), wa)


def _rows_hold(model, cache, tokens: torch.Tensor, prompt: list[int]) -> bool:
    """Whether every row's KV equals a fresh computation of the tokens it was fed."""
    n = cache.length
    for i in range(cache.rows):
        fresh = model.new_cache(1, n + 1)
        model.prefill(torch.tensor(prompt), fresh)
        if n:
            model.decode(tokens[i : i + 1, :n], fresh)
        got, want = cache.suffix_k[:, i, :, :n], fresh.suffix_k[:, 0, :, :n]
        if not torch.allclose(got, want, atol=1e-4):
            return False
    return True


def _cut_checks(pair, monkeypatch, constraint=None, checks=None) -> list[bool]:
    """After every cut round of 4 seeded runs (N=8, K=4, 16 tokens, no stop tokens, kappa
    1), do both caches' rows hold their particles' tokens (the target: all but the pending
    bonus; the draft: one fewer when the round ran to K) and each matcher its tokens?"""
    target, draft = pair
    checks = [] if checks is None else checks

    def spy(job, ps, b, anc, at):
        ended = REAL_BONUS(job, ps, b, anc, at)
        if not bool(ps.finished.any()):
            t_cache, d_cache = spy.caches
            checks.append(_rows_hold(target, t_cache, ps.tokens, PROMPT))
            checks.append(_rows_hold(draft, d_cache, ps.tokens, PROMPT))
            for i, state in enumerate(ps.states):
                fresh = constraint.start()
                fresh.consume(ps.tokens[i, : int(ps.lengths[i])].tolist())
                checks.append(torch.equal(state.allowed(), fresh.allowed()))
        return ended

    def rounds(job, tcache, dcache):
        spy.caches = (tcache, dcache)
        return REAL_ROUNDS(job, tcache, dcache)

    monkeypatch.setattr(cut, "deferred_bonus", spy)
    monkeypatch.setattr(program, "_smc_rounds", rounds)
    cfg = replace(ESS, max_new_tokens=16, draft_tokens=4, ess_threshold=1.0, constraint=constraint,
                  return_particles=False)  # fmt: skip
    with torch.inference_mode():
        for seed in range(4):
            _run(pair, "steps", cfg, stop=frozenset(), seed=seed)
    return checks


def test_after_every_cut_round_each_row_and_matcher_holds_its_tokens(pair, monkeypatch):
    dfa = NextTokenAutomaton({None: set(range(8)), **{t: set(range(8)) - {t} for t in range(8)}}, 8)
    checks = _cut_checks(pair, monkeypatch)
    assert len(checks) >= 20 and all(checks)
    checks = _cut_checks(pair, monkeypatch, constraint=dfa)
    assert len(checks) >= 20 and all(checks)


def test_caches_left_uncut_are_caught(pair, monkeypatch):
    """Broken variant: the caches keep the drafted tokens after the cut (the rows then hold
    tokens their particles do not; later the caches also overflow)."""
    monkeypatch.setattr(cut, "truncate", lambda *args: None)
    checks: list[bool] = []
    with pytest.raises(ContextLengthError):
        _cut_checks(pair, monkeypatch, checks=checks)
    assert checks and not all(checks)


def test_the_epsilon_stop_ends_only_below_epsilon(pair, monkeypatch):
    cfg = replace(ESS, max_new_tokens=30, round_end="block", return_particles=False)
    stopped = 0
    for seed in range(12):
        plain = _run(pair, "steps", cfg, seed=seed)
        out = _run(pair, "steps", replace(cfg, stop_epsilon=0.2), seed=seed)
        if out.stats.stopped_early:
            stopped += 1
            assert out.stats.banked_mass >= 1 - 0.2  # the bank holds all but < epsilon
            assert out.stats.rounds < plain.stats.rounds
        else:
            assert out.tokens == plain.tokens
    assert stopped >= 3  # the stop ran (measured 0 of 12 without it)


def test_an_epsilon_stop_that_ignores_the_mass_is_caught(pair, monkeypatch):
    """Broken variant: stop as soon as anything is banked."""
    real = round_end.mass_stop

    def eager(job, ps):
        if ps.bank.entries and job.config.stop_epsilon > 0:
            ps.finished[:] = True
            ps.tally.stopped_early = True
            return True
        return real(job, ps)

    monkeypatch.setattr(round_end, "mass_stop", eager)
    cfg = replace(ESS, max_new_tokens=30, round_end="block", return_particles=False,
                  stop_epsilon=0.2)  # fmt: skip
    masses = [_run(pair, "steps", cfg, seed=s).stats.banked_mass for s in range(12)]
    assert min(m for m in masses if m is not None) < 1 - 0.2


def test_the_epsilon_stop_reads_the_mean_of_the_groups_running_masses():
    """Three groups (two particles each), each with a banked particle, running masses 0.4,
    0.05 and 0.0008: the groups count equally, so the stop compares their arithmetic mean,
    0.1503, with epsilon, and ends the request exactly when epsilon exceeds it (checked a
    relative 1e-9 either side, and at 0.1). Broken variant caught: the masses averaged
    geometrically (the exp of the mean log mass, 0.0252), which stops at epsilon 0.1 with
    0.15 of the mass still running; every other test runs one group, where the two agree."""
    masses = torch.tensor([0.4, 0.05, 0.0008], dtype=torch.float64)
    mean = float(masses.mean())
    for eps, stops in ((mean * (1 + 1e-9), True), (mean * (1 - 1e-9), False), (0.1, False)):
        cfg = GenerationConfig(method="smc", particles=6, groups=3, stop_epsilon=eps)
        bank = Bank(masses.log(), [([1, 7], -2.0, g) for g in range(3)])
        ps = replace(_particles([0.0] * 6), log_z=torch.zeros(3), bank=bank)
        assert round_end.mass_stop(_Job(cfg), ps) is stops, f"epsilon {eps:.9f}, mean {mean:.9f}"
        assert ps.tally.stopped_early is stops and bool(ps.finished.all()) is stops


def test_bad_settings_are_clear_errors():
    for eps in (-0.1, 1.0, float("nan")):
        with pytest.raises(ConfigError, match="stop_epsilon must be in"):
            GenerationConfig(stop_epsilon=eps).validate()
    with pytest.raises(ConfigError, match="unknown round_end"):
        GenerationConfig(round_end="half").validate()
