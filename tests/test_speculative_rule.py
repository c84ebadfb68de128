"""Statistical tests of the speculative-sampling accept/reject rule (``speculative_verify``).

In the style of vLLM's rejection-sampler tests: a small vocabulary (V = 6) and block (K = 3),
fixed random target distributions ``p_j`` (``[K+1, V]``) and draft distributions ``q_j``
(``[K, V]``). Here the distributions do not depend on the prefix, so the tokens the rule emits
must be distributed as follows:

* position 0 (the first emitted token: ``d_0`` if accepted, else the residual draw) ~ ``p_0``;
* the rule accepts ``d_0`` with probability ``beta_0 = sum_v min(p_0(v), q_0(v))``, and the
  accepted count ``n`` has ``P(n >= j+1 | n >= j) = beta_j``;
* position 1 given that the block emits at least two tokens (``n >= 1``) ~ ``p_1``. This
  conditioning does not bias position 1: the event ``n >= 1`` depends only on ``(d_0, u_0)``,
  which are independent of ``(d_1, u_1)`` and of the residual / bonus draws that make up the
  token at position 1. Likewise the bonus token given ``n == K`` ~ ``p_K``.

Every trial is seeded through ``torch.Generator``; chi-square goodness-of-fit passes at
p > 1e-4. To show the test has power, deliberately wrong rules run through the same test with
the same number of trials and must give p < 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from smcspec.sampling.speculative import speculative_verify

V, K = 6, 3
# 30000 trials: ~80 us per speculative_verify call -> ~2.5 s. Smallest expected cell count
# is ~30000 * 0.03 = 900 for position 0 (the chi-square approximation is excellent).
TRIALS = 30000
PASS_P = 1e-4  # a correct rule passes when the chi-square p-value exceeds this
FAIL_P = 1e-6  # a wrong rule must be rejected with a p-value below this


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # tiny tensors: avoid intra-op thread-pool overhead on a loaded 2-core machine
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _random_dists(rows: int, seed: int) -> torch.Tensor:
    """Fixed random distributions ``[rows, V]`` in float32, every entry >= ~0.015."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, V, generator=g, dtype=torch.float64) ** 2 + 0.02
    return (x / x.sum(-1, keepdim=True)).float()


TARGET = _random_dists(K + 1, seed=2024)  # p_0 .. p_K
DRAFT = _random_dists(K, seed=4202)  # q_0 .. q_{K-1}


def _as_dist(row: torch.Tensor) -> torch.Tensor:
    row = row.double()
    return row / row.sum()


