"""The kernels a decoder layer launches on each kernel set, counted from ``torch.profiler``
events (``benchmarks/layer_kernels.py``, ``benchmarks/kernel_count.py``), held at the counts
committed in ``docs/benchmarks/layer-kernels/tiny.jsonl``: a count that grows fails (one that
falls passes; remake the file, and the real-shape counts beside it, when one does).

The campaign's tiny Llama pair, bfloat16, SMC-SD N=8 K=8 and ``ar``; per layer of a draft step
over 8 rows, of the target's 72-row forward and of ``ar``'s forward, outside the layers, and
a whole round. The GEMMs stay 4 a layer on every set (the projections; cuBLAS calls on a
GPU), and the whole-layer set keeps within the issue's goal of 12 other kernels a layer. The
eager count is cheap; the compiled sets compile (the slow tier), and the forwards they compiled
are then checked in bfloat16 against the float32 logits (no shape compiles only for that).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import layer_kernels  # noqa: E402
from gpu_campaign import TINY, torch_model  # noqa: E402
from kernel_count import instrumented  # noqa: E402

from smcspec.backends.torch.graphs import HostReadGuard  # noqa: E402
from smcspec.decoding import decode_smc  # noqa: E402

COMMITTED = {
    r["set"]: r for r in map(json.loads, (ROOT / "docs/benchmarks/layer-kernels/tiny.jsonl").open())
}
FORWARDS = ("draft_step", "target_forward", "ar_forward")
GOAL = 12  # small kernels a layer on the whole-layer set (the goal)


@pytest.fixture(scope="module")
def pair():
    return layer_kernels.pair("tiny")


def _first_verify_call(target, draft) -> dict:
    """The calls that make the target's first static forward in the counted SMC-SD request
    (its cache, its prompt's prefill and that forward: N rows of K+1 tokens), recorded from
    the request on the written kernels with the count run's seed, so that a replay
    (:func:`_replay`) runs the shapes the count compiled, on the same tokens."""
    ids, smc, _ = layer_kernels.requests(8, 8, 32)
    calls: dict = {}

    def recording(name: str):
        method = getattr(target, name)

        def run(*args, **kwargs):
            if name not in calls and (name != "new_cache" or kwargs.get("static")):
                kept = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
                calls[name] = (kept, {k: v for k, v in kwargs.items() if k != "lease"})
            return method(*args, **kwargs)

        return run

    for name in ("new_cache", "prefill", "decode_static"):
        setattr(target, name, recording(name))
    for m in (target, draft):
        m.rounds = "eager"
    try:
        with torch.inference_mode():
            decode_smc(target, draft, ids, smc, frozenset(), 512, torch.Generator().manual_seed(1))
    finally:
        for name in ("new_cache", "prefill", "decode_static"):
            delattr(target, name)
    return calls


def _replay(model, calls: dict) -> torch.Tensor:
    """``model``'s float32 logits for the recorded first static forward
    (:func:`_first_verify_call`)."""
    (rows, capacity), kwargs = calls["new_cache"]
    cache = model.new_cache(rows, capacity, **kwargs)
    (prompt, _, *more), pkw = calls["prefill"]
    (tokens, _, start, *rest), dkw = calls["decode_static"]
    try:
        with torch.inference_mode():
            model.prefill(prompt, cache, *more, **pkw)
            with HostReadGuard():
                out = model.decode_static(tokens, cache, start, *rest, **dkw)
            return out.float()
    finally:
        cache.close()


@pytest.fixture(scope="module")
def written_logits(pair):
    """The recorded first verify forward, and its logits on the written kernels: the bfloat16
    target's, and those of a float32 copy of its weights (the exact ones)."""
    target, draft = pair
    calls = _first_verify_call(target, draft)
    assert calls["decode_static"][0][0].shape == (8, 9), calls["decode_static"]
    exact_model = torch_model(TINY["llama"][0], "cpu", torch.float32, seed=1)
    exact_model.load_state_dict({k: v.float() for k, v in target.state_dict().items()})
    exact_model.rounds = "eager"
    return calls, _replay(exact_model, calls), _replay(target, calls)


def _within_bf16_tolerance(pair, written_logits, name: str) -> None:
    """The bfloat16 target's first verify forward on set ``name`` is as close to the float32
    logits as the written kernels in bfloat16 are (its largest error at most 1.5 times
    theirs) and within 2% of the largest logit of theirs (bf16 keeps 8 bits, and the sets
    round elsewhere: the flex kernel keeps its scores in float32, Inductor fuses casts away).
    Measured on 2026-12-07: largest errors 0.0033 (compiled), 0.0034 (flex), 0.0029 (layer)
    against the written kernels' 0.0029, each set 0.0039 from the written kernels (one
    bfloat16 step at these logits, the largest 0.74)."""
    target, _ = pair
    calls, exact, want = written_logits
    target.use_kernels(name)
    try:
        got = _replay(target, calls)
    finally:
        target.use_kernels("auto")
    assert (got - exact).abs().max() <= 1.5 * (want - exact).abs().max(), name
    assert (got - want).abs().max() <= 0.02 * exact.abs().max(), name


def _count(pair, name: str) -> dict:
    target, draft = pair
    with instrumented():
        row = layer_kernels.count_set(target, draft, name, 8, 8, 32)
    for m in pair:
        m.use_kernels("auto")
    return row


def _held(row: dict, want: dict) -> None:
    for part in FORWARDS:
        assert row[part]["layer"][0] == 4, part  # the four projections
        assert row[part]["layer"][1] <= want[part]["layer"][1], (part, row[part])
        assert row[part]["outside"][1] <= want[part]["outside"][1], (part, row[part])
    assert row["smc_round"][1] <= want["smc_round"][1], row["smc_round"]
    assert row["ar_round"][1] <= want["ar_round"][1], row["ar_round"]


def test_eager_kernel_counts_do_not_grow(pair):
    """The written kernels: 31-35 small kernels a layer. Fails with one more copy in a
    layer (a ``clone()`` of the attention's output, tried: 33 > 32)."""
    _held(_count(pair, "eager"), COMMITTED["eager"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["compiled", "flex", "layer"])
def test_compiled_kernel_counts_do_not_grow(pair, written_logits, name):
    """Each compiled set's counts held, then its bfloat16 logits within their tolerance
    (:func:`_within_bf16_tolerance`) on the forwards the count compiled."""
    row = _count(pair, name)
    _held(row, COMMITTED[name])
    if name == "layer":
        assert all(row[part]["layer"][1] <= GOAL for part in FORWARDS), row
    _within_bf16_tolerance(pair, written_logits, name)
