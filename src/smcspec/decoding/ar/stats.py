"""``ar``'s statistics (:mod:`smcspec.decoding.decoder_stats`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smcspec.decoding.decoder_stats import Metrics, with_optional


@dataclass(slots=True)
class ArStats:
    """Autoregressive decoding: ``forwards`` target forwards (one a token);
    ``constraint_seconds``: wall seconds in the constraint's masks and matchers (None: no
    constraint)."""

    forwards: int
    constraint_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The result's stats keys."""
        return with_optional(
            {"forwards": self.forwards}, constraint_seconds=self.constraint_seconds
        )

    def describe(self) -> str:
        """The decoder's part of the CLI's stats line (``ar`` adds nothing)."""
        return ""

    def observe(self, metrics: Metrics) -> None:
        """Count into the server's metrics (``ar`` has no counters of its own)."""