def _chisquare_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of the chi-square goodness-of-fit of integer ``samples`` against ``probs``."""
    observed = torch.bincount(samples, minlength=V).double()
    expected = observed.sum() * _as_dist(probs)
    assert float(expected.min()) >= 5, "chi-square needs >= 5 expected counts per cell"
    return float(stats.chisquare(observed.numpy(), expected.numpy()).pvalue)


def _draft_tokens(trials: int, seed: int) -> torch.Tensor:
    """``[trials, K]`` draft tokens: row t holds one independent draw d_j ~ q_j per position."""
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(DRAFT, trials, replacement=True, generator=g).T.contiguous()


@pytest.fixture(scope="module")
def runs() -> dict[str, torch.Tensor]:
    """TRIALS independent calls of the real ``speculative_verify`` (one call per trial)."""
    drafts = _draft_tokens(TRIALS, seed=11)
    g = torch.Generator().manual_seed(12)
    n = torch.empty(TRIALS, dtype=torch.int64)
    tok = torch.empty(TRIALS, dtype=torch.int64)
    for t in range(TRIALS):
        n_t, tok_t = speculative_verify(drafts[t], DRAFT, TARGET, g)
        n[t], tok[t] = n_t, tok_t
    return {"drafts": drafts, "n": n, "token": tok}


def _emitted_at(drafts: torch.Tensor, n: torch.Tensor, tok: torch.Tensor, j: int) -> torch.Tensor:
    """Token emitted at block position j, for the trials that emit it (``n >= j``)."""
    keep = n >= j
    if j == K:
        return tok[keep]
    return torch.where(n[keep] > j, drafts[keep, j], tok[keep])


def test_return_types(runs):
    n, tok = speculative_verify(runs["drafts"][0], DRAFT, TARGET, torch.Generator().manual_seed(0))
    assert type(n) is int and type(tok) is int
    assert 0 <= n <= K and 0 <= tok < V
    assert int(runs["n"].min()) >= 0 and int(runs["n"].max()) <= K
    assert int(runs["token"].min()) >= 0 and int(runs["token"].max()) < V


def test_first_token_distribution_is_target(runs):
    first = _emitted_at(runs["drafts"], runs["n"], runs["token"], 0)
    assert first.numel() == TRIALS
    p = _chisquare_p(first, TARGET[0])
    assert p > PASS_P, f"first emitted token does not follow p_0 (chi-square p = {p:.3g})"


def test_first_token_acceptance_rate(runs):
    beta0 = float(torch.minimum(_as_dist(TARGET[0]), _as_dist(DRAFT[0])).sum())
    rate = float((runs["n"] >= 1).double().mean())
    # tolerance: 5 binomial standard errors sqrt(beta (1 - beta) / TRIALS) (~0.014 here)
    tol = 5 * math.sqrt(beta0 * (1 - beta0) / TRIALS)
    assert abs(rate - beta0) < tol, f"acceptance rate {rate:.4f} vs {beta0:.4f} +- {tol:.4f}"


def test_accepted_count_distribution(runs):
    beta = torch.minimum(TARGET[:K].double(), DRAFT.double()).sum(-1)  # beta_0 .. beta_{K-1}
    probs = torch.empty(K + 1, dtype=torch.float64)
    reach = 1.0
    for j in range(K):
        probs[j] = reach * (1 - beta[j])
        reach *= float(beta[j])
    probs[K] = reach
    observed = torch.bincount(runs["n"], minlength=K + 1).double()
    expected = TRIALS * probs / probs.sum()
    p = float(stats.chisquare(observed.numpy(), expected.numpy()).pvalue)
    assert p > PASS_P, f"accepted-count distribution is off (chi-square p = {p:.3g})"


def test_second_token_given_two_emitted_is_target(runs):
    # conditioning on n >= 1 is unbiased for position 1 (see the module docstring)
    second = _emitted_at(runs["drafts"], runs["n"], runs["token"], 1)
    assert second.numel() > TRIALS // 3  # ~beta_0 = 0.50 of the trials reach position 1
    p = _chisquare_p(second, TARGET[1])
    assert p > PASS_P, f"second emitted token does not follow p_1 (chi-square p = {p:.3g})"


def test_bonus_token_given_all_accepted_is_target(runs):
    bonus = _emitted_at(runs["drafts"], runs["n"], runs["token"], K)
    assert bonus.numel() > 1000  # ~beta_0 beta_1 beta_2 = 0.15 of the blocks are fully accepted
    p = _chisquare_p(bonus, TARGET[K])
    assert p > PASS_P, f"bonus token does not follow p_K (chi-square p = {p:.3g})"


# ------------------------------------------------------- the same test rejects wrong rules


def _first_token_vectorised(rule: str, trials: int, seed: int) -> torch.Tensor:
    """The first emitted token of ``trials`` blocks under a local (vectorised) variant rule.

    ``correct``: accept d_0 w.p. min(1, p/q), else draw from norm(max(p - q, 0)) -- the
    reference rule, to show the harness itself passes; ``residual_is_p``: on rejection draw
    from p instead of the residual; ``accept_always``: accept every draft token.
    """
    g = torch.Generator().manual_seed(seed)
    d0 = _draft_tokens(trials, seed=seed + 1)[:, 0]
    p0, q0 = TARGET[0].double(), DRAFT[0].double()
    if rule == "accept_always":
        return d0
    u = torch.rand(trials, generator=g, dtype=torch.float64)
    accept = u * q0[d0] < p0[d0]
    residual = (p0 - q0).clamp_min(0) if rule == "correct" else p0
    resampled = torch.multinomial(residual.float(), trials, replacement=True, generator=g)
    return torch.where(accept, d0, resampled)


def test_vectorised_reference_rule_passes():
    p = _chisquare_p(_first_token_vectorised("correct", TRIALS, seed=21), TARGET[0])
    assert p > PASS_P


@pytest.mark.parametrize("rule", ["residual_is_p", "accept_always"])
def test_wrong_rule_fails_the_same_test(rule):
    p = _chisquare_p(_first_token_vectorised(rule, TRIALS, seed=31), TARGET[0])
    assert p < FAIL_P, f"the chi-square test did not detect the wrong rule {rule!r} (p = {p:.3g})"


# ------------------------------------------------------------------------------ edge cases


def test_identical_target_and_draft_accepts_everything():
    # With p == q, u * q < p holds for every u in [0, 1): all K tokens are accepted, and the
    # bonus comes from target_probs[K] (one-hot here, so it is determined).
    draft = _random_dists(K, seed=5)
    bonus_row = torch.zeros(1, V)
    bonus_row[0, 4] = 1.0
    target = torch.cat((draft.clone(), bonus_row))
    drafts = _draft_tokens(2000, seed=6)  # drawn from DRAFT: covers every token
    g = torch.Generator().manual_seed(7)
    for t in range(drafts.shape[0]):
        assert speculative_verify(drafts[t], draft, target, g) == (K, 4)


def test_identical_target_and_draft_including_zero_probabilities():
    # p == q with some zero-probability tokens; draft tokens drawn from q never hit them.
    draft = _random_dists(K, seed=8)
    draft[:, 0] = 0.0
    draft = draft / draft.sum(-1, keepdim=True)
    target = torch.cat((draft, _random_dists(1, seed=9)))
    g = torch.Generator().manual_seed(10)
    drafts = torch.multinomial(draft, 500, replacement=True, generator=g).T.contiguous()
    for t in range(drafts.shape[0]):
        n, tok = speculative_verify(drafts[t], draft, target, g)
        assert n == K and 0 <= tok < V


def test_zero_target_mass_is_never_emitted():
    # The target gives token 0 no mass at any position while the draft favours it: token 0
    # must never be emitted (rejected with certainty, excluded from the residual and bonus).
    target = _random_dists(K + 1, seed=13)
    target[:, 0] = 0.0
    target = target / target.sum(-1, keepdim=True)
    draft = _random_dists(K, seed=14)
    draft[:, 0] = 0.5
    draft = draft / draft.sum(-1, keepdim=True)
    g = torch.Generator().manual_seed(15)
    drafts = torch.multinomial(draft, 3000, replacement=True, generator=g).T.contiguous()
    assert (drafts == 0).any()  # the draft does propose token 0
    for t in range(drafts.shape[0]):
        n, tok = speculative_verify(drafts[t], draft, target, g)
        emitted = drafts[t, :n].tolist() + [tok]
        assert 0 not in emitted


def test_k_equals_one():
    # K = 1: the first emitted token still follows p_0 (5000 trials, same chi-square rule).
    target, draft = TARGET[:2], DRAFT[:1]
    drafts = torch.multinomial(
        draft, 5000, replacement=True, generator=torch.Generator().manual_seed(16)
    ).T
    g = torch.Generator().manual_seed(17)
    first = torch.empty(5000, dtype=torch.int64)
    for t in range(5000):
        n, tok = speculative_verify(drafts[t].contiguous(), draft, target, g)
        assert 0 <= n <= 1
        first[t] = drafts[t, 0] if n == 1 else tok
    assert _chisquare_p(first, target[0]) > PASS_P
