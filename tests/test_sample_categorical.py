"""``sample_categorical``: the two-level inverse-CDF sampler draws from the given
distribution; ``tempered_log_probs`` finds a NaN logit anywhere."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from smcspec.errors import NumericalError
from smcspec.sampling.distributions import sample_categorical


@pytest.mark.parametrize("vocab", [5, 256, 600])  # one partial block, one full, blocks + tail
def test_frequencies_match_the_distribution(vocab):
    g = torch.Generator().manual_seed(0)
    w = torch.rand(vocab, generator=g) ** 3
    w[torch.randperm(vocab, generator=g)[: vocab // 3]] = 0.0  # zero-mass tokens
    w = w * 7.0  # not normalised
    draws = 60_000
    out = sample_categorical(w.expand(draws, vocab), g)
    assert out.shape == (draws,) and out.dtype == torch.int64
    counts = torch.bincount(out, minlength=vocab).double()
    assert counts[w == 0].sum() == 0  # a zero-mass token is never drawn
    p = (w / w.sum()).double()
    keep = p > 0
    # merge the rarest categories so every expected count is >= 5 for the chi-square test
    order = torch.argsort(p[keep])
    exp_c, obs_c = (p[keep] * draws)[order], counts[keep][order]
    cut = int((torch.cumsum(exp_c, 0) < 5).sum()) + 1
    exp_m = torch.cat((exp_c[:cut].sum()[None], exp_c[cut:]))
    obs_m = torch.cat((obs_c[:cut].sum()[None], obs_c[cut:]))
    exp_m = exp_m * (draws / exp_m.sum())  # exact totals for scipy
    assert chisquare(obs_m.numpy(), exp_m.numpy()).pvalue > 1e-3
    tv = 0.5 * (counts / draws - p).abs().sum()
    assert tv < 0.05


@pytest.mark.parametrize("index", [0, 255, 256, 511, 599])
def test_one_hot_rows_at_block_edges(index):
    probs = torch.zeros(3, 600)
    probs[:, index] = 1.0
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        assert sample_categorical(probs, g).tolist() == [index] * 3


def test_batch_shape_dtype_and_tiny_masses():
    g = torch.Generator().manual_seed(2)
    probs = torch.full((2, 3, 1000), 1e-30, dtype=torch.bfloat16)
    probs[..., 777] = 1.0
    out = sample_categorical(probs, g)
    assert out.shape == (2, 3) and bool((out == 777).all())


@pytest.mark.parametrize(
    "row", [[0.0, 0.0, 0.0], [0.5, float("nan"), 0.5], [0.5, float("inf"), 0.1], [0.5, -0.1, 0.6]]
)
def test_rows_without_a_valid_distribution_raise(row):
    with pytest.raises(NumericalError):
        sample_categorical(torch.tensor([[0.2, 0.3, 0.5], row]), None)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1e-8, 0.0])
@pytest.mark.parametrize("position", [0, 1, 77, 255, 256, 1000, 151935])
def test_a_nan_logit_anywhere_raises(temperature, position):
    """tempered_log_probs checks one column of its output for NaN (a NaN logit makes its
    whole row NaN) and only then the logits: a NaN at any position, in any row, at any
    temperature, must still raise."""
    from smcspec.sampling.distributions import tempered_log_probs

    logits = torch.randn(3, 151936, generator=torch.Generator().manual_seed(position))
    tempered_log_probs(logits, temperature)  # finite: no error
    logits[2, position] = float("nan")
    with pytest.raises(NumericalError, match="NaN"):
        tempered_log_probs(logits, temperature)


def test_infinite_logits_without_nan_do_not_raise():
    """Only NaN is an error: a -inf logit (a banned token) or a row of them, and +inf, are
    left to the sampler, as before the one-column check."""
    from smcspec.sampling.distributions import tempered_log_probs

    logits = torch.randn(3, 1000)
    logits[0, 5] = -torch.inf
    logits[1] = -torch.inf
    logits[2, 7] = torch.inf
    out = tempered_log_probs(logits, 0.7)
    assert torch.isfinite(out[0, :5]).all() and out[0, 5] == -torch.inf


@pytest.mark.parametrize("vocab", [2, 3, 8, 37, 200])
def test_a_vocabulary_under_one_block_draws_what_the_two_level_search_draws(vocab, monkeypatch):
    """Below one block (256 tokens) only the inner search runs; with blocks of 2 tokens the
    two-level search runs on the same rows and uniforms and must draw the same tokens (masses
    are multiples of 2^-20, so every float64 sum is exact on any CPU). Zero-mass tokens,
    invalid rows (all zero, infinite, negative) and uniforms at 0 and just below 1 included."""
    import smcspec.sampling.distributions as dist

    g = torch.Generator().manual_seed(vocab)
    probs = torch.randint(0, 1 << 20, (400, vocab), generator=g).float() / (1 << 20)
    probs[torch.rand(400, vocab, generator=g) < 0.4] = 0.0
    probs[0], probs[1, 0], probs[2, -1] = 0.0, float("inf"), -0.25
    u = torch.rand(400, 1, generator=g, dtype=torch.float64)
    u[3], u[4] = 0.0, 1 - 2**-53
    one, one_valid = dist.categorical_from_uniforms(probs, u)
    monkeypatch.setattr(dist, "_BLOCK", 2)
    two, two_valid = dist.categorical_from_uniforms(probs, u)
    assert torch.equal(one_valid, two_valid) and not one_valid[:3].any()
    assert torch.equal(one_valid[3:], probs[3:].sum(-1) > 0)
    assert torch.equal(one[one_valid], two[two_valid])
    assert (probs[one_valid].gather(-1, one[one_valid][:, None]) > 0).all()
