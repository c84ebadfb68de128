"""Statistical checks of constraints and rewards in the decoders, on tiny enumerable models.

The constraint is a token-level automaton (:class:`smcspec.eval.automaton.NextTokenAutomaton`;
the decoders only see the :class:`~smcspec.potentials.TokenConstraint` interface). Over the
first 3 generated tokens everything is enumerable (:mod:`smcspec.eval.exact`):

- the conditional ``p(x | x in A)`` (the target restricted to A, renormalised) and ``P(A)``;
- the locally-masked distribution ``prod_t norm(p(. | x_<t) m_t)`` that masked AR and masked
  SD sample exactly;
- the reward-tilted ``p(x) exp(beta R(x)) / Z``.

Masked AR's error to the conditional is a fixed bias; SMC-SD's falls with N and its
log-normaliser estimate approaches ``log P(A)``; a wrong weight rule fails the same test.
All runs are seeded (deterministic); thresholds are stated next to each assertion.
"""

from __future__ import annotations

import math

import pytest
import torch
from enumerable import (
    chisquare_p,
    sequence_log_probs,
    tiny_transformer,
    total_variation,
    tv_lower_bound,
    until_decided,
)

from smcspec.config import GenerationConfig
from smcspec.decoding import decode_ar, decode_sd, decode_smc, potential_hooks
from smcspec.eval.automaton import NextTokenAutomaton
from smcspec.eval.exact import (
    conditional_log_probs,
    locally_masked_log_probs,
    probabilities,
    tilted_log_probs,
)
from smcspec.eval.fidelity import CONSTRAINT_TABLE, letter_count_reward, letters, sample_outputs
from smcspec.eval.stats import total_variation as tv_exact
from smcspec.potentials import DeadEndError, Reward

# the slow tier (pyproject.toml); CI runs it; torch.inference_mode (conftest)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("inference_mode")]

PROMPT = [1, 2, 0]
T = 1.0
LENGTH = 3
VOCAB = 4
TABLE = CONSTRAINT_TABLE  # after 0 only 1; after 1 only 2 or 3; after 3 only 0


@pytest.fixture(scope="module")
def setup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target = tiny_transformer(seed=1)
    draft = tiny_transformer(seed=2, scale=0.1, base=target)  # a perturbed copy of the target
    exact = sequence_log_probs(target, PROMPT, LENGTH, T)
    yield target, draft, exact
    torch.set_num_threads(threads)


def _tv(p: dict, q: dict) -> float:
    """TV between two exact distributions given as log-probs."""
    return tv_exact(probabilities(p), probabilities(q))


def _cfg(method: str, **kw) -> GenerationConfig:
    base = {"max_new_tokens": LENGTH, "temperature": T, "draft_temperature": T}
    return GenerationConfig(method=method, **{**base, **kw}).validate()


def _smc(n: int, **kw) -> GenerationConfig:
    return _cfg("smc", particles=n, draft_tokens=1, ess_threshold=0.5, **kw)


def test_masked_ar_and_sd_have_a_fixed_bias(setup):
    target, draft, exact = setup
    dfa = NextTokenAutomaton(TABLE, VOCAB)
    cond, _ = conditional_log_probs(exact, dfa)
    local = locally_masked_log_probs(exact, dfa)
    bias = _tv(local, cond)
    # exact TV between the locally-masked distribution and the conditional: 0.443 here
    assert bias > 0.3
    cfg = _cfg("ar", constraint=dfa)
    tvs = {}
    counts, _ = sample_outputs(target, draft, PROMPT, cfg, 500)
    for runs in (500, 4000):  # one sample set: the 4,000 runs begin with the 500
        if runs > 500:
            counts += sample_outputs(target, draft, PROMPT, cfg, runs - 500, seed0=500)[0]
        assert all(dfa.allows(k) for k in counts)
        # masked AR samples the locally-masked distribution (chi-square p-value bound 1e-3)
        assert chisquare_p(local, counts, runs) > 1e-3
        tvs[runs] = total_variation(cond, counts, runs)
    # its TV to the conditional stays at the bias (sampling noise ~0.05 at 500 runs, ~0.02 at
    # 4000): it does not shrink with more samples
    assert abs(tvs[500] - bias) < 0.08 and abs(tvs[4000] - bias) < 0.04
    # masked SD (draft and target masked, usual rule) samples the same distribution exactly
    counts, _ = sample_outputs(
        target, draft, PROMPT, _cfg("sd", draft_tokens=2, constraint=dfa), 3000
    )
    assert chisquare_p(local, counts, 3000) > 1e-3
    assert abs(total_variation(cond, counts, 3000) - bias) < 0.05


