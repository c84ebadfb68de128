"""Measured forward costs and the roofline prediction of SMC-SD's speed-up.

From ``docs/smc-sd.md`` ("Cost, and how N and K are chosen"): one SMC-SD round costs K draft
forwards over N rows (the first with 2 tokens per row: deferred bonus) plus one target
forward over N(K+1) tokens, and yields K+1 tokens; autoregressive decoding costs one target
forward per token. In the memory-bound regime the speed-up is ``(K+1) / ((K+1) c + 1)``
with ``c`` the draft/target cost ratio of single-token forwards.
"""

from __future__ import annotations

import statistics

import torch

from smcspec.backends.base import DecoderModel
from smcspec.decoding.registry import BASELINE, Decoder
from smcspec.decoding.rounds import RoundCosts
from smcspec.tuning.measure import forward_seconds_by_tokens, static_timings


def forward_seconds(
    model: DecoderModel, rows: int, tokens: int, reps: int = 5, context: int = 100
) -> float:
    """Median wall seconds of one decode forward of ``rows x tokens`` after a ``context``-token
    prompt (logits of the last position only when ``tokens <= 2``, as the decoders ask)."""
    return forward_seconds_by_tokens(model, rows, [tokens], reps, context)[tokens]


def smc_forward_costs(
    target: DecoderModel, draft: DecoderModel, n: int, k: int, decoder: Decoder
) -> dict[str, float]:
    """Median seconds of the forwards of one :data:`~smcspec.decoding.registry.BASELINE`
    (``ar``) step and one round of ``decoder`` (a row of the decoder table, SMC-SD's in
    practice) at (N, K) (the shapes its row gives, :mod:`smcspec.decoding.rounds`), keyed
    ``target_RxT`` / ``draft_RxT``; the draft's one-row forward too (the memory-bound bound's
    ``c``)."""
    return _forward_costs(forward_seconds, target, draft, n, k, decoder)


def _forward_costs(measure, target, draft, n: int, k: int, decoder: Decoder) -> dict[str, float]:
    t_shapes, d_shapes = _round_shapes(n, k, decoder)
    out = {f"target_{r}x{t}": measure(target, r, t) for r, t in t_shapes}
    out.update({f"draft_{r}x{t}": measure(draft, r, t) for r, t in d_shapes})
    return out


def _round_shapes(
    n: int, k: int, decoder: Decoder
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The target and draft shapes a baseline step and a round of ``decoder`` at (N, K)
    issue, plus the draft's one-row forward, in a fixed order."""
    ar_t, _ = BASELINE.shapes(1, 0)
    smc_t, smc_d = decoder.shapes(n, k)
    t_shapes = list(dict.fromkeys([*ar_t, *smc_t]))
    d_shapes = list(dict.fromkeys([(1, 1), *smc_d]))
    return t_shapes, d_shapes


def predicted_speedup(
    costs: dict[str, float], n: int, k: int, decoder: Decoder
) -> dict[str, float]:
    """``c``, the memory-bound prediction, and the prediction from the measured N-row costs
    (one round of ``decoder``, SMC-SD's in practice, against K+1
    :data:`~smcspec.decoding.registry.BASELINE` steps, each priced by its decoder's round,
    :mod:`smcspec.decoding.rounds`)."""
    c = costs["draft_1x1"] / costs["target_1x1"]
    memory_bound = (k + 1) / ((k + 1) * c + 1)
    maps: dict[str, dict[tuple[int, int], float]] = {"target": {}, "draft": {}}
    for key, seconds in costs.items():
        role, shape = key.split("_")
        rows, tokens = shape.split("x")
        maps[role][(int(rows), int(tokens))] = seconds
    priced = RoundCosts(maps["target"], maps["draft"])
    smc_tokens, smc_seconds = decoder.cost(n, k, priced)
    ar_tokens, ar_seconds = BASELINE.cost(1, 0, priced)
    speedup = (smc_tokens / smc_seconds) / (ar_tokens / ar_seconds)
    return {"c": c, "memory_bound": memory_bound, "measured_costs": speedup}


def static_forward_seconds(
    model: DecoderModel, rows: int, tokens: int, reps: int = 10, context: int = 128
) -> float:
    """Median wall seconds of one forward of ``rows x tokens`` as a fused round runs it
    (:func:`smcspec.tuning.measure.static_timings`: a replayed CUDA graph on CUDA). Needs a
    torch model whose ``round_mode`` is not ``steps``.

    Raises:
        ValueError: the model has no static caches (llamacpp, or ``steps`` mode).
    """
    return statistics.median(static_timings(model, rows, [tokens], reps, context)[tokens])


def static_forward_costs(
    target: DecoderModel, draft: DecoderModel, n: int, k: int, decoder: Decoder
) -> dict[str, float]:
    """:func:`smc_forward_costs` measured with :func:`static_forward_seconds` (the forwards
    of fused rounds: graph replays on CUDA)."""
    return _forward_costs(static_forward_seconds, target, draft, n, k, decoder)


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of weights one forward reads: every parameter once, except an input embedding
    that the output layer does not share (a forward reads only its tokens' rows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    if embed is not None and head is not None and head.weight is not embed.weight:
        total -= embed.weight.numel() * embed.weight.element_size()
    return total


def weight_params(model: torch.nn.Module) -> int:
    """Parameters one forward multiplies each token row by (2 FLOPs each): every parameter,
    except an input embedding that the output layer does not share (a lookup)."""
    total = sum(p.numel() for p in model.parameters())
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    if embed is not None and head is not None and head.weight is not embed.weight:
        total -= embed.weight.numel()
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


def batch_bound(
    weights: tuple[int, int],
    params: tuple[int, int],
    n: int,
    k: int,
    batch: int,
    bandwidth: float,
    flops: float,
) -> dict[str, float]:
    """Aggregate tokens/s of ``batch`` concurrent requests if every forward took the longer of
    reading its weights once (``weights``: target and draft bytes, at ``bandwidth``
    bytes/s) and computing its token rows (2 FLOPs per parameter per row, ``params``: target
    and draft parameters, at ``flops`` FLOP/s): ``ar`` (one target forward of ``batch`` rows
    per ``batch`` tokens) and an SMC-SD round at (N, K) (K draft forwards of ``batch * N``
    rows and one target forward of ``batch * N * (K+1)`` rows, every particle row computed,
    for ``batch * (K+1)`` tokens; the first draft step's deferred token, KV caches,
    attention and logits ignored). At batch 1 and small N the weights set both (as
    :func:`physics_bound`); with many requests the target's rows make SMC-SD compute-bound
    N times sooner than ``ar``. ``docs/smc-sd.md``, "the roofline model"."""
    (tb, db), (tp, dp) = weights, params

    def seconds(nbytes: int, nparams: int, rows: int) -> float:
        return max(nbytes / bandwidth, 2 * nparams * rows / flops)

    ar = batch / seconds(tb, tp, batch)
    rnd = k * seconds(db, dp, batch * n) + seconds(tb, tp, batch * n * (k + 1))
    smc = batch * (k + 1) / rnd
    return {"ar_bound_tps": ar, "smc_bound_tps": smc, "bound_speedup": smc / ar}
