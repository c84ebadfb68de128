"""sd's statistics, chain, multi-draft and n-gram sd alike
(:mod:`smcspec.decoding.decoder_stats`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smcspec.decoding.decoder_stats import Metrics, with_optional


@dataclass(slots=True)
class SdStats:
    """Exact speculative decoding with ``draft_tokens`` K: ``rounds``, tokens ``drafted`` and
    ``accepted``; ``ngram``: drafts from the text (:mod:`smcspec.decoding.sd.ngram`), whose
    gate cut or kept ``gated_rounds`` rounds from drafting (None: no gate);
    ``constraint_seconds`` as :class:`~smcspec.decoding.ar.stats.ArStats`. Multi-draft sd
    (:meth:`multi_draft`) also counts ``chains`` N, and per depth the rounds that reached it
    and accepted a token there; its ``drafted`` counts K a round (the depth offered), so that
    the acceptance rate compares with chain sd's."""

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
        examined over all rounds (:mod:`smcspec.decoding.sd.multi_sd`)."""
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
        return with_optional(
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
