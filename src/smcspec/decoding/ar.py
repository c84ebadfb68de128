"""Autoregressive sampling from the target: the baseline."""

from __future__ import annotations

import torch

from smcspec.config import GenerationConfig
from smcspec.decoding.common import DecodeOutput, TokenCallback, as_prompt_tensor
from smcspec.decoding.program import Forward, Prefill, Program, run_program
from smcspec.models.transformer import Transformer
from smcspec.sampling.distributions import sample_categorical, tempered_log_probs
from smcspec.sampling.truncation import truncate_log_probs


def ar_program(
    target: Transformer,
    prompt: list[int],
    cfg: GenerationConfig,
    stop_ids: frozenset[int],
    vocab: int,
    generator: torch.Generator,
    on_tokens: TokenCallback | None = None,
) -> Program:
    """Sample up to ``cfg.max_new_tokens`` tokens from ``softmax(logits / T_t)``, one per forward.

    With ``cfg.top_k`` / ``top_p`` / ``min_p`` set, each token is drawn from the truncated,
    renormalised distribution ``p~`` (:func:`~smcspec.sampling.truncation.truncate_log_probs`).

    Args:
        prompt: token ids. ``vocab``: number of token ids that may be sampled.
    Yields :class:`Prefill`/:class:`Forward` requests (see :mod:`smcspec.decoding.program`).

    Returns:
        :class:`DecodeOutput` with stats ``{"forwards": ...}``.
    """
    cache = target.new_cache(1, cfg.max_new_tokens + 1)
    logits = (yield Prefill(target, as_prompt_tensor(prompt, target.device), cache))[:vocab]
    out: list[int] = []
    while True:
        lp = tempered_log_probs(logits, cfg.temperature)
        probs = truncate_log_probs(lp, cfg.top_k, cfg.top_p, cfg.min_p).exp()
        tok = int(sample_categorical(probs, generator))
        out.append(tok)
        if on_tokens:
            on_tokens([tok])
        if tok in stop_ids or len(out) >= cfg.max_new_tokens:
            break
        step = torch.tensor([[tok]], device=target.device)
        logits = (yield Forward(target, step, cache, last_only=True))[0, -1, :vocab]
    return DecodeOutput(tokens=out, stats={"forwards": len(out)})


def decode_ar(*args, **kwargs) -> DecodeOutput:
    """Run :func:`ar_program` to completion on its own (same arguments)."""
    return run_program(ar_program(*args, **kwargs))