def test_smc_approaches_the_conditional_and_its_normaliser(setup):
    target, draft, exact = setup
    dfa = NextTokenAutomaton(TABLE, VOCAB)
    cond, log_pa = conditional_log_probs(exact, dfa)
    bias = _tv(locally_masked_log_probs(exact, dfa), cond)
    runs = 1000
    tv, log_z = {}, {}
    for n in (1, 16):
        counts, zs = sample_outputs(target, draft, PROMPT, _smc(n, constraint=dfa), runs)
        assert all(dfa.allows(k) for k in counts)
        tv[n] = total_variation(cond, counts, runs)
        log_z[n] = zs
    # TV falls with N: N=1 is the masked draft plus the masked bonus (measured 0.52), N=16
    # measured 0.05 (sampling noise at 1000 runs about 0.05); below masked AR's bias (0.44)
    assert tv[1] > 0.4
    assert tv[16] < 0.12
    assert tv[16] < bias / 3
    # Z-hat is unbiased for P(A) at any N (mean over 1000 runs within 10%), and the mean of
    # log Z-hat approaches log P(A) from below (Jensen): at N=16 within 0.1 (measured 0.07)
    for n in (1, 16):
        mean_z = sum(math.exp(z) for z in log_z[n]) / runs
        assert abs(mean_z / math.exp(log_pa) - 1) < 0.1
    mean_log_z = {n: sum(log_z[n]) / runs for n in (1, 16)}
    assert abs(mean_log_z[16] - log_pa) < 0.1
    assert mean_log_z[1] < mean_log_z[16] - 0.3


def test_smc_without_the_mask_correction_fails(setup, monkeypatch):
    target, draft, exact = setup
    dfa = NextTokenAutomaton(TABLE, VOCAB)
    cond, _ = conditional_log_probs(exact, dfa)

    def no_renormalisation(lq, mask):  # samples q' but records log q_T(d): wrong weights
        return lq.masked_fill(~mask, -math.inf)

    monkeypatch.setattr(potential_hooks, "masked_proposal", no_renormalisation)
    cfg = _smc(16, constraint=dfa)

    def fails(counts, runs: int) -> bool:
        # the TV above 0.2 with confidence 1 - 1e-3, over the len(cond) sequences A allows
        return tv_lower_bound(cond, counts, runs, outcomes=len(cond), delta=1e-3) > 0.2

    # the threshold the correct rule meets (0.12 at 1,000 runs) fails clearly: sequential,
    # looks after 250, 500 and 1,000 runs (decided at 250: TV 0.67, its bound 0.43; 1,000
    # runs measured 0.67)
    counts, runs = until_decided(
        lambda start, m: sample_outputs(target, draft, PROMPT, cfg, m, seed0=start)[0],
        fails,
        1000,
    )
    assert all(dfa.allows(k) for k in counts)  # what the support bound above counts on
    assert fails(counts, runs)


REWARD_BETA = 1.5  # R = number of "b" (token 1): TV(plain, tilted) = 0.545, mean R 0.713 -> 1.964
REWARD_N = 256  # the tilt is strong: self-normalised weights need many particles


def _mean_r(counts, runs: int) -> float:
    return sum(k.count(1) * v for k, v in counts.items()) / runs


def _reward_run(setup, reward, runs: int = 1000, start: int = 0):
    """Counts of runs ``start .. start + runs - 1`` (seeds from 5000) at N = REWARD_N."""
    target, draft, _ = setup
    cfg = _smc(REWARD_N, reward=reward)
    counts, _ = sample_outputs(target, draft, PROMPT, cfg, runs, seed0=5000 + start)
    return counts


def _mean_r_radius(runs: int, delta: float = 1e-3) -> float:
    """Hoeffding's radius for the mean reward over ``runs`` (R in [0, LENGTH]): it is
    further than this from its expectation with probability at most ``delta``."""
    return LENGTH * math.sqrt(math.log(2 / delta) / (2 * runs))


