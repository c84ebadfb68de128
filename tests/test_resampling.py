"""Tests of weight normalisation, ESS and the four resampling schemes.

Every random draw comes from a ``torch.Generator`` with a fixed seed, so each test is
deterministic; every statistical tolerance is stated next to the assertion it guards.
"""

from __future__ import annotations

import math

import pytest
import torch

from smcspec.backends.torch.graphs import HostReadGuard
from smcspec.sampling.resampling import (
    RESAMPLERS,
    batched_ess,
    effective_sample_sizes,
    log_mean_weight,
    normalized_weights,
    residual_resample,
    strata_ancestors,
    stratified_resample,
    systematic_resample,
)

# A fixed, non-uniform weight vector (N = 8) spanning 0.001 .. 0.4; sums to exactly 1.
# Shuffled on purpose so that the large weights are not all at one end of the CDF, and with
# one weight (0.25) for which N * w is an integer (2.0) and one (0.001) with N * w << 1.
WEIGHTS = [0.1, 0.001, 0.4, 0.03, 0.25, 0.019, 0.15, 0.05]
N = len(WEIGHTS)
# Repetitions of the unbiasedness experiment. Each call takes ~30-100 us (single thread),
# so 4 schemes x 20000 repetitions stay at a few seconds on a 2-core machine.
REPS = 20000


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Run torch single-threaded in this module.

    The calls here are on tiny tensors; on a loaded 2-core machine torch's intra-op thread
    pool (used by ``repeat_interleave`` in the residual scheme) can cost milliseconds per
    call. The results do not depend on the thread count; only the runtime does.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _log_weights() -> torch.Tensor:
    return torch.tensor(WEIGHTS, dtype=torch.float64).log()


def _offspring_counts(resampler, log_weights: torch.Tensor, reps: int, seed: int) -> torch.Tensor:
    """``[reps, N]`` int64: how many copies of each particle every repetition produced."""
    g = torch.Generator().manual_seed(seed)
    n = log_weights.numel()
    counts = torch.empty(reps, n, dtype=torch.int64)
    for r in range(reps):
        counts[r] = torch.bincount(resampler(log_weights, generator=g), minlength=n)
    return counts


@pytest.fixture(scope="module")
def offspring() -> dict[str, torch.Tensor]:
    """Offspring counts of every scheme for WEIGHTS, computed once and shared by the tests."""
    lw = _log_weights()
    return {
        name: _offspring_counts(fn, lw, REPS, seed=1234 + i)
        for i, (name, fn) in enumerate(RESAMPLERS.items())
    }


def test_registry_lists_the_four_schemes():
    assert set(RESAMPLERS) == {"systematic", "stratified", "multinomial", "residual"}


# --------------------------------------------------------------------------- unbiasedness


@pytest.mark.parametrize("name", list(RESAMPLERS))
def test_unbiased_offspring_counts(name, offspring):
    counts = offspring[name].double()  # [REPS, N]
    expected = N * torch.tensor(WEIGHTS, dtype=torch.float64)
    assert torch.all(counts.sum(1) == N)  # every repetition returns exactly N ancestors
    mean = counts.mean(0)
    # CLT bound: the mean of REPS i.i.d. counts is within 5 standard errors of its
    # expectation N * w_i (two-sided probability of a miss ~6e-7 per particle). The standard
    # error is estimated from the sample; it is floored at 1e-3 because for low-variance
    # schemes (systematic, residual) the count of some particle can be nearly constant, and
    # a zero sample variance must not turn the check into an exact equality.
    se = counts.std(0, unbiased=True) / math.sqrt(REPS)
    tol = 5 * torch.clamp(se, min=1e-3)
    assert torch.all((mean - expected).abs() <= tol), (
        f"{name}: mean offspring {mean.tolist()} vs N*w {expected.tolist()} (tol {tol.tolist()})"
    )


