"""Each decoder's statistics, typed: what it counts, its JSON keys, its stats line, its metrics.

A program returns one of these in :attr:`DecodeOutput.stats
<smcspec.decoding.output.DecodeOutput.stats>`; the engine turns it into the result's JSON
(:meth:`to_dict`, the keys results and clients have always read), the CLI prints
:meth:`describe`, and the server's ``/metrics`` counts it with :meth:`observe`. Which of them
a request gets follows the decoder that ran it (greedy ``smc`` runs as ``sd`` and reports
:class:`SdStats`), never a name compared elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class Metrics(Protocol):
    """What :meth:`Stats.observe` counts into (:class:`smcspec.metrics.ServerMetrics`)."""

    rounds: Any
    resamples: Any
    ess: Any
    drafted: Any
    accepted: Any


def _with_optional(out: dict[str, Any], **optional: Any) -> dict[str, Any]:
    """``out`` plus each optional entry that is set (not None)."""
    out.update({k: v for k, v in optional.items() if v is not None})
    return out


@dataclass(slots=True)
class ArStats:
    """Autoregressive decoding: ``forwards`` target forwards (one a token);
    ``constraint_seconds``: wall seconds in the constraint's masks and matchers (None: no
    constraint)."""

    forwards: int
    constraint_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The result's stats keys."""
        return _with_optional(
            {"forwards": self.forwards}, constraint_seconds=self.constraint_seconds
        )

    def describe(self) -> str:
        """The decoder's part of the CLI's stats line (``ar`` adds nothing)."""
        return ""

    def observe(self, metrics: Metrics) -> None:
        """Count into the server's metrics (``ar`` has no counters of its own)."""


@dataclass(slots=True)
class SdStats:
    """Exact speculative decoding with ``draft_tokens`` K: ``rounds``, tokens ``drafted`` and
    ``accepted``; ``ngram``: drafts from the text (:mod:`smcspec.decoding.sd.ngram`), whose gate
    cut or kept ``gated_rounds`` rounds from drafting (None: no gate); ``constraint_seconds``
    as :class:`ArStats`. Multi-draft sd (:meth:`multi_draft`) also counts ``chains`` N, and
    per depth the rounds that reached it and accepted a token there; its ``drafted`` counts
    K a round (the depth offered), so that the acceptance rate compares with chain sd's."""

    draft_tokens: int
    rounds: int
    drafted: int
    accepted: int
    ngram: bool = False
    gated_rounds: int | None = None
    constraint_seconds: float | None = None
    chains: int | None = None
    depth_reached: list[int] | None = None
    depth_accepted: list[int] | None = None
    candidates: int | None = None

    @classmethod
    def multi_draft(cls, chains: int, draft_tokens: int) -> SdStats:
        """Empty stats of multi-draft sd with ``chains`` N: per depth ``j`` (0-based) the
        rounds that reached it and those that accepted a token there, and the candidates
        examined over all rounds (:mod:`smcspec.decoding.sd.multi_draft`)."""
        zeros = [0] * draft_tokens
        return cls(draft_tokens, 0, 0, 0, chains=chains, depth_reached=zeros,
                   depth_accepted=list(zeros), candidates=0)  # fmt: skip

    @property
    def acceptance_by_depth(self) -> list[float] | None:
        """Multi-draft sd: per depth, the share of the rounds that reached it which accepted
        a token there (0.0 where none reached it); None for chain sd."""
        if self.depth_reached is None or self.depth_accepted is None:
            return None
        return [a / r if r else 0.0 for a, r in zip(self.depth_accepted, self.depth_reached,
                                                     strict=True)]  # fmt: skip

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0.0 with nothing drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """``1 + accepted / rounds``, as vLLM defines it (0.0 with no round)."""
        return 1 + self.accepted / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The result's stats keys."""
        out = {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }
        if self.ngram:
            out["draft"] = "ngram"
        if self.chains is not None:
            out["particles"] = self.chains
            out["acceptance_by_depth"] = self.acceptance_by_depth
            out["candidates_per_round"] = self.candidates / self.rounds if self.rounds else 0.0
        return _with_optional(
            out,
            gated_rounds=self.gated_rounds,
            constraint_seconds=self.constraint_seconds,
            draft_tokens=self.draft_tokens,
        )

    def describe(self) -> str:
        """K, the rounds, the acceptance rate and mean accepted length (and the gate's)."""
        chains = f"N={self.chains} drafts " if self.chains is not None else ""
        line = (
            f", {chains}K={self.draft_tokens}{', n-gram drafts' if self.ngram else ''}, rounds "
            f"{self.rounds}, acceptance rate {self.acceptance_rate:.3f}, mean accepted length "
            f"{self.mean_accepted_length:.2f}"
        )
        if self.gated_rounds is not None:
            line += f", rounds the gate cut or kept from drafting {self.gated_rounds}"
        return line

    def observe(self, metrics: Metrics) -> None:
        """Count the drafted and accepted tokens."""
        metrics.drafted.inc(self.drafted)
        metrics.accepted.inc(self.accepted)


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
        _with_optional(
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


Stats = ArStats | SdStats | SmcStats
