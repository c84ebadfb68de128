"""Which settings the tuner predicts, and how their forward costs are measured."""

from __future__ import annotations

from dataclasses import dataclass

from smcspec.config import GenerationConfig
from smcspec.decoding.registry import DECODERS
from smcspec.tuning.multi_draft import MAX_CHAINS
from smcspec.tuning.predict import Setting, Shape

CPU_MAX_FORWARD_TOKENS = 80
"""On a CPU the largest target forward measured, N x (K+1) tokens: up to N=16 at K=4 and N=8
at K=8 (16 x 9 alone would take about 10 s to measure on a 2-core CPU, where batched rows
cost nearly what separate ones do; with distinct rows a forward computes about half of
them, so N=16 K=4 can be a candidate)."""

GPU_MAX_FORWARD_TOKENS = 1024
GPU_DRAFT_TOKENS = (2, 4, 8, 12, 16, 32)
"""K values a GPU measures: long drafts were its fastest SMC-SD settings on an H200 (N=8 K=32
1.97x `ar`, docs/benchmarks/gpu-h200-graphs/); the fidelity floor decides whether a pair can
afford them (the default pair's predicted ESS falls below 4 from K = 8 at N <= 16)."""

NGRAM_DRAFT_TOKENS = GenerationConfig().draft_tokens
"""K of the n-gram sd setting the tuner predicts: the default ``draft_tokens`` (4, the n-gram
benchmarks' K, ``docs/benchmarks/ngram-cpu/``)."""


@dataclass(frozen=True)
class TuningGrid:
    """The settings to predict and the measurement budget.

    Attributes:
        draft_tokens: K values of sd and smc.
        particles: N values of smc (``min_particles`` and an explicit N are added).
        chains: N values of multi-draft sd (exact: no floor; an explicit N replaces them;
            at most :data:`~smcspec.tuning.multi_draft.MAX_CHAINS`).
        cut_rounds: also predict every smc setting with rounds cut where the ESS falls
            (``smc-nN-kK-ess``).
        max_forward_tokens: smc settings whose target forward has more than this many
            tokens (N x (K+1)) are not measured, except at the smallest allowed N.
        context: prompt tokens before the timed forwards (attention length).
        reps: timed forwards per shape (the median is kept; one untimed warm-up forward
            after each row count's prefill: :mod:`smcspec.tuning.measure`).
        acceptance_tokens: new tokens of the sd runs that measure alpha, in all (split
            between :data:`~smcspec.tuning.measure.ACCEPTANCE_PROMPTS`).
        acceptance_draft_tokens: K of that run.
    """

    draft_tokens: tuple[int, ...] = (2, 4, 8)
    particles: tuple[int, ...] = (1, 2, 4, 8, 16)
    chains: tuple[int, ...] = (2, 4, 8)
    cut_rounds: bool = True
    max_forward_tokens: int = CPU_MAX_FORWARD_TOKENS
    context: int = 100
    reps: int = 3
    acceptance_tokens: int = 256
    acceptance_draft_tokens: int = 4

    def settings(
        self,
        min_particles: int,
        particles: int | None = None,
        draft_tokens: int | None = None,
        with_draft: bool = True,
        ngram: bool = True,
    ) -> list[Setting]:
        """The settings of the decoders the tuner predicts (the table's ``tuned`` rows), by
        their traits: ``ar`` (no drafts), n-gram ``sd`` (drafts from the text; K
        :data:`NGRAM_DRAFT_TOKENS` or ``draft_tokens``; unless ``ngram`` is False), then
        ``sd`` per K (the draft model, one row), multi-draft ``sd`` per (N, K) of
        :attr:`chains` (N rows), then ``smc`` per (N, K) (the draft model, N rows; with
        :attr:`cut_rounds` each also with rounds cut where the ESS falls); an explicit
        ``particles`` or ``draft_tokens`` replaces the grid's values (an explicit N of 1: no
        multi-draft setting). Settings whose target forward exceeds
        :attr:`max_forward_tokens` are left out (smc: except at the smallest N allowed).
        Without a draft: ``ar`` and n-gram ``sd`` only."""
        rows = [d for d in DECODERS.values() if d.tuned]
        out = [Setting.of(d) for d in rows if not d.draft_tokens]
        if ngram:
            k = draft_tokens if draft_tokens is not None else NGRAM_DRAFT_TOKENS
            out += [Setting.of(d, 1, k) for d in rows if d.from_text]
        if not with_draft:
            return out
        ks = (draft_tokens,) if draft_tokens is not None else self.draft_tokens
        floor = particles if particles is not None else min_particles
        ns = (particles,) if particles is not None else (*self.particles, min_particles)
        model = [d for d in rows if d.draft_model]
        ks = sorted(set(ks))
        out += [Setting.of(d, 1, k) for d in model if not d.uses_n for k in ks]
        chains = (particles,) if particles is not None else self.chains
        out += [
            Setting.of(d, n, k)
            for d in model
            if d.chains
            for n in sorted(set(chains))
            for k in ks
            if 2 <= n <= MAX_CHAINS and n * (k + 1) <= self.max_forward_tokens
        ]
        cuts = (False, True) if self.cut_rounds else (False,)
        out += [
            Setting.of(d, n, k, cut)
            for cut in cuts
            for d in model
            if d.particles
            for n in sorted(set(ns))
            for k in ks
            if (n * (k + 1) <= self.max_forward_tokens or n == floor) and not (cut and n == 1)
        ]
        return out


def default_grid(device: str) -> TuningGrid:
    """The default grid for ``device`` (``cpu`` or ``cuda[:i]``): a GPU measures every N up
    to 16 at every K of :data:`GPU_DRAFT_TOKENS` (its batched rows are where SMC-SD can win)."""
    if str(device).startswith("cuda"):
        return TuningGrid(draft_tokens=GPU_DRAFT_TOKENS, max_forward_tokens=GPU_MAX_FORWARD_TOKENS)
    return TuningGrid()


def shapes(settings: list[Setting]) -> tuple[set[Shape], set[Shape]]:
    """The target and draft forward shapes ``settings`` need."""
    target = {s for st in settings for s in st.target_shapes()}
    draft = {s for st in settings for s in st.draft_shapes()}
    return target, draft
