"""Measured forward costs and the roofline prediction of SMC-SD's speed-up.

From ``docs/smc-sd.md`` ("Cost, and how N and K are chosen"): one SMC-SD round costs K draft
forwards over N rows (the first with 2 tokens per row: deferred bonus) plus one target
forward over N(K+1) tokens, and yields K+1 tokens; autoregressive decoding costs one target
forward per token. In the memory-bound regime the speed-up is ``(K+1) / ((K+1) c + 1)``
with ``c`` the draft/target cost ratio of single-token forwards.
"""

from __future__ import annotations

from smcspec.backends.base import DecoderModel
from smcspec.tuning.measure import forward_seconds_by_tokens


def forward_seconds(
    model: DecoderModel, rows: int, tokens: int, reps: int = 5, context: int = 100
) -> float:
    """Median wall seconds of one decode forward of ``rows x tokens`` after a ``context``-token
    prompt (logits of the last position only when ``tokens <= 2``, as the decoders ask)."""
    return forward_seconds_by_tokens(model, rows, [tokens], reps, context)[tokens]


def smc_forward_costs(
    target: DecoderModel, draft: DecoderModel, n: int, k: int
) -> dict[str, float]:
    """Median seconds of the forwards of one AR step and one SMC-SD round at (N, K)."""
    return {
        "target_1x1": forward_seconds(target, 1, 1),
        "draft_1x1": forward_seconds(draft, 1, 1),
        f"target_{n}x{k + 1}": forward_seconds(target, n, k + 1),
        f"draft_{n}x1": forward_seconds(draft, n, 1),
        f"draft_{n}x2": forward_seconds(draft, n, 2),
    }


def predicted_speedup(costs: dict[str, float], n: int, k: int) -> dict[str, float]:
    """``c``, the memory-bound prediction, and the prediction from the measured N-row costs."""
    c = costs["draft_1x1"] / costs["target_1x1"]
    memory_bound = (k + 1) / ((k + 1) * c + 1)
    round_s = (k - 1) * costs[f"draft_{n}x1"] + costs[f"draft_{n}x2"] + costs[f"target_{n}x{k + 1}"]
    return {
        "c": c,
        "memory_bound": memory_bound,
        "measured_costs": (k + 1) * costs["target_1x1"] / round_s,
    }
