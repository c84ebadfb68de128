"""Measured costs (from the cache, or measured once) -> predictions -> the chosen settings."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smcspec.config import DEFAULT_MIN_ESS, GenerationConfig, check_min_ess, check_min_particles
from smcspec.decoding.registry import DEFAULT_TUNED, Choice, choice, tuned_choices
from smcspec.errors import ConfigError
from smcspec.tuning.cache import (
    CostRecord,
    cache_file,
    cost_key,
    read_costs,
    sampling_key,
    write_costs,
)
from smcspec.tuning.calibration import Calibration
from smcspec.tuning.grid import TuningGrid, default_grid, shapes
from smcspec.tuning.measure import ACCEPTANCE_PROMPTS, measure_acceptance, measure_forwards
from smcspec.tuning.pair_stats import PairStats, complete, find_cached_acceptance
from smcspec.tuning.predict import (
    DEFAULT_SMC,
    ForwardCosts,
    Prediction,
    Setting,
    choose,
    predict_all,
)

if TYPE_CHECKING:
    from smcspec.tuning.tunable import TunablePair


@dataclass(frozen=True)
class Tuning:
    """The predicted table and the choices of :func:`tune`.

    Attributes:
        predictions: every predicted setting (ar, sd per K, multi-draft sd per N and K, smc
            per N and K with block rounds and with rounds cut where the ESS falls).
        picks: the setting chosen for each :class:`~smcspec.decoding.registry.Choice` whose
            setting is chosen (:func:`~smcspec.decoding.registry.tuned_choices`; read them
            with :meth:`pick`): ``auto``'s, the fastest of all (``--method auto``), smc only
            with N >= ``min_particles``, and where that is ar, n-gram sd if it is predicted
            faster at its gate's threshold (:func:`~smcspec.tuning.predict.choose`; not with
            a constraint); ``smc``'s, the fastest smc setting with N >= ``min_particles``
            whose predicted ESS meets ``min_ess`` (``smc`` without N/K), or, when none does,
            the one with the highest predicted ESS; absent without a draft model.
        min_particles: the smallest N allowed.
        min_ess: the fidelity floor used (predicted effective particles after a round).
        costs: the measured costs the predictions come from.
        acceptance: the sd run that measured alpha (None without a draft).
        acceptance_source: where ``acceptance`` comes from: ``"measured now"``, ``"cached"``,
            the cache of the same files on another machine or device, or a pair-statistics
            file (None without a draft).
        key: the cache key (machine, backend, models).
        cache_path: the JSON file the costs are cached in.
        measured_seconds: seconds spent measuring in this call (0 when all was cached).
        calibration: the prompts and budget the acceptance is measured on.
        acceptance_key: the key of the acceptance measurement in the cache and in pair-stats
            files (:func:`~smcspec.tuning.cache.sampling_key`, plus
            :attr:`~smcspec.tuning.calibration.Calibration.key` for the user's prompts).
    """

    predictions: tuple[Prediction, ...]
    picks: Mapping[Choice, Prediction]
    min_particles: int
    min_ess: float
    costs: ForwardCosts
    acceptance: dict[str, Any] | None
    key: dict[str, Any]
    cache_path: Path
    measured_seconds: float
    acceptance_source: str | None = None
    calibration: Calibration | None = None
    acceptance_key: str = ""

    def pick(self, method: Choice | str) -> Prediction:
        """The setting chosen for ``method`` (a :class:`~smcspec.decoding.registry.Choice`
        or its name: ``auto``, ``smc``).

        Raises:
            ConfigError: a choice whose setting is given, never chosen (``ar``, ``sd``), or
                one not chosen without a draft model (``smc``) where none is loaded.
        """
        wanted = choice(method) if isinstance(method, str) else method
        if not wanted.tuned:
            tuned = " or ".join(c.name for c in tuned_choices())
            raise ConfigError(f"{wanted.name}'s setting is given, not chosen ({tuned})")
        if wanted not in self.picks:
            raise ConfigError(f"{wanted.name} needs a draft model; none is loaded")
        return self.picks[wanted]

    def short_of_floor(self) -> Prediction | None:
        """The pick of a choice of N and K alone (``smc``) whose predicted ESS after a round
        falls short of ``min_ess`` (no such setting meets the floor: it is the most faithful
        one), or None."""
        for c, p in self.picks.items():
            if not c.chooses_method and p.ess is not None and p.ess < self.min_ess:
                return p
        return None

    def config(
        self, base: GenerationConfig | None = None, method: Choice | str = DEFAULT_TUNED
    ) -> GenerationConfig:
        """``base`` (default: GenerationConfig()) with ``method``'s chosen setting."""
        return self.pick(method).setting.apply(base or GenerationConfig())


def tune(
    engine: TunablePair,
    config: GenerationConfig | None = None,
    min_particles: int = 4,
    particles: int | None = None,
    draft_tokens: int | None = None,
    grid: TuningGrid | None = None,
    log: Callable[[str], None] | None = None,
    tie: float = 0.05,
    remeasure: bool = False,
    min_ess: float = DEFAULT_MIN_ESS,
    pair_stats: PairStats | None = None,
    calibration: Calibration | None = None,
) -> Tuning:
    """Predict tokens/s of every ar, sd(K), multi-draft sd(N, K) and smc(N, K) (block or cut
    rounds) setting of ``engine`` on this machine
    and choose the fastest (see :mod:`smcspec.tuning.predict` for the formulas and
    :func:`~smcspec.tuning.predict.choose` for ``tie``).

    Costs are read from the cache file of this machine, backend and pair
    (:mod:`smcspec.tuning.cache`); what is not there is measured now and added to it (the
    forward costs once; alpha once per temperature and truncation setting of ``config``).
    The acceptance statistics belong to the pair, not the machine
    (:mod:`smcspec.tuning.pair_stats`): they come from ``pair_stats`` when given, else from
    this machine's cache, else from the cache of the same files on another machine or device
    (copied into this one), and are measured only when none has them.

    Args:
        engine: the loaded pair (a draft-less engine predicts ar only).
        config: its temperatures and truncation set the sd run measuring alpha; with its
            ``shared_rows`` (the default) smc settings are priced at their predicted
            distinct rows (:func:`~smcspec.tuning.predict.predicted_distinct`).
        min_particles: the smallest N smc may be given (the fidelity floor).
        particles, draft_tokens: restrict the choice to this N / K (an explicit N is used
            even below ``min_particles``).
        grid: the settings and measurement budget (default: :func:`default_grid`).
        log: called with one line before anything is measured (the CLI prints it).
        remeasure: ignore the cached file: measure everything now and replace it (costs
            measured while other work loaded the machine are wrong, and stay cached).
        min_ess: the fidelity floor: smc settings whose predicted ESS after a round is below
            this many effective particles are not chosen
            (:func:`~smcspec.tuning.predict.choose`).
        pair_stats: the pair's acceptance statistics measured elsewhere
            (:func:`~smcspec.tuning.pair_stats.read_pair_stats`), used instead of measuring
            them here (a GPU lent without the real weights); never written to the cache.
        calibration: the prompts and budget the acceptance is measured on
            (:func:`~smcspec.tuning.calibration.read_calibration`; default: the built-in
            prompts, ``grid.acceptance_tokens`` in all). Its measurement is kept under its own
            key (:attr:`~smcspec.tuning.calibration.Calibration.key`), beside the built-in one.
    Raises:
        ConfigError: bad ``min_particles``, no setting meets the restrictions, or
            ``pair_stats`` holds nothing at ``config``'s sampling settings.
    """
    check_min_particles(min_particles)
    check_min_ess(min_ess)
    cfg = (config or GenerationConfig()).validate()
    device = str(engine.target.model.device)
    grid = grid or default_grid(device)
    with_draft = engine.draft is not None
    # n-gram drafts take no constraint (GenerationConfig.validate refuses the pair)
    ngram = cfg.constraint is None
    settings = grid.settings(min_particles, particles, draft_tokens, with_draft, ngram)
    key = cost_key(engine, grid.context)
    path = cache_file(key)
    record = CostRecord() if remeasure else read_costs(path, key)
    acc_key = sampling_key(cfg) + (calibration.key if calibration is not None else "")
    if calibration is None:  # the built-in prompts, the grid's budget
        each = max(2, grid.acceptance_tokens // len(ACCEPTANCE_PROMPTS))
        calibration = Calibration(ACCEPTANCE_PROMPTS, each)
    others = None if remeasure else path.parent.parent  # remeasure: measure everything here
    acceptance, source = (
        _known_acceptance(record, key, acc_key, pair_stats, others, len(calibration.prompts))
        if with_draft
        else (None, None)
    )
    copied = acceptance is not None and pair_stats is None and source != "cached"
    if copied:  # the same files' measurement on another machine: the pair's, kept here too
        record.acceptance[acc_key] = acceptance
    measure_acc = with_draft and acceptance is None
    to_measure = calibration if measure_acc else None
    measured = _measure_missing(engine, cfg, grid, settings, record, to_measure, acc_key, path, log)
    if measured or copied:
        write_costs(path, key, record)
    if measure_acc:
        acceptance, source = record.acceptance[acc_key], "measured now"
    costs = record.forward_costs(acceptance)
    predictions = tuple(predict_all(settings, costs, cfg.shared_rows, cfg.ess_threshold))
    pick = dict(
        min_particles=min_particles, particles=particles, draft_tokens=draft_tokens,
        min_ess=min_ess, default=DEFAULT_SMC if device == "cpu" else None,
    )  # fmt: skip
    picks = {
        c: choose(predictions, c, tie=tie, **pick)
        for c in tuned_choices()
        if with_draft or not c.needs_draft  # smc: not without a draft model
    }
    return Tuning(
        predictions=predictions,
        picks=picks,
        min_particles=min_particles,
        min_ess=min_ess,
        costs=costs,
        acceptance=acceptance,
        key=key,
        cache_path=path,
        measured_seconds=measured,
        calibration=calibration,
        acceptance_key=acc_key,
        acceptance_source=source,
    )


def _known_acceptance(
    record: CostRecord,
    key: dict[str, Any],
    acc_key: str,
    pair_stats: PairStats | None,
    root: Path | None,
    prompts: int,
) -> tuple[dict[str, Any] | None, str | None]:
    """The pair's acceptance measurement at ``acc_key`` and where it comes from, without
    measuring: ``pair_stats``, this machine's cache (``"cached"``), or the cache of the same
    files elsewhere under ``root`` (None: not searched); ``(None, None)`` when none holds a
    complete one (measured on at least ``prompts`` prompts)."""
    if pair_stats is not None:
        where = f"{pair_stats.source} ({pair_stats.pair}, measured on {pair_stats.measured_on})"
        return pair_stats.for_sampling(acc_key), where
    if complete(record.acceptance.get(acc_key), prompts):
        return record.acceptance[acc_key], "cached"
    found = find_cached_acceptance(key, acc_key, prompts, root) if root is not None else None
    if found is not None:
        return found[0], f"the same files' cache on {found[1]}"
    return None, None


def _measure_missing(
    engine: TunablePair,
    cfg: GenerationConfig,
    grid: TuningGrid,
    settings: list[Setting],
    record: CostRecord,
    missing_acceptance: Calibration | None,
    acc_key: str,
    path: Path,
    log: Callable[[str], None] | None,
) -> float:
    """Measure into ``record`` what ``settings`` need and it lacks (the acceptance statistics
    at ``acc_key`` on the prompts of ``missing_acceptance``, unless None); seconds spent (0:
    none)."""
    want_target, want_draft = shapes(settings)
    missing_target = want_target - record.target.keys()
    missing_draft = want_draft - record.draft.keys()
    costs = bool(missing_target or missing_draft)
    if not costs and missing_acceptance is None:
        return 0.0
    if log is not None:
        what = ["this machine's forward costs of the model pair"] if costs else []
        if missing_acceptance is not None:
            what.append(f"the pair's acceptance on {missing_acceptance.describe()}")
        hint = " (about a minute on a CPU)" if costs else ""
        log(
            f"measuring {' and '.join(what)} once{hint}; cached in {path} (delete it to "
            "measure again)"
        )
    t0 = time.perf_counter()
    if missing_target:
        timed = measure_forwards(engine.target, missing_target, grid.reps, grid.context)
        record.add_timings("target", timed)
    if missing_draft:
        timed = measure_forwards(engine.draft, missing_draft, grid.reps, grid.context)
        record.add_timings("draft", timed)
    if missing_acceptance is not None:
        cal = missing_acceptance
        acc = measure_acceptance(
            engine, cfg, grid.acceptance_draft_tokens, cal.new_tokens, cal.prompts
        )
        record.acceptance[acc_key] = asdict(acc)
    return max(time.perf_counter() - t0, 1e-9)
