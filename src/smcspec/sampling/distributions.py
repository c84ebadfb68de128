"""Tempered next-token distributions and categorical sampling."""

from __future__ import annotations

import torch

from smcspec.errors import NumericalError

GREEDY_BELOW = 1e-30
"""A target temperature below this decodes greedily (``GenerationConfig.greedy``).
``softmax(l / T)`` of float32 logits is then a point mass on the most likely token (split
only between exactly tied logits), and SMC-SD's weights would be ``-inf`` for every other
drafted token: greedy decoding is that distribution in all but name."""

SMALL_TEMPERATURE = 1e-6
"""Below this, :func:`tempered_log_probs` shifts each row's maximum logit to 0 before
dividing, so that ``logits / temperature`` cannot overflow float32 (it would near 1e-35)."""


def tempered_log_probs(
    logits: torch.Tensor, temperature: float, check: bool = True
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` in float32, for any temperature >= 0.

    Below :data:`SMALL_TEMPERATURE` the logits are first shifted so that each row's
    maximum is 0 (``log_softmax`` is shift-invariant): the most likely tokens stay at 0
    and the rest fall towards, or to, ``-inf``. A temperature too small for float32
    (down to 0) gives the limit: the uniform distribution over the tied most likely tokens.

    Args:
        logits: ``[..., V]`` any float dtype.
        temperature: >= 0 (a Python float).
        check: raise on NaN logits (reads one value on the host). ``False`` inside a
            graph-captured round, which reports NaN through :func:`nan_rows` instead.
    Returns:
        float32 ``[..., V]`` log-probabilities.
    Raises:
        NumericalError: the logits contain NaN (a broken model or weight file).
    """
    logits = logits.float()
    if temperature >= SMALL_TEMPERATURE:
        out = torch.log_softmax(logits / temperature, dim=-1)
    else:
        shifted = logits - logits.amax(-1, keepdim=True)
        scaled = torch.where(shifted == 0, 0.0, shifted / temperature)  # 0 / 0 at temperature 0
        out = torch.log_softmax(scaled, dim=-1)
    # A NaN logit makes its row's normaliser NaN, hence every entry of the row: one column
    # is checked instead of the whole [..., V] (a pass over 37 MB per SMC-SD round at
    # N=8 K=8 on a 128k vocabulary); the full check runs only where that column is NaN.
    if check and torch.isnan(out[..., :1]).any() and torch.isnan(logits).any():
        raise NumericalError("the model produced NaN logits")
    return out


def nan_rows(log_probs: torch.Tensor) -> torch.Tensor:
    """bool ``[...]``: the rows of ``log_probs`` ``[..., V]`` (from :func:`tempered_log_probs`)
    that came from NaN logits (a NaN logit makes its whole row NaN). No host read."""
    return torch.isnan(log_probs[..., 0])


def point_mass_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    """The greedy limit (temperature -> 0) of ``log_probs`` ``[..., V]``: 0 at each row's most
    likely token (the first on ties, as ``torch.argmax``), ``-inf`` elsewhere (float32).

    Apply it after truncation and masking, so that greedy decoding picks the most likely
    token the filters and the constraint allow.
    """
    out = torch.full_like(log_probs, -torch.inf)
    return out.scatter_(-1, log_probs.argmax(-1, keepdim=True), 0.0)


def step_log_probs(logits: torch.Tensor, temperature: float, check: bool = True) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` (float32 ``[..., V]``); a greedy temperature
    (below :data:`GREEDY_BELOW`, 0 included) gives the untempered ``log_softmax(logits)``, to
    be turned into a point mass by :func:`point_mass_log_probs` once filters and masks are
    applied (so that the mask picks among all tokens, not only the tempered top one).
    ``check``: as in :func:`tempered_log_probs`."""
    t = temperature if temperature >= GREEDY_BELOW else 1.0
    return tempered_log_probs(logits, t, check)


_BLOCK = 256  # tokens per block of the two-level inverse-CDF sampler


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one index per row from ``probs`` ``[..., V]`` (need not be normalised).

    One float64 uniform per row from ``generator`` (:func:`draw_uniforms`), then
    :func:`categorical_from_uniforms`. A token of zero mass is never drawn.

    Returns int64 ``[...]``. Raises :class:`NumericalError` if a row has no finite positive
    mass (or a negative entry).
    """
    rows = probs.numel() // probs.shape[-1]
    u = draw_uniforms(rows, generator, probs.device)
    idx, valid = categorical_from_uniforms(probs, u)
    if not bool(valid.all()):
        raise NumericalError("cannot sample from a distribution with no finite positive mass")
    return idx


def draw_uniforms(
    rows: int, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """float64 ``[rows, 1]`` uniforms in [0, 1): what :func:`sample_categorical` draws for
    ``rows`` rows (on a CPU generator, ``k`` calls of ``rows`` equal one of ``k * rows``)."""
    return torch.rand(rows, 1, generator=generator, dtype=torch.float64, device=device)


def categorical_from_uniforms(
    probs: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling of ``probs`` ``[..., V]`` (need not be normalised) with the given
    uniforms: pure tensor work, no host read (what a graph-captured round runs).

    Two levels keep the sequential prefix sums short: the row is cut into blocks of 256
    tokens, a block is chosen from the float64 cumulative block masses, then a token inside
    it from that block's cumulative masses. (``torch.multinomial`` draws one exponential
    variate per vocabulary entry, which on CPU costs about 3 ms per 150k-token row; this
    costs a few passes over the row.)

    Args:
        probs: float ``[..., V]``, non-negative.
        u: float64 ``[R, 1]`` uniforms in [0, 1), ``R`` the number of rows of ``probs``.
    Returns:
        ``(idx, valid)``: int64 ``[...]`` the drawn indices (a token of zero mass is never
        drawn from a valid row) and bool ``[...]``, False for a row with no finite positive
        mass or a negative entry (its index is then meaningless).
    """
    v = probs.shape[-1]
    flat = probs.reshape(-1, v)
    r = flat.shape[0]
    nb = v // _BLOCK
    if nb == 0:  # one block: the same draws as below, with half the kernels (tiny models)
        idx, valid = _one_block(flat, u.reshape(r, 1))
        return idx.view(probs.shape[:-1]), valid.view(probs.shape[:-1])
    block_mass = flat[:, : nb * _BLOCK].reshape(r, nb, _BLOCK).sum(-1, dtype=torch.float64)
    if nb * _BLOCK < v:
        tail = flat[:, nb * _BLOCK :].sum(-1, keepdim=True, dtype=torch.float64)
        block_mass = torch.cat((block_mass, tail), dim=-1)
    cdf = block_mass.cumsum(-1)  # [R, blocks]
    total = cdf[:, -1:]
    valid = torch.isfinite(total[:, 0]) & (total[:, 0] > 0) & ~(flat < 0).any(-1)
    u = u.reshape(r, 1) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total
    blk = torch.searchsorted(cdf, u, right=True)  # first block with cdf > u: positive mass
    blk = blk.clamp(max=cdf.shape[-1] - 1)  # an invalid row may overrun; valid ones cannot
    below = torch.where(blk > 0, cdf.gather(-1, (blk - 1).clamp(min=0)), 0.0)
    idx = blk * _BLOCK + torch.arange(_BLOCK, device=flat.device)  # [R, BLOCK]
    inner = torch.where(idx < v, flat.gather(-1, idx.clamp(max=v - 1)), 0).double().cumsum(-1)
    # rounding can put u - below at or past the block's own sum: keep it strictly inside
    rest = torch.minimum((u - below).clamp(min=0.0), torch.nextafter(inner[:, -1:], below * 0))
    j = torch.searchsorted(inner, rest, right=True)  # first token with cumulative mass > rest
    out = (blk * _BLOCK + j).clamp(max=v - 1)
    return out.view(probs.shape[:-1]), valid.view(probs.shape[:-1])


def _one_block(flat: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`categorical_from_uniforms` of ``flat`` ``[R, V]`` with ``V`` below one block
    (``u`` float64 ``[R, 1]``): the inner search alone, on the same float64 sums, so each
    row draws the token the two-level search draws."""
    v = flat.shape[-1]
    total = flat.sum(-1, keepdim=True, dtype=torch.float64)
    valid = torch.isfinite(total[:, 0]) & (total[:, 0] > 0) & ~(flat < 0).any(-1)
    zero = torch.zeros_like(total)
    u = torch.minimum(u * total, torch.nextafter(total, zero))  # u < total
    cdf = flat.double().cumsum(-1)
    rest = torch.minimum(u.clamp(min=0.0), torch.nextafter(cdf[:, -1:], zero))
    j = torch.searchsorted(cdf, rest, right=True)  # first token with cumulative mass > rest
    return j.clamp(max=v - 1), valid