@pytest.mark.parametrize("twisted", [True, False], ids=["prefix_fn", "at_end"])
def test_smc_samples_the_reward_tilted_target(setup, twisted):
    """The tilted target is far from the plain one (TV 0.545). Measured at N=256: TV 0.135 to
    the tilted target, mean reward 1.81 against the exact 1.964 (sampling noise of the mean
    at 1000 runs about 0.03; the rest is the self-normalised weights' finite-N bias)."""
    _, _, exact = setup
    reward = letter_count_reward(1, REWARD_BETA, VOCAB, twisted=twisted)
    want, _ = tilted_log_probs(exact, reward)
    plain_tv = _tv(exact, want)
    assert plain_tv > 0.5
    exact_mean = sum(math.exp(v) * k.count(1) for k, v in want.items())
    counts = _reward_run(setup, reward)
    assert total_variation(want, counts, 1000) < plain_tv - 0.3
    assert abs(_mean_r(counts, 1000) - exact_mean) < 0.2


@pytest.mark.parametrize(
    "variant, beta",
    [("ignored", 0.0), ("beta 1.5x", REWARD_BETA * 1.5), ("beta / 1.5", REWARD_BETA / 1.5)],
)
def test_a_wrong_reward_fails_the_same_bounds(setup, variant, beta):
    """Measured mean rewards at 1,000 runs: ignored 0.686, beta 1.5x 2.227, beta / 1.5 1.451
    (exact 1.964; the correct sampler's bound 0.2). Sequential: looks after 250, 500 and
    1,000 runs; it stops where the mean is further than 0.2 from the exact one with
    confidence 1 - 1e-3 (Hoeffding): ignored at 250 runs, beta / 1.5 at 500; beta 1.5x is
    not that far, so it runs the 1,000 and must be more than 0.25 off, as before."""
    _, _, exact = setup
    want, _ = tilted_log_probs(exact, letter_count_reward(1, REWARD_BETA, VOCAB))
    exact_mean = sum(math.exp(v) * k.count(1) for k, v in want.items())
    reward = letter_count_reward(1, beta, VOCAB, twisted=True)

    def far(counts, runs: int) -> bool:
        return abs(_mean_r(counts, runs) - exact_mean) - _mean_r_radius(runs) > 0.2

    counts, runs = until_decided(lambda start, m: _reward_run(setup, reward, m, start), far, 1000)
    assert far(counts, runs) or (runs == 1000 and abs(_mean_r(counts, 1000) - exact_mean) > 0.25)


def test_smc_without_the_twist_ratio_fails(setup, monkeypatch):
    """The twist ``phi(new) / phi(old)`` dropped (every log-twist 0): the reward never enters,
    and the samples stay at the plain target."""
    _, _, exact = setup
    reward = letter_count_reward(1, REWARD_BETA, VOCAB, twisted=True)
    want, _ = tilted_log_probs(exact, reward)
    monkeypatch.setattr(
        potential_hooks, "log_twist", lambda reward, tokens, *a, **k: torch.zeros(tokens.shape[0])
    )
    counts = _reward_run(setup, reward, runs=400)
    assert total_variation(want, counts, 400) > _tv(exact, want) - 0.15


DEAD_TABLE: dict[int | None, set[int]] = {None: {0, 1, 2, 3}, 0: set(), 1: {2}, 2: {0, 1}, 3: set()}


