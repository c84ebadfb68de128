"""Weight normalisation, effective sample size and resampling schemes for SMC.

Every resampler maps log-weights ``[N]`` to ancestor indices ``[N]`` (int64) such that the
expected number of copies of particle ``i`` is ``N * w_i`` (unbiased). Schemes as in Douc,
Cappe & Moulines 2005, "Comparison of resampling schemes for particle filtering", and
Chopin & Papaspiliopoulos 2020, "An Introduction to Sequential Monte Carlo", ch. 9.

Weights are handled in log space and float64; an all ``-inf`` vector is treated as uniform
(:func:`normalized_weights` reports that through its second return value).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch


def normalized_weights(log_weights: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Normalised float64 weights ``[N]`` from log-weights ``[N]``.

    Returns ``(w, degenerate)``; ``degenerate`` is True when every weight is zero (all
    ``-inf`` or NaN), in which case ``w`` is uniform. NaN counts as zero weight; if some
    log-weights are ``+inf`` those particles share the whole weight equally. One host read
    (the flag); :func:`_weights` is the same without it.
    """
    w, degenerate = _weights(log_weights)
    return w, bool(degenerate)


def _weights(log_weights: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`normalized_weights` along ``dim`` of a batch of log-weight vectors, with the
    flags (bool, ``dim`` kept as 1) left on the device: no host read, so that the resamplers
    and the ESS wait for the device once at most."""
    lw = _clean(log_weights)
    top = lw.amax(dim, keepdim=True)
    e = torch.exp(lw - top)
    # NaN only where top is infinite: at the +inf particles (inf - inf; the others are 0),
    # which then share all the weight, or everywhere when every weight is zero: uniform
    w = torch.where(torch.isnan(e), 1.0, e)
    return w / w.sum(dim, keepdim=True), top == -math.inf


def group_normalized_weights(
    log_weights: torch.Tensor, group_ids: torch.Tensor, groups: int
) -> tuple[torch.Tensor, bool]:
    """Weights ``[M]`` (float64) that count ``groups`` groups of particles equally.

    Each group's log-weights are normalised within the group (:func:`normalized_weights`) and
    divided by the number of groups that hold any weight; a group whose weights are all zero
    gets none. This is the equal-weight combination of independent particle systems (the
    islands of Vergé, Dubarry, Del Moral & Moulines 2015): consistent as each group grows,
    and it does not weigh groups by their normalising-constant estimates, whose variance
    grows with the length of the output. With one group it is :func:`normalized_weights`.

    Args:
        log_weights: float ``[M]`` log-weights (NaN counts as zero weight).
        group_ids: int64 ``[M]``, each particle's group in ``[0, groups)``.
        groups: the number of groups G >= 1.

    Returns:
        ``(w, degenerate)``; ``degenerate`` is True when no group holds any weight, in which
        case ``w`` is uniform over all M particles.
    """
    w = torch.zeros(log_weights.shape, dtype=torch.float64, device=log_weights.device)
    live = 0
    for g in range(groups):
        in_g = group_ids == g
        if not bool(in_g.any()):
            continue
        wg, dead = normalized_weights(log_weights[in_g])
        if not dead:
            w[in_g] = wg
            live += 1
    if live == 0:
        return torch.full_like(w, 1.0 / w.numel()), True
    return w / live, False


def _clean(log_weights: torch.Tensor) -> torch.Tensor:
    """float64 log-weights with NaN (an undefined weight) treated as -inf (zero weight)."""
    inf = math.inf  # kept as they are (nan_to_num would make them finite)
    return torch.nan_to_num(log_weights.double(), nan=-inf, posinf=inf, neginf=-inf)


def batched_ess(log_weights: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``ESS = 1 / sum_i w_i^2`` of the normalised weights (Kong, Liu & Wong 1994) of every
    log-weight vector along ``dim`` of ``log_weights`` (any float dtype; NaN counts as zero
    weight, a vector of zero weights as uniform, ESS = its length, as
    :func:`normalized_weights`), without a host read. Returns float64, ``log_weights``'s
    shape without ``dim``; each value in ``[1, size of dim]``. The one ESS of the package:
    the decoders' (:func:`effective_sample_sizes`; a cut round's running ESS,
    :func:`smcspec.decoding.smc.cut.cut_position`) and the tuner's simulations
    (:mod:`smcspec.tuning.predict`)."""
    w, _ = _weights(log_weights, dim)
    return 1.0 / (w * w).sum(dim)


def effective_sample_sizes(log_weights: Sequence[torch.Tensor]) -> list[float]:
    """:func:`batched_ess` of each log-weight vector (e.g. each group's), read from the device
    at once."""
    return torch.stack([batched_ess(lw) for lw in log_weights]).tolist()


def log_mean_weight(log_weights: torch.Tensor) -> float:
    """``logsumexp(logw) - log N``: one factor of the SMC estimate of the log normaliser.

    NaN log-weights count as zero weight, as in :func:`normalized_weights`.
    """
    lw = _clean(log_weights)
    return float(torch.logsumexp(lw, 0) - math.log(lw.numel()))


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Indices ``i`` with ``cumsum(w)[i-1] <= u < cumsum(w)[i]``, clamped to ``N-1``."""
    cdf = torch.cumsum(w, 0)
    idx = torch.searchsorted(cdf, u, right=True)
    return idx.clamp_(max=w.numel() - 1)


def multinomial_resample(log_weights: torch.Tensor, generator=None) -> torch.Tensor:
    """N i.i.d. draws from the weights (sorted uniforms, inverse CDF)."""
    w, _ = _weights(log_weights)
    u = torch.rand(w.numel(), generator=generator, dtype=torch.float64, device=w.device)
    return _inverse_cdf(w, u.sort().values)


def stratified_resample(log_weights: torch.Tensor, generator=None) -> torch.Tensor:
    """One uniform in each stratum ``[i/N, (i+1)/N)``."""
    n = log_weights.numel()
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=log_weights.device)
    return strata_ancestors(log_weights, u)


def systematic_resample(log_weights: torch.Tensor, generator=None) -> torch.Tensor:
    """One uniform shared by all strata: ``u_i = (i + U) / N`` (the reference engine's scheme)."""
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=log_weights.device)
    return strata_ancestors(log_weights, u)


def strata_ancestors(log_weights: torch.Tensor, u: float | torch.Tensor) -> torch.Tensor:
    """Ancestors (int64 ``[N]``) of log-weights ``[N]`` at the points ``(i + u_i) / N``, one in
    each stratum ``[i/N, (i+1)/N)``, by the inverse CDF: ``u`` (in ``[0, 1)``) a float or
    float64 ``[1]`` shared by all strata (:func:`systematic_resample`) or float64 ``[N]``, one
    a stratum (:func:`stratified_resample`), drawn by the caller: the tuner's simulations draw
    it from their own seeded NumPy stream (:func:`smcspec.tuning.predict.predicted_distinct`)."""
    w, _ = _weights(log_weights)
    n = w.numel()
    return _inverse_cdf(w, (torch.arange(n, dtype=torch.float64, device=w.device) + u) / n)


def residual_resample(log_weights: torch.Tensor, generator=None) -> torch.Tensor:
    """``floor(N w_i)`` deterministic copies; the rest drawn multinomially from the residuals."""
    w, _ = _weights(log_weights)
    n = w.numel()
    counts = torch.floor(n * w).long()
    rest = n - int(counts.sum())
    idx = torch.repeat_interleave(torch.arange(n, device=w.device), counts)
    if rest > 0:
        resid = n * w - counts.double()
        resid = resid / resid.sum()
        u = torch.rand(rest, generator=generator, dtype=torch.float64, device=w.device)
        idx = torch.cat((idx, _inverse_cdf(resid, u.sort().values)))
    return idx


RESAMPLERS: dict[str, Callable[..., torch.Tensor]] = {
    "systematic": systematic_resample,
    "stratified": stratified_resample,
    "multinomial": multinomial_resample,
    "residual": residual_resample,
}
