"""Predicted tokens/s of a decoding setting from measured forward costs, and the choice.

Pure functions (no model, no clock): unit-testable with hand-written costs.

A *round* of each method, the forwards it issues and what they cost, is its decoder's (its
``cost`` module, :mod:`smcspec.decoding.rounds`; through :attr:`Setting.decoder`): ``ar`` one
target forward a token; ``sd`` K draft forwards and a K+1-token target forward,
``(1 - alpha^(K+1)) / (1 - alpha)`` tokens a round (Leviathan et al. 2023, eq. 1); ``smc`` K
draft forwards of N rows and one target forward of N x (K+1) tokens for K+1 tokens (Emara et
al. 2026, arXiv:2604.15672; the roofline ``(K+1) / ((K+1) c + 1)`` when N rows cost what one row
costs). ``sd`` with n-gram drafts (no draft model, :mod:`smcspec.decoding.sd.ngram`) is priced
*at its gate's threshold*: its speed depends on how much the answer copies the text before
it, which no prompt-independent measurement knows, and its gate drafts only where the
target's recent probability of the proposals (the acceptance probability of a point-mass
draft) is at least ``p_min`` (:data:`~smcspec.config.NGRAM_DRAFT_P_MIN`); so one drafted
token accepted with probability ``p_min``, ``1 + p_min`` tokens for a 2-token target forward.
Above that speed every round the gate lets draft is predicted to pay, and a round that
drafts nothing is an ``ar`` step; so where this beats ``ar``, n-gram sd can lose to ``ar``
only its loop's own overhead and wins where the text copies (:func:`choose`,
:data:`NGRAM_MARGIN`).

**Distinct rows** (:mod:`smcspec.backends.shared_rows`): a forward computes only the
distinct particle prefixes of its N x (K+1) rows, so an smc round costs what forwards of the
*distinct* rows cost: ``f N (K+1)`` target rows and ``f N`` (``2 f N``) draft rows, with
``f`` the distinct fraction, priced by interpolating each model's measured forward seconds
in the number of rows (:func:`seconds_for_rows`). ``f`` is simulated
(:func:`predicted_distinct`) from the pair's measured agreement profiles (each position's
most likely probabilities, :func:`smcspec.tuning.measure.top_probabilities`) and its
log-weights: particles share a row while their tokens agree, diverge for good once they
differ, and are made copies again by resampling.

**Multi-draft sd** (``sd`` with N >= 2 chains, exact: no fidelity floor) issues SMC-SD's
forwards; its tokens a round come from the pair's measured tree acceptance and the chain
``alpha`` (:func:`smcspec.tuning.multi_draft.multi_sd_tokens_per_round`, whose notes state
the formula and its assumptions), and its rows are the token tree's distinct prefixes
(:func:`predicted_tree_distinct`: every round restarts from one accepted path).

**SMC-SD rounds cut where the ESS falls** (``round_end="ess"``, :mod:`smcspec.decoding.smc.cut`)
issue a block round's forwards and yield ``j* + 1`` tokens, ``j*`` the first drafted position
whose running ESS is below ``kappa N``; :func:`predicted_cut_round` simulates ``j*`` and the
ESS there from the same log-weight quantiles as :func:`predicted_ess`. The fidelity floor is
the same: the ESS at the round's end (where it resamples), at ``j*``.

Predicted tokens/s = tokens a round / seconds of its forwards. Sampling, Python and prefill
time are not counted, so measured tokens/s are lower (on the 2-core CPU of
``docs/benchmarks/llamacpp-cpu``: ar 24 measured vs 30 predicted tokens/s).

**Fidelity.** SMC-SD's error is governed by how unequal its importance weights are after a
round of K drafted tokens (`docs/smc-sd.md`, "What is exact and what is not": a larger K
needs a larger N). The weights' per-token log-increments ``log p_T(x) - log q_T(x)``,
``x ~ q_T``, are measured once per pair and temperatures as quantiles
(:func:`smcspec.tuning.measure.log_weight_quantiles`); :func:`predicted_ess` simulates N
particles' blocks of K increments drawn from them and returns the expected effective sample
size after the round (ESS = 1 / sum w_i^2, normalised weights; Kong 1992). A setting is kept
when that ESS is at least ``min_ess`` effective particles (:func:`choose`). An absolute ESS,
not a fraction of N: the error falls with the number of effective particles, and a fraction
of N would favour fewer particles (on the default pair it is 0.60 at N=4 K=4 and 0.53 at N=8
K=4, whose ESS is 2.4 and 4.2).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from smcspec.config import MODEL_DRAFT, NGRAM_DRAFT_P_MIN, ROUND_ENDS, GenerationConfig
from smcspec.decoding.labels import setting_label
from smcspec.decoding.registry import (
    DEFAULT_TUNED,
    Choice,
    Decoder,
    choice,
    decoder_named,
    tuned_choices,
)
from smcspec.decoding.rounds import RoundCosts, Shape
from smcspec.decoding.rounds import seconds_for_rows as seconds_for_rows  # re-exported
from smcspec.decoding.sd.cost import sd_tokens_per_round as sd_tokens_per_round  # re-exported
from smcspec.errors import ConfigError
from smcspec.sampling.resampling import batched_ess, strata_ancestors
from smcspec.tuning.multi_draft import multi_sd_tokens_per_round


@dataclass(frozen=True)
class Setting:
    """One decoding setting: ``ar``, ``sd`` with K draft tokens (N >= 2 chains: multi-draft
    sd), or ``smc`` with N, K (rounds of K drafts, or cut where the ESS falls). What differs
    between them (its round, its name, how it configures a request) is its decoder's
    (:attr:`decoder`, from :mod:`smcspec.decoding.registry`).

    Attributes:
        method: ``"ar"``, ``"sd"`` or ``"smc"``.
        particles: N (smc's particles, multi-draft sd's chains; 1 otherwise).
        draft_tokens: K (sd and smc; 0 for ar).
        draft: ``"model"`` (the draft model) or ``"ngram"`` (sd only: n-gram drafts from the
            text, gated by the target's confidence; :mod:`smcspec.decoding.sd.ngram`).
        round_end: smc only: ``"block"`` (K drafts a round) or ``"ess"`` (cut where the ESS
            falls, :mod:`smcspec.decoding.smc.cut`).
    """

    method: str
    particles: int = 1
    draft_tokens: int = 0
    draft: str = MODEL_DRAFT.name
    round_end: str = ROUND_ENDS[0]

    @classmethod
    def of(
        cls, decoder: Decoder, particles: int = 1, draft_tokens: int = 0, cut: bool = False
    ) -> Setting:
        """``decoder`` (a row of the decoder table) at N = ``particles``, K =
        ``draft_tokens``; ``cut``: rounds cut where the ESS falls (smc)."""
        end = ROUND_ENDS[1] if cut else ROUND_ENDS[0]
        return cls(decoder.method, particles, draft_tokens, decoder.draft.name, end)

    @property
    def decoder(self) -> Decoder:
        """The decoder that runs this setting (ConfigError for an unknown method)."""
        return decoder_named(self.method, self.draft, self.particles)

    @property
    def name(self) -> str:
        """``ar``, ``sd-k4``, ``sd-n4-k4``, ``sd-ngram-k4``, ``smc-n4-k4``, ``smc-n8-k8-ess``
        (:mod:`smcspec.decoding.labels`, the names of ``smcspec.eval.harness``)."""
        return setting_label(self.decoder, self.particles, self.draft_tokens, ess=self.cut)

    @property
    def cut(self) -> bool:
        """Whether its SMC-SD rounds are cut where the ESS falls."""
        return self.weighted and self.round_end == ROUND_ENDS[1]

    @property
    def chains(self) -> bool:
        """Whether it is multi-draft sd (N chains, exact)."""
        return self.decoder.chains

    @property
    def ngram(self) -> bool:
        """Whether this is sd with n-gram drafts."""
        return self.decoder.from_text

    @property
    def weighted(self) -> bool:
        """Whether it weighs particles (smc): the fidelity floor applies to it."""
        return self.decoder.particles

    @property
    def drafts(self) -> bool:
        """Whether it drafts (everything but ``ar``)."""
        return self.decoder.draft_tokens

    def target_shapes(self) -> tuple[Shape, ...]:
        """Target forwards of one round (n-gram sd: the one- and two-row forwards that
        price its gate, :func:`predict`)."""
        return self.decoder.shapes(self.particles, self.draft_tokens)[0]

    def draft_shapes(self) -> tuple[Shape, ...]:
        """Draft forwards a round may issue (ar and n-gram sd: none)."""
        return self.decoder.shapes(self.particles, self.draft_tokens)[1]

    def apply(self, config: GenerationConfig) -> GenerationConfig:
        """``config`` with this setting's method (and N, K, draft where the method has them);
        a cut-round setting cuts its rounds, a block one keeps ``config``'s round end (a
        user's ``round_end="ess"`` stays)."""
        out = self.decoder.configure(config, self.particles, self.draft_tokens)
        return replace(out, round_end=self.round_end) if self.cut else out


@dataclass(frozen=True)
class ForwardCosts:
    """Measured costs a prediction needs.

    Attributes:
        target, draft: median wall seconds of one decode forward per ``(rows, tokens)``.
        alpha: sd's per-token acceptance probability in [0, 1] (Leviathan et al.'s alpha,
            not the fraction of drafted tokens accepted); None when not measured.
        log_weight_quantiles: 0 %, 1 %, ..., 100 % quantiles of the per-token log-weight
            (see the module notes); None when not measured (no fidelity prediction).
        draft_top_probs, target_top_probs: per position of the calibration text, the most
            likely probabilities of ``q_T`` and ``p_T``, descending (the agreement profiles
            of the distinct-rows prediction); None when not measured (every row counted).
        target_range, draft_range: the fastest and slowest timed forward per shape; None
            when not kept (:func:`prediction_range` then uses the medians).
        alpha_range: a 95% interval of ``alpha`` (:func:`alpha_interval`); None: not known.
        tree_rejection, tree_continuing: multi-draft sd's measured tree acceptance
            (:func:`smcspec.tuning.multi_draft.tree_acceptance`); None: not measured (no
            multi-draft prediction).
    """

    target: Mapping[Shape, float]
    draft: Mapping[Shape, float]
    alpha: float | None = None
    log_weight_quantiles: Sequence[float] | None = None
    draft_top_probs: Sequence[Sequence[float]] | None = None
    target_top_probs: Sequence[Sequence[float]] | None = None
    target_range: Mapping[Shape, tuple[float, float]] | None = None
    draft_range: Mapping[Shape, tuple[float, float]] | None = None
    alpha_range: tuple[float, float] | None = None
    tree_rejection: Sequence[float] | None = None
    tree_continuing: Sequence[Sequence[float]] | None = None

    def predicts(self, setting: Setting) -> bool:
        """Whether these measurements can predict ``setting``: multi-draft sd needs the tree
        acceptance (up to its N) and ``alpha``, cut SMC-SD rounds the log-weight quantiles."""
        if setting.chains:
            tree = self.tree_rejection
            return tree is not None and self.alpha is not None and setting.particles <= len(tree)
        return not setting.cut or self.log_weight_quantiles is not None


@dataclass(frozen=True)
class Prediction:
    """The roofline prediction of one setting.

    Attributes:
        setting: the setting.
        tokens_per_round: expected tokens a round.
        round_seconds: expected seconds of a round's forwards.
        ess: smc only: the expected ESS after one round from equal weights
            (:func:`predicted_ess`; cut rounds: at the cut, :func:`predicted_cut_round`);
            None for ar and sd, or without measured log-weights.
        distinct: smc and multi-draft sd: the predicted fraction of rows its forwards
            compute (:func:`predicted_distinct`, :func:`predicted_tree_distinct`; 1.0 with
            sharing off or nothing to predict from).
        all_rows_seconds: smc and multi-draft sd: the round's seconds if every row were
            computed.
        tokens_per_second_range: the prediction at its slowest and fastest
            (:func:`prediction_range`); None when not computed or not known.
    """

    setting: Setting
    tokens_per_round: float
    round_seconds: float
    ess: float | None = None
    distinct: float = 1.0
    all_rows_seconds: float | None = None
    tokens_per_second_range: tuple[float, float] | None = None

    @property
    def all_rows_tokens_per_second(self) -> float:
        """Tokens/s if every row were computed (``--no-shared-rows``)."""
        return self.tokens_per_round / (self.all_rows_seconds or self.round_seconds)

    @property
    def tokens_per_second(self) -> float:
        """Predicted decode speed: expected tokens per round / seconds per round."""
        return self.tokens_per_round / self.round_seconds


def sd_accepted_per_round(alpha: float, k: float) -> float:
    """Expected accepted drafts of one round of ``k`` drafts, ``alpha (1 - alpha^k) / (1 - alpha)``
    (``sd_tokens_per_round - 1``; ``k`` may be a mean, not an integer)."""
    if alpha >= 1.0:
        return float(k)
    return alpha * (1.0 - alpha**k) / (1.0 - alpha)


def alpha_from_counts(accepted: int, drafted: int, rounds: int) -> float:
    """Leviathan's per-token acceptance ``alpha`` from an sd run's counts.

    ``accepted / drafted`` (the ``acceptance_rate`` stat) is *not* alpha: a round stops at the
    first rejection, so the drafts after it are counted as drafted but never tried. alpha is
    the root of ``sd_accepted_per_round(alpha, drafted / rounds) = accepted / rounds``
    (bisection). Using the rate as alpha under-predicts sd at larger K: the committed CPU
    benchmark's sd-k4 had rate 0.68 but alpha 0.86 (sd-k2: 0.80 and 0.86).

    Raises:
        ConfigError: no rounds, or counts that cannot come from a run.
    """
    if rounds < 1 or not 0 <= accepted <= drafted:
        raise ConfigError(f"bad sd counts: accepted {accepted}, drafted {drafted}, rounds {rounds}")
    k, mean = drafted / rounds, accepted / rounds
    if accepted == 0:
        return 0.0
    if mean >= k:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sd_accepted_per_round(mid, k) < mean else (lo, mid)
    return (lo + hi) / 2


def alpha_interval(
    alpha: float, accepted: int, drafted: int, rounds: int, z: float = 1.96
) -> tuple[float, float]:
    """An approximate 95% interval of the per-token acceptance ``alpha`` measured from an sd
    run's counts (:func:`alpha_from_counts`).

    Each tried draft is a Bernoulli(alpha) trial: the accepted ones, plus one rejection in
    each round that did not accept all its drafts (expected ``rounds (1 - alpha^k)``, ``k``
    the mean drafts a round). The Wilson score interval (Wilson 1927) of ``accepted`` in
    that many trials; rounds are treated as independent, which the pooled prompts' tokens
    are not quite, so the interval is a lower bound on the uncertainty.

    Raises:
        ConfigError: counts that cannot come from a run (as :func:`alpha_from_counts`).
    """
    if rounds < 1 or not 0 <= accepted <= drafted:
        raise ConfigError(f"bad sd counts: accepted {accepted}, drafted {drafted}, rounds {rounds}")
    trials = accepted + rounds * (1.0 - alpha ** (drafted / rounds))
    if trials <= 0:
        return (0.0, 1.0)
    p = min(1.0, accepted / trials)
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = (
        z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    )
    return (max(0.0, centre - half), min(1.0, centre + half))


def predicted_ess(
    particles: int,
    draft_tokens: int,
    quantiles: Sequence[float],
    rounds: int = 2000,
    seed: int = 0,
) -> float:
    """Expected ESS of ``particles`` particles after one round of ``draft_tokens`` drafted
    tokens from equal weights, in [1, N].

    Simulated (seeded, so deterministic): each of ``rounds`` rounds gives every particle the
    sum of K per-token log-weights drawn from the quantile function ``quantiles`` (linear
    between the listed quantiles), and its ESS ``(sum w)^2 / sum w^2`` is averaged. Tokens
    are treated as independent, which the real block is not; the committed check against
    measured runs is ``docs/benchmarks/fidelity-floor/``.

    Raises:
        ConfigError: N < 1, K < 0, or fewer than 2 quantiles.
    """
    if particles < 1 or draft_tokens < 0 or len(quantiles) < 2:
        raise ConfigError("predicted_ess needs N >= 1, K >= 0 and 2 or more quantiles")
    if particles == 1 or draft_tokens == 0:
        return float(particles)
    q = np.asarray(quantiles, dtype=np.float64)
    u = np.random.default_rng(seed).random((rounds, particles, draft_tokens))
    draws = np.interp(u * (len(q) - 1), np.arange(len(q)), q)
    return float(batched_ess(torch.from_numpy(draws.sum(-1))).mean())


def predicted_cut_round(
    particles: int,
    draft_tokens: int,
    quantiles: Sequence[float],
    ess_threshold: float,
    rounds: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """Expected tokens and ESS at the end of an SMC-SD round cut where the ESS falls
    (:mod:`smcspec.decoding.smc.cut`) of N = ``particles`` and K = ``draft_tokens`` from
    equal weights: ``(E[j* + 1], E[ESS(j*)])``, ``j*`` the first drafted position ``1..K``
    whose running ESS ``(sum w)^2 / sum w^2`` is below ``ess_threshold * N`` (none: K).

    Simulated as :func:`predicted_ess` (the same seeded draws of per-token log-weights from
    ``quantiles``, tokens independent); with ``ess_threshold`` 0 or N = 1 no round is cut:
    ``(K + 1, predicted_ess(N, K, quantiles))``.

    Raises:
        ConfigError: N < 1, K < 1, a threshold outside [0, 1], or fewer than 2 quantiles.
    """
    if particles < 1 or draft_tokens < 1 or len(quantiles) < 2 or not 0 <= ess_threshold <= 1:
        raise ConfigError(
            "predicted_cut_round needs N >= 1, K >= 1, kappa in [0, 1] and 2 or more quantiles"
        )
    if particles == 1:
        return float(draft_tokens + 1), 1.0
    q = np.asarray(quantiles, dtype=np.float64)
    u = np.random.default_rng(seed).random((rounds, particles, draft_tokens))
    logw = np.interp(u * (len(q) - 1), np.arange(len(q)), q).cumsum(-1)  # [R, N, j]
    ess = batched_ess(torch.from_numpy(logw), dim=1).numpy()  # [R, K]: after j = 1..K drafted
    below = ess < ess_threshold * particles
    cut = np.where(below.any(-1), below.argmax(-1), draft_tokens - 1)  # 0-based j* - 1
    at_cut = ess[np.arange(rounds), cut]
    return float((cut + 2).mean()), float(at_cut.mean())


def predicted_tree_distinct(
    chains: int, draft_tokens: int, draft_top_probs: Sequence[Sequence[float]],
    reps: int = 64, seed: int = 0,
) -> float:  # fmt: skip
    """Expected fraction of a multi-draft sd round's N x (K+1) target rows that are distinct
    (``(0, 1]``): the first row of every chain is the accepted path's last token (one row),
    and at each of the K drafted positions the chains on one history draw tokens from a
    random position's draft agreement profile (as :func:`predicted_distinct`, without
    weights or resampling: every round restarts from one accepted path). Seeded, so
    deterministic; the draft's fraction is taken to be the target's.

    Raises:
        ConfigError: N < 1, K < 1, or an empty profile.
    """
    if chains < 1 or draft_tokens < 1 or not draft_top_probs:
        raise ConfigError("predicted_tree_distinct needs N >= 1, K >= 1 and a draft profile")
    if chains == 1:
        return 1.0
    rng = np.random.default_rng(seed)
    cum = _cumulative(draft_top_probs)
    distinct = 0
    for _ in range(reps):
        hist, label = np.zeros(chains, dtype=np.int64), 1
        distinct += 1
        for _ in range(draft_tokens):
            hist, label, _ = _draw_histories(rng, hist, label, cum, None, False)
            distinct += len(np.unique(hist))
    return distinct / (reps * chains * (draft_tokens + 1))


def predicted_distinct(
    particles: int,
    draft_tokens: int,
    draft_top_probs: Sequence[Sequence[float]],
    target_top_probs: Sequence[Sequence[float]],
    quantiles: Sequence[float] | None,
    ess_threshold: float = 0.5,
    rounds: int = 16,
    reps: int = 16,
    seed: int = 0,
) -> float:
    """Expected fraction of an smc request's rows that are distinct (``(0, 1]``).

    Simulated (seeded, so deterministic): ``reps`` requests of ``rounds`` rounds of N
    particles that start as one sequence. At each of a round's K drafted positions, the
    particles on one history draw tokens from one agreement profile (a random position's
    most likely draft probabilities; the rest of the mass gives tokens that agree with no
    other particle), and each new history gets a log-weight increment drawn from
    ``quantiles``; the bonus position draws from a target profile. When the ESS falls below
    ``ess_threshold * N`` the particles are resampled systematically (copies share their
    ancestor's history again) and the weights restart. A position's distinct rows are its
    distinct histories (the bonus counted after resampling, as the next round's forward
    sees it); the draft's fraction is taken to be the target's (one position apart).
    Without ``quantiles`` no resampling is simulated.

    Raises:
        ConfigError: N < 1, K < 1, or an empty profile.
    """
    if particles < 1 or draft_tokens < 1 or not draft_top_probs or not target_top_probs:
        raise ConfigError("predicted_distinct needs N >= 1, K >= 1 and agreement profiles")
    if particles == 1:
        return 1.0
    rng = np.random.default_rng(seed)
    q = np.asarray(quantiles, dtype=np.float64) if quantiles is not None else None
    profiles = [_cumulative(draft_top_probs), _cumulative(target_top_probs)]
    n, distinct, fed = particles, 0, 0
    for _ in range(reps):
        hist = np.zeros(n, dtype=np.int64)  # history label of each particle
        logw = np.zeros(n)
        label = 1
        for _ in range(rounds):
            for j in range(draft_tokens + 1):
                bonus = j == draft_tokens
                hist, label, inc = _draw_histories(rng, hist, label, profiles[bonus], q, bonus)
                logw += inc
                if bonus and q is not None:  # resampling, before the bonus is fed
                    lw = torch.from_numpy(logw)
                    if float(batched_ess(lw)) < ess_threshold * n:
                        hist = hist[strata_ancestors(lw, rng.random()).numpy()]
                        logw[:] = 0.0
                distinct += len(np.unique(hist))
                fed += n
    return distinct / fed


def _cumulative(profile: Sequence[Sequence[float]]) -> np.ndarray:
    """``[L, top + 1]`` cumulative probabilities per position; the last bin (the mass
    outside the top tokens) is 1.0."""
    p = np.asarray(profile, dtype=np.float64)
    c = np.cumsum(p, axis=1)
    return np.concatenate([np.minimum(c, 1.0), np.ones((len(p), 1))], axis=1)


def _draw_histories(rng, hist, label, cum, q, bonus):
    """One position: each history's particles draw tokens from one random profile row;
    particles drawing the same top token share a new history, the others get their own.
    Returns the new labels, the next free label and each particle's log-weight increment
    (one per new history; 0 for the bonus, which carries no draft weight)."""
    n = len(hist)
    new = np.empty(n, dtype=np.int64)
    inc = np.zeros(n)
    top = cum.shape[1] - 1
    for h in np.unique(hist):
        members = np.nonzero(hist == h)[0]
        row = cum[rng.integers(len(cum))]
        tokens = np.searchsorted(row, rng.random(len(members)), side="right")
        for t in np.unique(tokens):
            chosen = members[tokens == t]
            groups = [chosen] if t < top else [[i] for i in chosen]  # tail tokens: all differ
            for g in groups:
                new[g] = label
                if not bonus and q is not None:
                    inc[g] = np.interp(rng.random() * (len(q) - 1), np.arange(len(q)), q)
                label += 1
    return new, label, inc


def predict(
    setting: Setting,
    costs: ForwardCosts,
    shared_rows: bool = True,
    ess_threshold: float = GenerationConfig().ess_threshold,
) -> Prediction:
    """Tokens a round and seconds a round of ``setting`` (see the module notes); an smc or
    multi-draft sd setting with ``shared_rows`` and measured agreement profiles is priced at
    its predicted distinct rows; ``ess_threshold``: kappa of rounds cut where the ESS falls.

    Raises:
        KeyError: a forward shape the setting needs is not in ``costs``.
        ConfigError: an sd setting without a measured ``alpha``, a multi-draft one without
            the tree acceptance, a cut round without log-weight quantiles, or an unknown
            method.
    """
    n, k = setting.particles, setting.draft_tokens
    profiles = costs.draft_top_probs, costs.target_top_probs
    if setting.chains:
        f = 1.0
        if shared_rows and profiles[0] is not None:
            f = predicted_tree_distinct(n, k, profiles[0])
        tokens, seconds = _round(setting, costs, f)
        return Prediction(setting, tokens, seconds, None, f, _round(setting, costs)[1])
    if not setting.weighted:
        tokens, seconds = _round(setting, costs)
        return Prediction(setting, tokens, seconds)
    q = costs.log_weight_quantiles
    ess, cut_tokens = None if q is None else predicted_ess(n, k, q), None
    if setting.cut:
        if q is None:
            raise ConfigError("a prediction of cut rounds needs the log-weight quantiles")
        cut_tokens, ess = predicted_cut_round(n, k, q, ess_threshold)
    f = 1.0
    if shared_rows and n > 1 and None not in profiles:
        f = predicted_distinct(n, k, *profiles, q)
    tokens, seconds = _round(setting, costs, f, cut_tokens)
    return Prediction(setting, tokens, seconds, ess, f, _round(setting, costs)[1])


def _round(
    setting: Setting, costs: ForwardCosts, distinct: float = 1.0, tokens: float | None = None
) -> tuple[float, float]:
    """Expected tokens and seconds of one round of ``setting`` at ``costs``: its decoder's
    round (:mod:`smcspec.decoding.rounds`; n-gram sd at the gate's threshold
    :data:`~smcspec.config.NGRAM_DRAFT_P_MIN`; multi-draft sd's tokens from the tree
    acceptance at ``costs.alpha``); an smc or multi-draft round computes the fraction
    ``distinct`` of its rows (at most what every row costs); ``tokens``, where given,
    replaces the round's tokens (cut rounds: the simulated ones). The simulations (ESS,
    distinct rows, cuts) are the caller's: they do not depend on the costs."""
    n, k = setting.particles, setting.draft_tokens
    multi = {}
    if setting.chains:
        if not costs.predicts(setting):
            raise ConfigError(
                f"a multi-draft sd prediction ({setting.name}) needs alpha and the tree "
                "acceptance measured up to its N"
            )
        multi[(n, k)] = multi_sd_tokens_per_round(
            costs.alpha, n, k, costs.tree_rejection, costs.tree_continuing
        )
    c = RoundCosts(costs.target, costs.draft, costs.alpha, NGRAM_DRAFT_P_MIN, multi)
    out = setting.decoder.cost(n, k, c, distinct)
    return out if tokens is None else (tokens, out[1])


def prediction_range(
    setting: Setting,
    costs: ForwardCosts,
    shared_rows: bool = True,
    base: Prediction | None = None,
) -> tuple[float, float] | None:
    """The predicted tokens/s of ``setting`` at its slowest and at its fastest: every
    forward at the slowest of its timed repetitions and ``alpha`` at the low end of its
    interval, then every forward at the fastest and ``alpha`` at the high end. It shows how
    much one measurement's noise moves the prediction; the drift between measurements made
    at different times can be larger (``docs/benchmarks/tuner-stability/``). ``base``:
    ``predict(setting, costs, shared_rows)`` if already made (its distinct-row fraction is
    reused: the simulation does not depend on the timings or alpha).

    Returns None when neither timing ranges nor an alpha interval are known.
    """
    if costs.target_range is None and costs.alpha_range is None:
        return None
    base = base or predict(setting, costs, shared_rows)
    distinct = base.distinct
    cut_tokens = base.tokens_per_round if setting.cut else None  # not alpha's or the costs'

    def at(end: int) -> float:
        target, draft = dict(costs.target), dict(costs.draft)
        for ranges, out in ((costs.target_range, target), (costs.draft_range, draft)):
            for shape, bounds in (ranges or {}).items():
                out[shape] = bounds[end]
        alpha = costs.alpha
        if costs.alpha_range is not None and alpha is not None:
            alpha = costs.alpha_range[1 - end]
        varied = replace(costs, target=target, draft=draft, alpha=alpha)
        tokens, seconds = _round(setting, varied, distinct, cut_tokens)
        return tokens / seconds

    return (at(1), at(0))


def predict_all(
    settings: Iterable[Setting],
    costs: ForwardCosts,
    shared_rows: bool = True,
    ess_threshold: float = GenerationConfig().ess_threshold,
) -> list[Prediction]:
    """:func:`predict` of every setting ``costs`` can predict (:meth:`ForwardCosts.predicts`:
    multi-draft sd without the tree acceptance, at temperature 0 or from pair statistics that
    predate it, and cut rounds without log-weights are left out), in order, each with its
    :func:`prediction_range`."""
    out = []
    for s in (s for s in settings if costs.predicts(s)):
        p = predict(s, costs, shared_rows, ess_threshold)
        span = prediction_range(s, costs, shared_rows, base=p)
        out.append(replace(p, tokens_per_second_range=span))
    return out


DEFAULT_SMC = (8, 2)
"""The documented smc setting (N, K) on a CPU (``docs/usage/cli.md``; the GSM8K run's): on a
CPU the tuner keeps it unless another is predicted faster by more than :data:`CHOICE_MARGIN`
(on a GPU, where SMC-SD's best settings differ, it takes the fastest)."""

CHOICE_MARGIN = 0.3
"""How much faster (a fraction) another smc setting must be predicted than
:data:`DEFAULT_SMC` to replace it: the spread of one setting's predicted tokens/s between
three fresh measurements on one idle 2-core machine reached 31% for N >= 4 (median 18%;
``docs/benchmarks/tuner-stability/``), all of it from the timed forwards (alpha and the
log-weights come from seeded runs and repeat exactly)."""


NGRAM_MARGIN = 0.10
"""How much faster than ``ar`` (a fraction) n-gram sd must be predicted at its gate's
threshold for ``auto`` to take it in ``ar``'s place: it covers the n-gram loop's overhead
on text that never copies (a median 0.99 of ``ar``'s speed paired on 4 chat prompts x 5
seeds, 0.98 on 20 chat prompts; ``docs/benchmarks/ngram-cpu/auto.md``) and the spread of
the measured 2-row cost."""


def choose(
    predictions: Sequence[Prediction],
    method: Choice | str = DEFAULT_TUNED,
    min_particles: int = 4,
    particles: int | None = None,
    draft_tokens: int | None = None,
    tie: float = 0.05,
    min_ess: float = 0.0,
    default: tuple[int, int] | None = None,
    margin: float = CHOICE_MARGIN,
) -> Prediction:
    """The fastest predicted setting.

    Args:
        predictions: the candidates (:func:`predict_all`).
        method: the :class:`~smcspec.decoding.registry.Choice` (or its name) to choose for:
            ``auto`` (any setting) or ``smc`` (settings that weigh particles only).
        min_particles: the fidelity floor: smc settings need ``N >= min_particles``.
        particles: only smc settings with this N (the floor is then not applied: an
            explicit N is used as given).
        draft_tokens: only sd and smc settings with this K.
        min_ess: the fidelity floor on the predicted ESS after a round, in effective
            particles (:attr:`Prediction.ess`); smc settings below it are not chosen unless
            N is given. Where only N and K are chosen (``smc``) and none is at or above it,
            the setting with the highest predicted ESS is chosen (check :func:`meets_floor`).
        tie: when the fastest is smc, smc settings predicted within this fraction of it
            count as ties (measurement noise) and the one with the most particles wins
            (more particles, better fidelity, at no measurable cost; where N rows cost what
            one row costs, as on a memory-bound GPU, this picks the largest N).
        default, margin: when the fastest is smc and neither N nor K is given, the smc
            setting ``default`` (N, K) is kept if it is a candidate (the floors included)
            and predicted within ``margin`` (a fraction) of the fastest, so that noise in
            the measurements does not move the choice (None: no default; the tuner passes
            :data:`DEFAULT_SMC` on a CPU only).

    n-gram sd (:attr:`Setting.ngram`) is never compared with the others as a speed: its
    prediction is the one at its gate's threshold (see the module notes). ``auto`` takes it
    instead of ``ar`` when ``ar`` is the choice and that prediction beats ``ar``'s by more
    than :data:`NGRAM_MARGIN`; ``smc`` never takes it.

    Raises:
        ConfigError: an unknown method, or no prediction meets the restrictions.
    """
    wanted = choice(method) if isinstance(method, str) else method
    if not wanted.tuned:
        tuned = " or ".join(c.name for c in tuned_choices())
        raise ConfigError(f"can only choose for method {tuned}, not {wanted.name!r}")

    def eligible(p: Prediction, floor: bool = True) -> bool:
        s = p.setting
        if not wanted.may_choose(s.decoder):
            return False
        if s.ngram:
            return draft_tokens is None or s.draft_tokens == draft_tokens
        if s.weighted:
            if particles is not None and s.particles != particles:
                return False
            if particles is None and s.particles < min_particles:
                return False
            if floor and particles is None and not meets_floor(p, min_ess):
                return False
        return draft_tokens is None or not s.drafts or s.draft_tokens == draft_tokens

    allowed = [p for p in predictions if eligible(p)]
    candidates = [p for p in allowed if not p.setting.ngram]
    ngram = [p for p in allowed if p.setting.ngram]
    if not candidates and not wanted.chooses_method:  # none meets the floor: the most faithful
        below = [p for p in predictions if eligible(p, floor=False)]
        if below:
            return max(below, key=lambda p: (p.ess or 0.0, p.tokens_per_second))
    if not candidates:
        raise ConfigError(
            f"no predicted {wanted.name} setting with N >= {min_particles}"
            + (f", N = {particles}" if particles is not None else "")
            + (f", K = {draft_tokens}" if draft_tokens is not None else "")
        )
    best = max(candidates, key=lambda p: p.tokens_per_second)
    if not best.setting.drafts:  # ar: n-gram sd takes its place if it beats it by the margin
        bar = (1 + NGRAM_MARGIN) * best.tokens_per_second
        faster = [p for p in ngram if p.tokens_per_second > bar]
        return max(faster, key=lambda p: p.tokens_per_second) if faster else best
    if best.setting.weighted and particles is None and draft_tokens is None:
        kept = [p for p in candidates if p.setting.weighted and not p.setting.cut
                and (p.setting.particles, p.setting.draft_tokens) == default]  # fmt: skip
        if kept and kept[0].tokens_per_second >= (1 - margin) * best.tokens_per_second:
            return kept[0]
    if best.setting.weighted and particles is None:
        floor = (1 - tie) * best.tokens_per_second
        near = [p for p in candidates if p.setting.weighted and p.tokens_per_second >= floor]
        best = max(near, key=lambda p: (p.setting.particles, p.tokens_per_second))
    return best


def meets_floor(prediction: Prediction, min_ess: float) -> bool:
    """Whether ``prediction`` keeps at least ``min_ess`` effective particles after a round
    (True for ar and sd, and for smc without a fidelity prediction)."""
    return prediction.ess is None or prediction.ess >= min_ess