def test_dead_ends_kill_particles_and_all_dead_fails(setup):
    target, draft, _ = setup
    dfa = NextTokenAutomaton(DEAD_TABLE, VOCAB)
    with torch.inference_mode():
        out = decode_smc(
            target,
            draft,
            PROMPT,
            _smc(8, constraint=dfa),
            frozenset(),
            VOCAB,
            torch.Generator().manual_seed(0),
        )
        assert dfa.allows(out.tokens) and len(out.tokens) == LENGTH
        assert out.stats.dead_particles > 0
        # a mask that allows what the matcher then refuses: those particles die too
        liar = NextTokenAutomaton(TABLE, VOCAB, refused=frozenset({(2, 2), (2, 3), (None, 0)}))
        for seed in range(5):
            out = decode_smc(
                target,
                draft,
                PROMPT,
                _smc(8, constraint=liar),
                frozenset(),
                VOCAB,
                torch.Generator().manual_seed(seed),
            )
            assert liar.allows(out.tokens) and not any(
                (a, b) in liar.refused
                for a, b in zip([None, *out.tokens[:-1]], out.tokens, strict=True)
            )
            assert out.stats.dead_particles > 0
        hopeless = NextTokenAutomaton({None: {0, 3}, 0: set(), 3: set()}, VOCAB)
        for decode, models, cfg in (
            (decode_smc, (target, draft), _smc(4, constraint=hopeless)),
            (decode_ar, (target,), _cfg("ar", constraint=hopeless)),
            (decode_sd, (target, draft), _cfg("sd", draft_tokens=2, constraint=hopeless)),
        ):
            with pytest.raises(DeadEndError):
                decode(*models, PROMPT, cfg, frozenset(), VOCAB, torch.Generator().manual_seed(1))


def _next_log_probs(model, ctx: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, 2)
    return torch.log_softmax(model.prefill(torch.tensor(ctx), cache).double() / T, -1)


def test_smc_weights_with_a_mask_equal_brute_force(setup):
    """One round with K=1 and no resampling: each particle [x0, d1, b] must have log-weight
    ``log p(d1) - log q'(d1) + log sum_v p(v | x0, d1) m(v)`` (x0's term is shared)."""
    target, draft, _ = setup
    dfa = NextTokenAutomaton(TABLE, VOCAB)
    cfg = _cfg(
        "smc",
        particles=6,
        draft_tokens=1,
        ess_threshold=0.0,
        return_particles=True,
        constraint=dfa,
    )
    with torch.inference_mode():
        out = decode_smc(
            target, draft, PROMPT, cfg, frozenset(), VOCAB, torch.Generator().manual_seed(7)
        )
        logw = []
        for p in out.particles:
            x0, d1, _ = p.tokens
            m1 = dfa.masks[x0]
            q = _next_log_probs(draft, [*PROMPT, x0]).masked_fill(~m1, -math.inf)
            q_masked = q - torch.logsumexp(q, -1)
            lp = _next_log_probs(target, [*PROMPT, x0])
            bonus = _next_log_probs(target, [*PROMPT, x0, d1]).masked_fill(
                ~dfa.masks[d1], -math.inf
            )
            logw.append(float(lp[d1] - q_masked[d1] + torch.logsumexp(bonus, -1)))
    expected = torch.softmax(torch.tensor(logw, dtype=torch.float64), 0)
    got = torch.tensor([p.weight for p in out.particles], dtype=torch.float64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert out.stats.resamples == 0


def _pass_share_reward(beta: float) -> Reward:
    """The execution reward's shape on the tiny models: R = share of "b" in 3 letters, 0 once
    a "d" ("broken code") appears; the twist is 0 after a "d" and 0.5 ("still parses")
    before, as :meth:`smcspec.rewards.CodeExamples.prefix_score` does."""

    def share(texts: list[str]) -> list[float]:
        return [0.0 if "d" in t else t.count("b") / LENGTH for t in texts]

    def parses(texts: list[str]) -> list[float]:
        return [0.0 if "d" in t else 0.5 for t in texts]

    return Reward(share, beta, prefix_fn=parses, detokenize=letters)


def test_smc_with_a_pass_share_reward_converges_as_n_grows(setup):
    """Measured TV to p(x) exp(3 R(x)) / Z at 1000 runs: N=2 0.52, N=8 0.36, N=32 0.17,
    N=128 0.098 (sampling noise about 0.05); the plain target is at TV 0.43. The tilt is
    strong (R's range is 1, beta 3), so the self-normalised weights need many particles."""
    _, _, exact = setup
    reward = _pass_share_reward(3.0)
    want, _ = tilted_log_probs(exact, reward)
    plain_tv = _tv(exact, want)
    assert plain_tv > 0.3
    tv = {}
    for n in (2, 8, 32, 128):
        counts, _ = sample_outputs(setup[0], setup[1], PROMPT, _smc(n, reward=reward), 1000, 7000)
        tv[n] = total_variation(want, counts, 1000)
    assert tv[2] > tv[8] > tv[32] > tv[128]
    assert tv[128] < 0.13 and tv[128] < plain_tv / 3
