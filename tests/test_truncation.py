"""Tests of truncate_log_probs (top-k, top-p, min-p) on hand-made distributions.

Probabilities are sums of powers of two where a boundary case depends on an exact
comparison, so that float rounding cannot decide it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from enumerable import reference_kept

from smcspec.sampling.truncation import truncate_log_probs, truncation_active


def _lp(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def _kept(out: torch.Tensor) -> list[int]:
    return torch.isfinite(out).nonzero()[:, -1].tolist()


def _assert_renormalised(out: torch.Tensor, probs: list[float], kept: list[int]) -> None:
    """``out`` is ``probs`` restricted to ``kept`` and renormalised; -inf elsewhere."""
    assert out.dtype == torch.float32
    assert _kept(out) == kept
    p = torch.tensor(probs, dtype=torch.float64)
    expected = torch.zeros_like(p)
    expected[kept] = p[kept] / p[kept].sum()
    # tolerance 1e-6 absolute: float32 log_softmax of float32 log-probs
    torch.testing.assert_close(out.double().exp(), expected, atol=1e-6, rtol=0)


P4 = [0.5, 0.25, 0.125, 0.125]  # exact in binary


@pytest.mark.parametrize(
    "top_k, top_p, min_p", [(0, 1.0, 0.0), (-1, 1.0, 0.0), (0, 1, 0), (-1, 1, 0.0)]
)
def test_all_off_returns_the_input_itself(top_k, top_p, min_p):
    lp = torch.log_softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    assert not truncation_active(top_k, top_p, min_p)
    assert truncate_log_probs(lp, top_k, top_p, min_p) is lp  # no copy, no work


@pytest.mark.parametrize(
    "top_k, kept",
    [(1, [0]), (2, [0, 1]), (3, [0, 1, 2, 3]), (4, [0, 1, 2, 3]), (100, [0, 1, 2, 3])],
)
def test_top_k(top_k, kept):
    # k = 3 lands on the tie 0.125 = 0.125: every token tied with the k-th is kept (as
    # vLLM's and HF's `logits < kth_value` masks do), so 4 tokens survive
    _assert_renormalised(truncate_log_probs(_lp(P4), top_k=top_k), P4, kept)


def test_top_k_ties_at_the_top():
    probs = [0.125, 0.375, 0.375, 0.125]
    _assert_renormalised(truncate_log_probs(_lp(probs), top_k=1), probs, [1, 2])


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (1e-9, [0]),  # the top token is always kept
        (0.5, [0]),  # the top token alone has exactly 0.5: reached, stop
        (0.6, [0, 1]),
        (0.75, [0, 1]),  # 0.5 + 0.25 = 0.75 exactly: reached
        (0.8, [0, 1, 2, 3]),  # needs 0.125 more; both tied 0.125 tokens are kept
        (0.99, [0, 1, 2, 3]),
    ],
)
def test_top_p(top_p, kept):
    _assert_renormalised(truncate_log_probs(_lp(P4), top_p=top_p), P4, kept)


def test_top_p_ties_at_the_top():
    probs = [0.25, 0.375, 0.375]
    _assert_renormalised(truncate_log_probs(_lp(probs), top_p=0.1), probs, [1, 2])


@pytest.mark.parametrize(
    "min_p, kept",
    [
        (0.25, [0, 1, 2, 3]),  # 0.125 >= 0.25 * 0.5: kept at equality
        (0.26, [0, 1]),
        (0.5, [0, 1]),  # 0.25 >= 0.5 * 0.5 at equality
        (0.51, [0]),
        (1.0, [0]),  # only the most likely token (and anything tied with it)
    ],
)
def test_min_p(min_p, kept):
    _assert_renormalised(truncate_log_probs(_lp(P4), min_p=min_p), P4, kept)


def test_min_p_one_keeps_ties_with_the_maximum():
    probs = [0.375, 0.25, 0.375]
    _assert_renormalised(truncate_log_probs(_lp(probs), min_p=1.0), probs, [0, 2])


P_ORDER = [0.4, 0.3, 0.2, 0.1]


def test_top_p_applies_to_the_distribution_renormalised_after_top_k():
    # top_k = 3 renormalises to [4/9, 3/9, 2/9]: the mass before token 2 is 7/9 >= 0.75, so
    # top_p = 0.75 drops it. On the raw probabilities it would be 0.7 < 0.75 (kept): the
    # order (top-k, then top-p on the renormalised result, as vLLM) matters.
    out = truncate_log_probs(_lp(P_ORDER), top_k=3, top_p=0.75)
    _assert_renormalised(out, P_ORDER, [0, 1])
    _assert_renormalised(truncate_log_probs(_lp(P_ORDER), top_p=0.75), P_ORDER, [0, 1, 2])


def test_min_p_comes_before_top_p():
    # min_p = 0.5 keeps p >= 0.2, i.e. [0.4, 0.3, 0.2]; then top-p as above
    out = truncate_log_probs(_lp(P_ORDER), top_p=0.75, min_p=0.5)
    _assert_renormalised(out, P_ORDER, [0, 1])


def test_min_p_and_top_k_intersect():
    # min_p = 0.25 keeps p >= 0.1 (all four), top_k = 2 keeps two; and the other way round
    _assert_renormalised(truncate_log_probs(_lp(P_ORDER), top_k=2, min_p=0.25), P_ORDER, [0, 1])
    _assert_renormalised(truncate_log_probs(_lp(P_ORDER), top_k=4, min_p=0.6), P_ORDER, [0, 1])


def test_rows_are_independent_and_shapes_kept():
    rows = [P4, P_ORDER, [0.25, 0.25, 0.25, 0.25]]
    lp = torch.stack([_lp(r) for r in rows]).view(3, 1, 4)
    out = truncate_log_probs(lp, top_p=0.6)
    assert out.shape == (3, 1, 4) and out.dtype == torch.float32
    for i, kept in enumerate([[0, 1], [0, 1], [0, 1, 2, 3]]):
        _assert_renormalised(out[i, 0], rows[i], kept)


def test_unnormalised_and_float64_input_give_the_same_result():
    lp = _lp(P_ORDER)
    out = truncate_log_probs(lp, top_k=3, top_p=0.75)
    shifted = truncate_log_probs((lp + 7.0).double(), top_k=3, top_p=0.75)
    assert shifted.dtype == torch.float32
    # tolerance 1e-6: float32 rounding of the shifted values
    torch.testing.assert_close(shifted, out, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "scales, top_k, top_p, min_p",
    [
        # top-p's cut is searched among the 64, then 1024 largest values, then a full sort;
        # nucleus sizes (tokens) of the rows are given for each case
        ((8.0, 8.0), 0, 0.9, 0.0),  # ~10: within the first 64
        ((4.0, 4.0), 0, 0.9, 0.0),  # 64 and 65: one row decided at 64, one at 1024
        ((0.05, 0.05), 0, 0.9, 0.0),  # ~2700: full sort
        ((8.0, 0.05), 0, 0.9, 0.0),  # one row per stage
        ((4.0, 0.05, 8.0), 0, 0.5, 0.0),
        ((0.05, 0.05), 2000, 0.5, 0.0),
        ((2.0, 2.0), 50, 0.95, 0.01),
        ((2.0, 2.0), 0, 1.0, 0.05),
        ((1.0, 1.0), 3000, 1.0, 0.0),  # k = V keeps everything
    ],
)
def test_matches_brute_force_on_a_large_vocabulary(scales, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(11)
    v = 3000
    # logits rounded to multiples of 1/4 so that ties occur
    logits = torch.stack(
        [torch.round(torch.randn(v, generator=g, dtype=torch.float64) * s * 4) / 4 for s in scales]
    )
    lp = torch.log_softmax(logits, -1).float()
    out = truncate_log_probs(lp, top_k, top_p, min_p)
    for row in range(len(scales)):
        p = lp[row].double().exp().numpy()
        kept = reference_kept(p, top_k, top_p, min_p)
        assert np.array_equal(torch.isfinite(out[row]).numpy(), kept)
        assert kept[p.argmax()]
        expected = np.where(kept, p, 0.0) / p[kept].sum()
        # tolerance 1e-6: float32 renormalisation
        np.testing.assert_allclose(out[row].double().exp().numpy(), expected, atol=1e-6, rtol=0)


def test_the_top_token_survives_every_combination():
    g = torch.Generator().manual_seed(12)
    lp = torch.log_softmax(torch.randn(64, 40, generator=g) * 3, -1)
    top = lp.argmax(-1)
    for top_k in (0, 1, 5):
        for top_p in (1e-6, 0.5, 1.0):
            for min_p in (0.0, 0.5, 1.0):
                out = truncate_log_probs(lp, top_k, top_p, min_p)
                assert torch.isfinite(out.gather(-1, top[:, None])).all()
                # every row sums to 1 (tolerance 1e-5: float32)
                torch.testing.assert_close(out.exp().sum(-1), torch.ones(64), atol=1e-5, rtol=0)
                assert not math.isnan(float(out.exp().sum()))