def test_unbiasedness_check_can_fail(offspring):
    """The same bound rejects a deliberately biased scheme (always the arg-max particle)."""
    counts = torch.zeros(REPS, N, dtype=torch.float64)
    counts[:, WEIGHTS.index(max(WEIGHTS))] = N
    expected = N * torch.tensor(WEIGHTS, dtype=torch.float64)
    se = counts.std(0, unbiased=True) / math.sqrt(REPS)
    tol = 5 * torch.clamp(se, min=1e-3)
    assert not torch.all((counts.mean(0) - expected).abs() <= tol)


# --------------------------------------------------------------------- per-draw structure


def _bounds(snap: float = 1e-9) -> tuple[torch.Tensor, torch.Tensor]:
    """floor(N w_i) and ceil(N w_i) of WEIGHTS.

    N * w_i is computed in float64; a value within ``snap`` (1e-9) of an integer is treated as
    that integer (floor == ceil), so the 0.25 particle (N w = 2) must get exactly 2 copies
    from systematic resampling rather than a widened [1, 3].
    """
    nw = N * torch.tensor(WEIGHTS, dtype=torch.float64)
    return torch.floor(nw + snap).long(), torch.ceil(nw - snap).long()


def test_systematic_counts_are_floor_or_ceil(offspring):
    lo, hi = _bounds()
    counts = offspring["systematic"]
    # Systematic resampling: every draw gives floor(N w_i) or ceil(N w_i) copies (exact).
    assert torch.all(counts >= lo) and torch.all(counts <= hi)


def test_stratified_counts_within_two_of_expectation(offspring):
    counts = offspring["stratified"].double()
    expected = N * torch.tensor(WEIGHTS, dtype=torch.float64)
    # Stratified resampling: the count lies in [floor(N w) - 1, ceil(N w) + 1], so it differs
    # from N w_i by strictly less than 2 in every draw (exact, no statistical tolerance).
    assert torch.all((counts - expected).abs() < 2)


def test_residual_keeps_the_deterministic_copies(offspring):
    lo, _ = _bounds()
    # Residual resampling: at least floor(N w_i) copies of each particle in every draw.
    assert torch.all(offspring["residual"] >= lo)


def test_residual_deterministic_when_n_w_are_integers():
    # N w = [2, 1, 1, 0]: no residual mass left, so the result is fully determined.
    lw = torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=torch.float64).log()
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        idx = residual_resample(lw, generator=g)
        assert torch.bincount(idx, minlength=4).tolist() == [2, 1, 1, 0]


# -------------------------------------------------------------------- shape / dtype / range


@pytest.mark.parametrize("name", list(RESAMPLERS))
@pytest.mark.parametrize("n", [1, 2, 3, 8, 17, 256])
def test_shape_dtype_range(name, n):
    g = torch.Generator().manual_seed(n)
    for _ in range(10):
        lw = torch.randn(n, generator=g, dtype=torch.float64) * 3
        idx = RESAMPLERS[name](lw, generator=g)
        assert idx.shape == (n,)
        assert idx.dtype == torch.int64
        assert int(idx.min()) >= 0 and int(idx.max()) <= n - 1


@pytest.mark.parametrize("name", list(RESAMPLERS))
def test_float32_input_accepted(name):
    g = torch.Generator().manual_seed(3)
    lw = torch.randn(6, generator=g).float()
    idx = RESAMPLERS[name](lw, generator=g)
    assert idx.shape == (6,) and idx.dtype == torch.int64


# ------------------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("name", list(RESAMPLERS))
@pytest.mark.parametrize("value", [0.0, -math.inf, -1e4, math.nan])
def test_single_particle(name, value):
    g = torch.Generator().manual_seed(0)
    idx = RESAMPLERS[name](torch.tensor([value], dtype=torch.float64), generator=g)
    assert idx.tolist() == [0]


