"""Tempered next-token distributions and categorical sampling."""

from __future__ import annotations

import torch

from smcspec.errors import NumericalError


def tempered_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` in float32.

    Args:
        logits: ``[..., V]`` any float dtype.
        temperature: > 0.
    Returns:
        float32 ``[..., V]`` log-probabilities.
    Raises:
        NumericalError: the logits contain NaN (a broken model or weight file).
    """
    logits = logits.float()
    if torch.isnan(logits).any():
        raise NumericalError("the model produced NaN logits")
    return torch.log_softmax(logits / temperature, dim=-1)


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one index per row from ``probs`` ``[..., V]`` (need not be normalised).

    Returns int64 ``[...]``. Raises :class:`NumericalError` if a row has no positive mass.
    """
    flat = probs.reshape(-1, probs.shape[-1]).float()
    total = flat.sum(-1)
    if not bool(torch.isfinite(total).all() and (total > 0).all()):
        raise NumericalError("cannot sample from a distribution with no finite positive mass")
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.view(probs.shape[:-1])
