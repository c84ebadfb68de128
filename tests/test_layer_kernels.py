"""The kernels a decoder layer launches on each kernel set, counted from ``torch.profiler``
events (``benchmarks/layer_kernels.py``, ``benchmarks/kernel_count.py``), held at the counts
committed in ``docs/benchmarks/layer-kernels/tiny.jsonl``: a count that grows fails (one that
falls passes; remake the file, and the real-shape counts beside it, when one does).

The campaign's tiny Llama pair, bfloat16, SMC-SD N=8 K=8 and ``ar``; per layer of a draft step
over 8 rows, of the target's 72-row forward and of ``ar``'s forward, outside the layers, and
a whole round. The GEMMs stay 4 a layer on every set (the projections; cuBLAS calls on a
GPU), and the whole-layer set keeps within the issue's goal of 12 other kernels a layer. The
eager count is cheap; the compiled sets compile (the slow tier).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import layer_kernels  # noqa: E402
from kernel_count import instrumented  # noqa: E402

COMMITTED = {
    r["set"]: r for r in map(json.loads, (ROOT / "docs/benchmarks/layer-kernels/tiny.jsonl").open())
}
FORWARDS = ("draft_step", "target_forward", "ar_forward")
GOAL = 12  # small kernels a layer on the whole-layer set (the goal)


@pytest.fixture(scope="module")
def pair():
    return layer_kernels.pair("tiny")


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
def test_compiled_kernel_counts_do_not_grow(pair, name):
    row = _count(pair, name)
    _held(row, COMMITTED[name])
    if name == "layer":
        assert all(row[part]["layer"][1] <= GOAL for part in FORWARDS), row
