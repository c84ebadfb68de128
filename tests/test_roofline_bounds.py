"""The physics bounds the GPU campaign prints beside its figures (smcspec.eval.roofline)."""

from __future__ import annotations

import pytest

from smcspec.eval.roofline import batch_bound, physics_bound

# Llama-3.1-8B / 3.2-1B in bf16 on an H200: 4.8 TB/s, 989 TFLOP/s dense bf16
WEIGHTS = (15.0e9, 2.5e9)  # bytes read per forward (the 1B's tied embedding read once)
PARAMS = (8.0e9, 1.24e9)
H200 = dict(bandwidth=4.8e12, flops=989e12)


def test_at_batch_1_the_weights_set_the_bound():
    one = batch_bound(WEIGHTS, PARAMS, 8, 8, 1, **H200)
    mem = physics_bound(*WEIGHTS, 8, 8, H200["bandwidth"])
    assert one == pytest.approx(mem)


def test_many_requests_make_smc_compute_bound_n_times_sooner():
    """32 requests: ``ar`` still reads weights (32 rows), SMC-SD N=8 K=8 computes 2,304
    target rows a round: its bound falls below ``ar``'s; N=2 keeps it above."""
    ar_only = batch_bound(WEIGHTS, PARAMS, 8, 8, 32, **H200)
    assert ar_only["ar_bound_tps"] == pytest.approx(32 * 4.8e12 / 15.0e9)
    target_s = 2 * 8.0e9 * 32 * 8 * 9 / 989e12  # compute-bound target forward
    draft_s = max(2.5e9 / 4.8e12, 2 * 1.24e9 * 32 * 8 / 989e12)
    assert ar_only["smc_bound_tps"] == pytest.approx(32 * 9 / (8 * draft_s + target_s))
    assert ar_only["bound_speedup"] < 1
    by_n = {n: batch_bound(WEIGHTS, PARAMS, n, 8, 32, **H200)["bound_speedup"] for n in (2, 4, 8)}
    assert by_n[2] > by_n[4] > by_n[8] and by_n[2] > 1.5


def test_a_forward_multiplies_by_every_parameter_but_an_untied_embedding():
    from enumerable import tiny_transformer

    from smcspec.eval.roofline import weight_params

    model = tiny_transformer(seed=1, vocab=8)
    every = sum(p.numel() for p in model.parameters())
    tied = model.lm_head.weight is model.embed.weight
    assert weight_params(model) == every - (0 if tied else model.embed.weight.numel())
    assert weight_params(model) < every or tied
