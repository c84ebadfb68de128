"""Tests of the SMC-SD incremental importance weights and the bonus normaliser."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from smcspec.sampling.smc_weights import (
    bonus_log_normalizer,
    incremental_log_weights,
    power_log_probs,
)
from smcspec.sampling.truncation import truncate_log_probs


def _brute_force(target_logp, draft_logp, alpha, bonus, kept) -> list[float]:
    """sum_{k <= min(kept, K)} (alpha log p - log q), plus the bonus term iff kept == K + 1."""
    n, k = target_logp.shape
    out = []
    for i in range(n):
        total = 0.0
        for j in range(min(int(kept[i]), k)):
            total += alpha * float(target_logp[i, j]) - float(draft_logp[i, j])
        if bonus is not None and int(kept[i]) == k + 1:
            total += float(bonus[i])
        out.append(total)
    return out


def _random_logps(n: int, k: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    tlp = torch.log_softmax(torch.randn(n, k, 50, generator=g, dtype=torch.float64), -1)[..., 0]
    dlp = torch.log_softmax(torch.randn(n, k, 50, generator=g, dtype=torch.float64), -1)[..., 0]
    bonus = torch.rand(n, generator=g, dtype=torch.float64) - 2.0
    return tlp.to(dtype), dlp.to(dtype), bonus


@pytest.mark.parametrize("alpha", [1.0, 0.5, 1.7, 3.0])
@pytest.mark.parametrize("with_bonus", [True, False])
def test_matches_brute_force(alpha, with_bonus):
    k = 4
    kept = torch.tensor([0, 1, 2, 3, 4, 5, 5, 0, 3], dtype=torch.int64)  # K + 1 = 5: full block
    tlp, dlp, bonus = _random_logps(kept.numel(), k, seed=int(alpha * 10) + with_bonus)
    bonus_arg = bonus if with_bonus else None
    got = incremental_log_weights(tlp, dlp, alpha, bonus_arg, kept)
    assert got.dtype == torch.float64 and got.shape == kept.shape
    expected = torch.tensor(_brute_force(tlp, dlp, alpha, bonus_arg, kept), dtype=torch.float64)
    # tolerance 1e-12 absolute: float64 summation order only
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)


def test_float32_inputs_are_summed_in_float64():
    k = 3
    kept = torch.tensor([1, 3, 4, 2], dtype=torch.int64)
    tlp, dlp, bonus = _random_logps(4, k, seed=3, dtype=torch.float32)
    got = incremental_log_weights(tlp, dlp, 2.0, bonus, kept)
    assert got.dtype == torch.float64
    expected = torch.tensor(_brute_force(tlp, dlp, 2.0, bonus, kept), dtype=torch.float64)
    # tolerance 1e-12: the float32 values are exact in float64, only summation order differs
    assert torch.allclose(got, expected, rtol=0, atol=1e-12)


def test_bonus_term_only_for_full_blocks():
    k = 2
    zeros = torch.zeros(4, k, dtype=torch.float64)
    bonus = torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=torch.float64)
    kept = torch.tensor([0, 1, 2, 3], dtype=torch.int64)
    got = incremental_log_weights(zeros, zeros, 2.0, bonus, kept)
    assert got.tolist() == [0.0, 0.0, 0.0, 40.0]  # exact
    # None (alpha == 1) adds nothing even for a full block
    assert incremental_log_weights(zeros, zeros, 1.0, None, kept).tolist() == [0.0] * 4


def test_kept_zero_gives_zero():
    tlp, dlp, bonus = _random_logps(5, 4, seed=4)
    kept = torch.zeros(5, dtype=torch.int64)
    for alpha, b in ((1.0, None), (2.5, bonus)):
        got = incremental_log_weights(tlp, dlp, alpha, b, kept)
        assert torch.equal(got, torch.zeros(5, dtype=torch.float64))  # exact


def test_positions_after_the_cut_are_ignored_even_if_not_finite():
    # Log-probs past the cut (after EOS / max_new_tokens, or for a finished particle) may be
    # -inf or NaN; they must not leak into the weight. Same for the bonus of a cut block.
    tlp = torch.tensor([[-1.0, -math.inf, math.nan], [math.nan, math.nan, math.nan]])
    dlp = torch.tensor([[-2.0, -math.inf, -1.0], [-1.0, math.inf, -math.inf]])
    bonus = torch.tensor([math.nan, math.nan], dtype=torch.float64)
    kept = torch.tensor([1, 0], dtype=torch.int64)
    got = incremental_log_weights(tlp, dlp, 1.5, bonus, kept)
    # particle 0: 1.5 * (-1) - (-2) = 0.5 exactly; particle 1: nothing kept
    assert got.tolist() == [0.5, 0.0]


def test_draft_equal_target_alpha_one_is_exactly_zero():
    # With draft == target and alpha = 1 every incremental weight is exactly 0 (not just
    # close): SMC-SD then reduces to sampling from the target without any resampling.
    tlp, _, _ = _random_logps(6, 5, seed=5, dtype=torch.float32)
    kept = torch.tensor([0, 1, 3, 5, 6, 6], dtype=torch.int64)
    got = incremental_log_weights(tlp, tlp.clone(), 1.0, None, kept)
    assert torch.equal(got, torch.zeros(6, dtype=torch.float64))
    # and with the (zero) alpha = 1 bonus normaliser passed explicitly
    zero_bonus = bonus_log_normalizer(torch.randn(6, 50), 0.7, 1.0)
    got = incremental_log_weights(tlp, tlp.clone(), 1.0, zero_bonus, kept)
    assert torch.allclose(got, torch.zeros(6, dtype=torch.float64), rtol=0, atol=1e-12)


# ----------------------------------------------------------------- bonus_log_normalizer


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 2.0])
def test_bonus_normalizer_zero_for_alpha_one(temperature):
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 2, 100, generator=g) * 5
    got = bonus_log_normalizer(logits, temperature, 1.0)
    assert got.shape == (3, 2) and got.dtype == torch.float64
    # tolerance 1e-12: the two logsumexp terms are identical computations
    assert torch.allclose(got, torch.zeros(3, 2, dtype=torch.float64), rtol=0, atol=1e-12)


def _numpy_log_sum_p_alpha(logits: np.ndarray, temperature: float, alpha: float) -> np.ndarray:
    s = logits.astype(np.float64) / temperature
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
    return np.log((p**alpha).sum(-1))


@pytest.mark.parametrize("alpha", [2.0, 0.5, 3.5])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_bonus_normalizer_is_log_sum_p_alpha(alpha, temperature):
    # logsumexp(alpha s) - alpha logsumexp(s) = log sum_v p(v)^alpha with p = softmax(s),
    # s = l / T. For alpha = 2 this is log sum p^2.
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 30, generator=g) * 3
    got = bonus_log_normalizer(logits, temperature, alpha)
    expected = _numpy_log_sum_p_alpha(logits.numpy(), temperature, alpha)
    # tolerance 1e-10 absolute: float64 rounding in both computations
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-10)


def test_bonus_normalizer_hand_computed():
    # l = [0, log 3], T = 1: p = [1/4, 3/4]; alpha = 2: log(1/16 + 9/16) = log(10/16)
    logits = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)
    got = float(bonus_log_normalizer(logits, 1.0, 2.0))
    assert got == pytest.approx(math.log(10 / 16), abs=1e-12)
    # same logits scaled by T = 0.5 give the same p
    got = float(bonus_log_normalizer(logits * 0.5, 0.5, 2.0))
    assert got == pytest.approx(math.log(10 / 16), abs=1e-12)


def test_bonus_normalizer_is_the_bonus_token_weight():
    # For a bonus token x drawn from r = softmax(alpha l / T), its importance weight against
    # the power target p_T^alpha is alpha log p_T(x) - log r(x), which must equal the
    # normaliser for every x (it does not depend on x).
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(40, generator=g, dtype=torch.float64) * 2
    t, alpha = 0.8, 2.5
    log_p = torch.log_softmax(logits / t, -1)
    log_r = torch.log_softmax(alpha * logits / t, -1)
    per_token = alpha * log_p - log_r
    norm = float(bonus_log_normalizer(logits, t, alpha))
    # tolerance 1e-10 absolute: float64 rounding
    assert torch.allclose(per_token, torch.full_like(per_token, norm), rtol=0, atol=1e-10)


def test_bonus_normalizer_is_stable_for_large_logits():
    # float32 logits of magnitude ~1e4: exp would overflow without the logsumexp shift.
    logits = torch.tensor([1e4, 1e4 - 1.0, -1e4], dtype=torch.float32)
    got = float(bonus_log_normalizer(logits, 1.0, 2.0))
    p = np.array([1.0, math.exp(-1.0), 0.0])
    p = p / p.sum()
    assert math.isfinite(got)
    assert got == pytest.approx(math.log((p**2).sum()), abs=1e-10)


# ----------------------------------------------------------------- power_log_probs (truncation)


@pytest.mark.parametrize("alpha", [0.5, 2.0, 3.5])
def test_power_log_probs_without_truncation_is_the_bonus_normalizer(alpha):
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 60, generator=g) * 3
    t = 0.7
    log_r, log_z = power_log_probs(torch.log_softmax(logits.double() / t, -1), alpha)
    assert log_r.dtype == torch.float32 and log_z.dtype == torch.float64
    assert log_r.shape == (3, 60) and log_z.shape == (3,)
    # tolerance 1e-10: float64 rounding of two equivalent formulas
    torch.testing.assert_close(log_z, bonus_log_normalizer(logits, t, alpha), atol=1e-10, rtol=0)
    # and r is softmax(alpha * l / T) (tolerance 1e-6: float32 output)
    expected = torch.log_softmax(alpha * logits.double() / t, -1).float()
    torch.testing.assert_close(log_r, expected, atol=1e-6, rtol=0)


def test_power_log_probs_hand_computed_with_truncation():
    # p = [1/2, 1/4, 1/8, 1/8], top_k = 2: p~ = [2/3, 1/3, 0, 0]; alpha = 2:
    # Z = 4/9 + 1/9 = 5/9, r = [4/5, 1/5, 0, 0]
    lp = truncate_log_probs(torch.tensor([0.5, 0.25, 0.125, 0.125]).log(), top_k=2)
    log_r, log_z = power_log_probs(lp, 2.0)
    assert float(log_z) == pytest.approx(math.log(5 / 9), abs=1e-6)  # float32 input
    torch.testing.assert_close(log_r.exp(), torch.tensor([0.8, 0.2, 0.0, 0.0]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("alpha", [1.0, 0.5, 2.5])
def test_power_log_probs_is_the_truncated_bonus_weight(alpha):
    # For a bonus b drawn from r ∝ p~^alpha the weight against the target p~^alpha is
    # alpha log p~(b) - log r(b) = log Z for every kept b; log Z = 0 at alpha = 1.
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(5, 80, generator=g) * 2
    lp = truncate_log_probs(torch.log_softmax(logits, -1), top_k=10, top_p=0.9)
    log_r, log_z = power_log_probs(lp, alpha)
    kept = torch.isfinite(lp)
    assert torch.equal(torch.isfinite(log_r), kept)  # same support
    per_token = alpha * lp.double() - log_r.double()
    # tolerance 1e-6: log_r is float32
    torch.testing.assert_close(
        per_token[kept], log_z[:, None].expand(5, 80)[kept], atol=1e-6, rtol=0
    )
    if alpha == 1.0:
        torch.testing.assert_close(log_z, torch.zeros(5, dtype=torch.float64), atol=1e-6, rtol=0)
    else:  # truncation changes the term: the untruncated normaliser would be wrong here
        untruncated = bonus_log_normalizer(logits, 1.0, alpha)
        assert ((log_z - untruncated).abs() > 1e-3).all()


def test_drafted_token_outside_the_kept_set_gives_weight_zero():
    # log p~(d) = -inf for a drafted token the target's truncation removed: log-weight -inf
    tlp = torch.tensor([[-0.5, -math.inf], [-0.5, -1.0]])
    dlp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]])
    got = incremental_log_weights(tlp, dlp, 1.0, None, torch.tensor([3, 3]))
    assert got[0] == -math.inf and got[1] == pytest.approx(1.5)
