"""Each decoder's statistics, typed: what it counts, its JSON keys, its stats line, its metrics.

A program returns one in :attr:`DecodeOutput.stats
<smcspec.decoding.output.DecodeOutput.stats>`; the engine turns it into the result's JSON
(:meth:`Stats.to_dict`, the keys results and clients have always read), the CLI prints
:meth:`Stats.describe`, and the server's ``/metrics`` counts it with :meth:`Stats.observe`.
Each decoder's class lies beside its program (:class:`~smcspec.decoding.ar.stats.ArStats`,
:class:`~smcspec.decoding.sd.stats.SdStats`, :class:`~smcspec.decoding.smc.stats.SmcStats`),
and the decoder table's row names it (:attr:`~smcspec.decoding.registry.Decoder.stats_class`).
Which of them a request gets follows the decoder that ran it (greedy ``smc`` runs as ``sd``
and reports ``SdStats``), never a name compared elsewhere. This module holds what they share.
"""

from __future__ import annotations

from typing import Any, Protocol


class Metrics(Protocol):
    """What :meth:`Stats.observe` counts into (:class:`smcspec.metrics.ServerMetrics`)."""

    rounds: Any
    resamples: Any
    ess: Any
    drafted: Any
    accepted: Any


class Stats(Protocol):
    """What every decoder's stats class provides (the engine, the CLI and the server read
    a request's stats only through these)."""

    def to_dict(self) -> dict[str, Any]:
        """The result's stats keys (JSON values)."""
        ...

    def describe(self) -> str:
        """The decoder's part of the CLI's stats line (``""``: nothing to add)."""
        ...

    def observe(self, metrics: Metrics) -> None:
        """Count into the server's metrics."""
        ...


def with_optional(out: dict[str, Any], **optional: Any) -> dict[str, Any]:
    """``out`` plus each optional entry that is set (not None)."""
    out.update({k: v for k, v in optional.items() if v is not None})
    return out
