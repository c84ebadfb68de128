"""Measured forward costs and the roofline prediction of SMC-SD's speed-up.

From ``docs/smc-sd.md`` ("Cost, and how N and K are chosen"): one SMC-SD round costs K draft
forwards over N rows (the first with 2 tokens per row: deferred bonus) plus one target
forward over N(K+1) tokens, and yields K+1 tokens; autoregressive decoding costs one target
forward per token. In the memory-bound regime the speed-up is ``(K+1) / ((K+1) c + 1)``
with ``c`` the draft/target cost ratio of single-token forwards.
"""

from __future__ import annotations

import statistics
import time

import torch

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


def static_forward_seconds(
    model: DecoderModel, rows: int, tokens: int, reps: int = 10, context: int = 128
) -> float:
    """Median wall seconds of one forward of ``rows x tokens`` as a fused round runs it: the
    static-cache forward (``decode_static``) after a ``context``-token prompt, run through
    ``model.run_round`` (a replayed CUDA graph in ``graphs`` mode; the first, untimed call
    captures it), the device synchronised before and after each. Logits of the last
    position only when ``tokens <= 2``, as the decoders ask. Needs a torch model whose
    ``round_mode`` is not ``steps``.

    Raises:
        ValueError: the model has no static caches (llamacpp, or ``steps`` mode).
    """
    cache = model.new_cache(rows, tokens, static=True, prompt_len=context)
    if getattr(cache, "graphs", None) is None:
        cache.close()
        raise ValueError("static forward costs need a torch model whose rounds are not 'steps'")
    try:
        model.prefill((torch.arange(context, device=model.device) + 1000) % model.vocab_size, cache)
        span = cache.capacity
        inputs = {
            "tokens": torch.full((rows, tokens), 500 % model.vocab_size, device=model.device),
            "start": torch.zeros((), dtype=torch.long, device=model.device),
        }

        def fn(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            logits = model.decode_static(x["tokens"], cache, x["start"], span, tokens <= 2)
            return {"first": logits[..., :1]}

        key = ("forward-cost", rows, tokens, span, cache.prompt_window)
        times = []
        for i in range(reps + 1):
            _sync(model)
            t0 = time.perf_counter()
            model.run_round(cache, key, fn, inputs)
            _sync(model)
            if i:  # the first call captures
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        cache.close()


def _sync(model: DecoderModel) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def static_forward_costs(
    target: DecoderModel, draft: DecoderModel, n: int, k: int
) -> dict[str, float]:
    """:func:`smc_forward_costs` measured with :func:`static_forward_seconds` (the forwards
    of fused rounds: graph replays on CUDA)."""
    return {
        "target_1x1": static_forward_seconds(target, 1, 1),
        "draft_1x1": static_forward_seconds(draft, 1, 1),
        f"target_{n}x{k + 1}": static_forward_seconds(target, n, k + 1),
        f"draft_{n}x1": static_forward_seconds(draft, n, 1),
        f"draft_{n}x2": static_forward_seconds(draft, n, 2),
    }


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of weights one forward reads: every parameter once, except an input embedding
    that the output layer does not share (a forward reads only its tokens' rows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    if embed is not None and head is not None and head.weight is not embed.weight:
        total -= embed.weight.numel() * embed.weight.element_size()
    return total


def physics_bound(
    target_bytes: int, draft_bytes: int, n: int, k: int, bandwidth: float
) -> dict[str, float]:
    """Tokens/s if every forward only read its weights at ``bandwidth`` bytes/s: ``ar`` (one
    target read a token) and an SMC-SD round (K draft reads and one target read for K+1
    tokens; ``n`` does not enter: the bound ignores KV caches and logits). ``docs/smc-sd.md``,
    "the roofline model"."""
    ar = bandwidth / target_bytes
    smc = (k + 1) * bandwidth / (k * draft_bytes + target_bytes)
    return {"ar_bound_tps": ar, "smc_bound_tps": smc, "bound_speedup": smc / ar}
