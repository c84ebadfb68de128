"""The predicted table of a :class:`~smcspec.tuning.tuner.Tuning`, as Markdown."""

from __future__ import annotations

from pathlib import Path

from smcspec.config import NGRAM_DRAFT_P_MIN
from smcspec.tuning.predict import NGRAM_MARGIN, Prediction
from smcspec.tuning.tuner import Tuning


def _model_name(identity: dict | None) -> str:
    return Path(identity["path"]).name if identity else "-"


def format_table(tuning: Tuning) -> str:
    """A Markdown paragraph (machine, models, alpha, cache) and one row per setting:
    method, N, K, tokens a round, round milliseconds, predicted tokens/s, ratio to ar's,
    smc's and multi-draft sd's predicted distinct-row fraction and tokens/s were every row
    computed, smc's predicted ESS (cut rounds: at the cut), and which setting ``--method
    auto`` and ``smc`` without -N/-K choose. Multi-draft sd is ``sd`` with an N; rounds cut
    where the ESS falls are ``smc (ess)``."""
    key = tuning.key
    ar = next(p for p in tuning.predictions if not p.setting.drafts)
    measured = (
        f"measured now in {tuning.measured_seconds:.1f} s"
        if tuning.measured_seconds
        else "read from the cache"
    )
    lines = [
        f"Predicted tokens/s from measured forward costs: {key['machine']}, "
        f"{key['threads']} threads, backend {key['backend']} ({key['dtype']}); target "
        f"{_model_name(key['target'])}, draft {_model_name(key['draft'])}. "
        f"{_acceptance_note(tuning)}. Costs {measured}: {tuning.cache_path}. Forwards only "
        "(sampling, Python and prefill time are not counted, so measured tokens/s are lower). "
        f"{_range_note(tuning)}",
        "",
        "| method | N | K | tokens/round | round ms | predicted tokens/s | range | vs ar "
        "| distinct rows | tokens/s, every row | predicted ESS after a round | chosen |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines += [_setting_row(p, tuning, ar.tokens_per_second) for p in tuning.predictions]
    if any(p.setting.ngram for p in tuning.predictions):
        lines += ["", NGRAM_NOTE]
    lines += ["", _frontier_note(tuning)]
    return "\n".join(lines) + "\n"


NGRAM_NOTE = (
    f"sd (ngram): n-gram drafts, priced at the gate's threshold (one drafted token accepted "
    f"with probability {NGRAM_DRAFT_P_MIN:g}): where that beats ar by more than "
    f"{NGRAM_MARGIN:.0%}, auto takes it in ar's place (a round the gate does not let draft "
    "is an ar step; text that copies its prompt runs faster)."
)


def _frontier_note(tuning: Tuning) -> str:
    """How multi-draft sd and cut rounds are predicted, or why they are not."""
    preds = tuning.predictions
    if tuning.acceptance is None:
        return "Multi-draft sd and SMC-SD rounds cut where the ESS falls: no draft model."
    if any(p.setting.chains for p in preds):
        multi = (
            "sd with N: multi-draft sd (exact, so no fidelity floor), tokens a round from the "
            "pair's measured tree acceptance anchored on alpha (smcspec.tuning.multi_draft)"
        )
    elif tuning.acceptance.get("log_weight_quantiles") is None:
        multi = "multi-draft sd: not predicted at temperature 0 (greedy runs as chain sd)"
    else:
        multi = (
            "multi-draft sd: not predicted (the pair statistics predate its tree acceptance; "
            "measure them again: --remeasure, or export them again)"
        )
    if any(p.setting.cut for p in preds):
        cut = (
            "smc (ess): rounds cut at the first drafted position whose ESS falls below "
            "kappa*N, tokens a round and the ESS at the cut simulated from the log-weights "
            "(the same --min-ess floor as block rounds)"
        )
    else:
        cut = "smc (ess): not predicted (no log-weights at temperature 0)"
    return f"{multi}. {cut}."


def _range_note(tuning: Tuning) -> str:
    """What the range column is, and what it does not cover."""
    c = tuning.costs
    parts = []
    if c.target_range is not None:
        parts.append("every forward at the slowest / fastest of its timed repetitions")
    if c.alpha_range is not None:
        low, high = c.alpha_range
        parts.append(f"alpha at the ends of its 95% interval [{low:.3f}, {high:.3f}]")
    if not parts:
        return "Range: not known (costs cached before ranges were kept; tune again to measure)."
    missing = (
        ""
        if c.target_range is not None
        else (" (the cached costs predate timing ranges: measure again for them)")
    )
    return (
        f"Range: the prediction with {' and '.join(parts)}{missing}; it shows one "
        "measurement's noise, not the drift between measurements made at different times "
        "(up to 31% between three fresh tunings on one idle machine, "
        "docs/benchmarks/tuner-stability/)."
    )


def _calibration(tuning: Tuning) -> str:
    cal = tuning.calibration
    return "" if cal is None or cal.source is None else f" on {cal.describe()}"


def _acceptance_note(tuning: Tuning) -> str:
    """Where the predictions' acceptance alpha and log-weight quantiles come from."""
    acc = tuning.acceptance
    if not acc:
        return "no draft model: ar and n-gram sd only"
    note = (
        f"sd acceptance alpha {acc['alpha']:.3f} (Leviathan et al.'s per-token alpha, from "
        f"{acc['accepted']} of {acc['drafted']} drafts accepted in {acc['rounds']} rounds of "
        f"an sd run, K={acc['draft_tokens']}, {acc['new_tokens']} tokens"
        f"{_calibration(tuning)}; {_source(tuning.acceptance_source)})"
    )
    if acc.get("log_weight_quantiles") is not None:
        q = acc["log_weight_quantiles"]
        note += (
            f"; smc's per-token log-weight on the same tokens: median {q[50]:.3f}, 1-99 % "
            f"[{q[1]:.2f}, {q[99]:.2f}] nats, from which each setting's ESS after a round is "
            f"simulated; fidelity floor --min-ess {tuning.min_ess:g} effective particles"
        )
    return note


def _source(source: str | None) -> str:
    if source in ("measured now", "cached"):
        return f"{source} on this machine"
    return f"from {source}" if source else "source not known"


def _setting_row(p: Prediction, tuning: Tuning, ar_tokens_per_second: float) -> str:
    """One table row: the setting, its predicted round and tokens/s, and why it is (not)
    chosen."""
    s = p.setting
    marks = [c.mark(tuning.min_particles) for c, pick in tuning.picks.items() if p == pick]
    if s.weighted and s.particles < tuning.min_particles:
        marks.append("below --min-particles")
    elif p.ess is not None and p.ess < tuning.min_ess:
        marks.append(f"below --min-ess {tuning.min_ess:g}")
    rows = s.weighted or s.chains  # N rows a round
    ess = "-" if p.ess is None else f"{p.ess:.2f} of {s.particles}"
    distinct = f"{p.distinct:.2f}" if rows else "-"
    every = f"{p.all_rows_tokens_per_second:.2f}" if rows else "-"
    n = str(s.particles) if rows else "-"
    r = p.tokens_per_second_range
    span = "-" if r is None else f"{r[0]:.2f}-{r[1]:.2f}"
    k = str(s.draft_tokens) if s.drafts else "-"
    method = f"{s.method} (ngram)" if s.ngram else f"{s.method} (ess)" if s.cut else s.method
    return (
        f"| {method} | {n} | {k} | {p.tokens_per_round:.2f} | "
        f"{p.round_seconds * 1e3:.1f} | {p.tokens_per_second:.2f} | {span} | "
        f"{p.tokens_per_second / ar_tokens_per_second:.2f}x | {distinct} | {every} | "
        f"{ess} | {', '.join(marks)} |"
    )