@pytest.mark.parametrize("name", list(RESAMPLERS))
def test_all_minus_inf_gives_valid_indices(name):
    lw = torch.full((5,), -math.inf, dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    for _ in range(50):
        idx = RESAMPLERS[name](lw, generator=g)
        assert idx.shape == (5,) and idx.dtype == torch.int64
        assert int(idx.min()) >= 0 and int(idx.max()) <= 4


@pytest.mark.parametrize("lw", [[-math.inf] * 5, [math.nan] * 3, [math.nan, -math.inf]])
def test_normalized_weights_degenerate_is_uniform(lw):
    w, degenerate = normalized_weights(torch.tensor(lw, dtype=torch.float64))
    assert degenerate is True
    assert w.dtype == torch.float64
    assert torch.equal(w, torch.full((len(lw),), 1.0 / len(lw), dtype=torch.float64))


def test_plus_inf_log_weights_share_all_the_weight():
    lw = torch.tensor([0.0, math.inf, -1.0, math.inf, -math.inf], dtype=torch.float64)
    w, degenerate = normalized_weights(lw)
    assert degenerate is False
    assert torch.equal(w, torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0], dtype=torch.float64))


@pytest.mark.parametrize("name", ["systematic", "stratified", "multinomial"])
def test_resamplers_read_nothing_back(name):
    """On a GPU each host read waits for the device: these schemes need none (residual's
    deterministic copies have a data-dependent count and read it)."""
    g = torch.Generator().manual_seed(3)
    for lw in (_log_weights(), torch.full((4,), -math.inf), torch.tensor([0.0, math.inf])):
        with HostReadGuard():
            idx = RESAMPLERS[name](lw, generator=g)
        assert idx.shape == lw.shape


def test_group_ess_read_at_once():
    groups = [_log_weights(), torch.zeros(8, dtype=torch.float64), torch.full((8,), -math.inf)]
    with HostReadGuard(strict=False) as guard:
        ess = effective_sample_sizes(groups)
    assert len(guard.reads) == 1
    assert ess == [_ess(lw) for lw in groups]
    assert ess[1] == pytest.approx(8.0) and ess[2] == pytest.approx(8.0)


def test_normalized_weights_regular_case():
    w, degenerate = normalized_weights(torch.tensor([0.0, math.log(3.0)], dtype=torch.float64))
    assert degenerate is False
    # tolerance 1e-15: float64 rounding only
    assert torch.allclose(w, torch.tensor([0.25, 0.75], dtype=torch.float64), rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    "lw",
    [
        torch.tensor([-2000.0, -2001.0, -2005.0], dtype=torch.float64),
        torch.tensor([-1e4, -1e4 + 3], dtype=torch.float32),  # exp underflows in float32
        torch.tensor([-1e4, -1e4 + 3], dtype=torch.float64),
        torch.tensor([1e4, 1e4 - 2, 1e4 - 7], dtype=torch.float32),  # exp overflows
        torch.tensor([-800.0, -math.inf, -801.0], dtype=torch.float64),
    ],
)
def test_normalized_weights_shift_invariant(lw):
    w, degenerate = normalized_weights(lw)
    assert degenerate is False
    # expected: exp of the differences to the first entry, normalised (computed in float64
    # from the exact float values of the input)
    lw64 = lw.double()
    diff = lw64 - lw64[0]
    expected = diff.exp() / diff.exp().sum()
    # tolerance 1e-12 (absolute): float64 rounding of exp and the normalising sum
    assert torch.allclose(w, expected, rtol=0, atol=1e-12)
    assert torch.isfinite(w).all()
    assert abs(float(w.sum()) - 1.0) < 1e-12


