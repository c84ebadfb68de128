"""SMC-SD's statistics (:mod:`smcspec.decoding.decoder_stats`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smcspec.decoding.decoder_stats import Metrics, with_optional


@dataclass(slots=True)
class SmcStats:
    """SMC-SD with ``particles`` N and ``draft_tokens`` K (see
    :func:`smcspec.decoding.smc.program.smc_program` for each field): ``rounds``, ``resamples``,
    ``mean_ess`` and ``min_ess`` over rounds (before resampling), ``degenerate_rounds``,
    ``degenerate_weights``, ``mean_round_ess``, ``banked`` particles and their
    ``banked_mass``, with a constraint or reward ``log_normalizer`` and ``dead_particles``,
    ``constraint_seconds``, and the rows each model computed over the rows it was fed
    (``distinct_rows_target``, ``distinct_rows_draft``); ``mean_round_tokens``, the tokens a
    running particle gained a round; with ``round_end="ess"`` ``cut_rounds``, the rounds cut
    before their K-th drafted token; ``stopped_early`` where ``stop_epsilon`` ended the
    request before every particle had."""

    particles: int
    draft_tokens: int
    rounds: int
    resamples: int
    mean_ess: float
    min_ess: float
    degenerate_weights: int
    degenerate_rounds: int
    mean_round_ess: float
    banked: int
    distinct_rows_target: float = 1.0
    distinct_rows_draft: float = 1.0
    banked_mass: float | None = None
    log_normalizer: float | None = None
    dead_particles: int | None = None
    constraint_seconds: float | None = None
    mean_round_tokens: float | None = None
    cut_rounds: int | None = None
    stopped_early: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        """The result's stats keys."""
        out = {
            "rounds": self.rounds,
            "resamples": self.resamples,
            "mean_ess": self.mean_ess,
            "min_ess": self.min_ess,
            "degenerate_weights": self.degenerate_weights,
            "degenerate_rounds": self.degenerate_rounds,
            "mean_round_ess": self.mean_round_ess,
            "banked": self.banked,
        }
        with_optional(
            out,
            banked_mass=self.banked_mass,
            log_normalizer=self.log_normalizer,
            dead_particles=self.dead_particles,
            constraint_seconds=self.constraint_seconds,
            mean_round_tokens=self.mean_round_tokens,
            cut_rounds=self.cut_rounds,
            stopped_early=self.stopped_early,
        )
        out["distinct_rows_target"] = self.distinct_rows_target
        out["distinct_rows_draft"] = self.distinct_rows_draft
        out["particles"] = self.particles
        out["draft_tokens"] = self.draft_tokens
        return out

    def describe(self) -> str:
        """N, K, rounds, resampling and ESS (and log Z with a potential)."""
        line = (
            f", N={self.particles} K={self.draft_tokens}, rounds {self.rounds}, "
            f"resamples {self.resamples}, mean ESS {self.mean_ess:.2f}, "
            f"min ESS {self.min_ess:.2f}, degenerate rounds {self.degenerate_rounds}"
        )
        if self.cut_rounds is not None:
            line += f", rounds cut {self.cut_rounds}, tokens a round {self.mean_round_tokens:.2f}"
        if self.log_normalizer is not None:  # a constraint or reward was set
            line += f", log Z {self.log_normalizer:.3f}, dead particles {self.dead_particles}"
        return line

    def observe(self, metrics: Metrics) -> None:
        """Count the rounds and resampling events; the request's mean ESS."""
        metrics.rounds.inc(self.rounds)
        metrics.resamples.inc(self.resamples)
        metrics.ess.observe(self.mean_ess)