@pytest.mark.parametrize("name", list(RESAMPLERS))
def test_underflowing_log_weights_resample_correctly(name):
    # In float32, exp(-1e4) is 0 for both entries; the second weight is e^3 / (1 + e^3).
    # A second particle at -1e4 - 1000 has weight e^-1000 = 0 even in float64: never drawn.
    lw = torch.tensor([-1e4, -1e4 + 3, -1e4 - 1000], dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    counts = torch.zeros(3, dtype=torch.int64)
    for _ in range(500):
        counts += torch.bincount(RESAMPLERS[name](lw, generator=g), minlength=3)
    assert counts[2] == 0
    # Share of the second particle: expected e^3/(1+e^3) = 0.9526 over 1500 draws; the
    # tolerance 0.05 is > 8 binomial standard errors (sd of the share <= 0.0055).
    share = float(counts[1]) / float(counts.sum())
    assert abs(share - math.exp(3) / (1 + math.exp(3))) < 0.05


@pytest.mark.parametrize("name", list(RESAMPLERS))
def test_nan_log_weight_is_zero_weight(name):
    lw = torch.tensor([0.0, math.nan, -1.0, math.nan], dtype=torch.float64)
    w, degenerate = normalized_weights(lw)
    assert degenerate is False
    assert w[1] == 0 and w[3] == 0
    # tolerance 1e-15: float64 rounding
    assert abs(float(w[0]) - 1 / (1 + math.exp(-1))) < 1e-15
    g = torch.Generator().manual_seed(5)
    for _ in range(200):
        idx = RESAMPLERS[name](lw, generator=g)
        assert not torch.isin(idx, torch.tensor([1, 3])).any()


@pytest.mark.parametrize("name", list(RESAMPLERS))
@pytest.mark.parametrize("hot", [0, 3, 6])
def test_one_hot_weight_always_selected(name, hot):
    lw = torch.full((7,), -math.inf, dtype=torch.float64)
    lw[hot] = -3.5
    g = torch.Generator().manual_seed(hot)
    for _ in range(200):
        assert RESAMPLERS[name](lw, generator=g).tolist() == [hot] * 7


@pytest.mark.parametrize("name", list(RESAMPLERS))
def test_seeded_generator_is_reproducible(name):
    lw = _log_weights()
    a = RESAMPLERS[name](lw, generator=torch.Generator().manual_seed(99))
    b = RESAMPLERS[name](lw, generator=torch.Generator().manual_seed(99))
    assert torch.equal(a, b)


def test_systematic_and_stratified_are_sorted():
    # Both use increasing points u_i on the inverse CDF, so ancestors come out sorted.
    lw = _log_weights()
    g = torch.Generator().manual_seed(8)
    for fn in (systematic_resample, stratified_resample):
        for _ in range(50):
            idx = fn(lw, generator=g)
            assert torch.equal(idx, idx.sort().values)


# -------------------------------------------------------------------- ESS and log Z factor


@pytest.mark.parametrize("n", [1, 4, 256])
def test_ess_uniform_is_n(n):
    for lw in (torch.zeros(n), torch.full((n,), -1234.5, dtype=torch.float64)):
        # tolerance 1e-9 relative: float64 rounding of 1 / sum(w^2)
        assert _ess(lw) == pytest.approx(n, rel=1e-9)


def test_ess_one_hot_is_one():
    lw = torch.tensor([-math.inf, 2.0, -math.inf, -math.inf], dtype=torch.float64)
    assert _ess(lw) == pytest.approx(1.0, rel=1e-12)


def test_ess_hand_computed():
    # w = [0.5, 0.25, 0.25] (unnormalised [2, 1, 1]): sum w^2 = 0.375, ESS = 8/3.
    lw = torch.tensor([math.log(2.0), 0.0, 0.0], dtype=torch.float64)
    assert _ess(lw) == pytest.approx(8.0 / 3.0, rel=1e-12)
    # shift invariance, in float32, at magnitudes where exp underflows
    lw32 = (torch.tensor([math.log(2.0), 0.0, 0.0]) - 1e4).float()
    # tolerance 1e-3 relative: log(2) - 1e4 is stored in float32 with an error of ~5e-4
    assert _ess(lw32) == pytest.approx(8.0 / 3.0, rel=1e-3)


def test_ess_degenerate_is_n():
    # all -inf is treated as uniform weights
    assert _ess(torch.full((6,), -math.inf)) == pytest.approx(6.0)


def test_batched_ess_is_each_vectors_ess_along_any_dim():
    """One ESS for a batch: each slice along ``dim`` gets :func:`effective_sample_size`'s value
    (float64 rounding only: tolerance 1e-12), a slice of zero weights (all ``-inf``) its
    length, and NaN counts as zero weight; no host read. Broken variant caught: the ESS taken
    along the wrong dimension (a ``[G, M, K]`` batch's values would be K's, not M's)."""
    g = torch.Generator().manual_seed(5)
    lw = torch.randn(3, 5, 4, generator=g, dtype=torch.float64) * 2
    lw[1, :, 2] = -math.inf  # group 1 at position 3: every weight zero
    lw[2, 0, 0] = math.nan  # a NaN weight counts as zero
    with HostReadGuard():
        ess = batched_ess(lw, dim=1)
    assert ess.shape == (3, 4) and ess.dtype == torch.float64
    for gi in range(3):
        for j in range(4):
            want = _ess(lw[gi, :, j])
            assert float(ess[gi, j]) == pytest.approx(want, rel=1e-12)
    assert float(ess[1, 2]) == pytest.approx(5.0)
    nan_free = lw[2, :, 0].clone()
    nan_free[0] = -math.inf
    assert float(ess[2, 0]) == pytest.approx(_ess(nan_free), rel=1e-12)
    assert torch.equal(batched_ess(lw.transpose(1, 2)), ess)


def test_the_resamplers_by_strata_are_strata_ancestors():
    """Systematic and stratified resampling are :func:`strata_ancestors` at the uniforms they
    draw (one shared, one a stratum); the tuner calls it with uniforms of its own stream.
    Hand-computed: weights [0.5, 0.25, 0.25] at u = 0.3 put the points (0.1, 0.43, 0.77) in
    particles 0, 0, 2."""
    lw = _log_weights()
    for resample, size in ((systematic_resample, 1), (stratified_resample, N)):
        u = torch.rand(size, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        got = resample(lw, generator=torch.Generator().manual_seed(9))
        assert torch.equal(got, strata_ancestors(lw, u))
    w = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64).log()
    assert strata_ancestors(w, 0.3).tolist() == [0, 0, 2]


def test_log_mean_weight_hand_computed():
    # log((2 + 1 + 1) / 3) = log(4/3)
    lw = torch.tensor([math.log(2.0), 0.0, 0.0], dtype=torch.float64)
    assert log_mean_weight(lw) == pytest.approx(math.log(4.0 / 3.0), abs=1e-12)
    # shift: log((e^-3000 + e^-3001) / 2) = -3000 + log((1 + e^-1) / 2); exp underflows
    lw = torch.tensor([-3000.0, -3001.0], dtype=torch.float64)
    expected = -3000.0 + math.log((1 + math.exp(-1)) / 2)
    assert log_mean_weight(lw) == pytest.approx(expected, abs=1e-9)
    # zeros: log(1) = 0
    assert log_mean_weight(torch.zeros(5, dtype=torch.float64)) == pytest.approx(0.0, abs=1e-15)
    # a -inf entry contributes nothing: log((1 + 0) / 2) = -log 2
    lw = torch.tensor([0.0, -math.inf], dtype=torch.float64)
    assert log_mean_weight(lw) == pytest.approx(-math.log(2.0), abs=1e-15)
    assert log_mean_weight(torch.full((3,), -math.inf)) == -math.inf


def _ess(log_weights: torch.Tensor) -> float:
    """:func:`batched_ess` of one log-weight vector, as a float."""
    return float(batched_ess(log_weights))
