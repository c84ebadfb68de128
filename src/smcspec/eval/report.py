"""Reports of accuracy runs: per-method summaries paired with a baseline, and ``summary.md``.

:func:`summarize` turns the records of a run (:mod:`smcspec.eval.harness`) into one row per
method: accuracy with its Wilson interval, answers cut by the token budget, the target's NLL,
and, paired with the baseline on the items both answered, the accuracy difference (bootstrap
and exact intervals, McNemar p, the verdict on the SMC-SD paper's 3-point margin), the NLL
difference (Wilcoxon) and capping. :func:`write_report` writes them as Markdown tables with a
tokens/s-vs-accuracy plot.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from smcspec.decoding.labels import BASELINE_LABEL, parse_label
from smcspec.eval.stats import (
    margin_verdict,
    mcnemar_pvalue,
    paired_bootstrap_diff,
    paired_exact_interval,
    pairs_for_half_width,
    wilcoxon_pvalue,
    wilson_interval,
)

MARGIN = 0.03  # the SMC-SD paper's fidelity claim: "within 3% of the target's accuracy"


def cap_counts(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """How many answers hit the new-token budget.

    Returns ``capped`` (records with ``hit_cap`` true; None if no record has the field),
    ``capped_known`` (records that have it) and ``capped_fraction`` (capped / known, None if
    none is known). Records written before the field existed count as unknown, not as
    uncapped.
    """
    known = [bool(r["hit_cap"]) for r in records if r.get("hit_cap") is not None]
    capped = sum(known) if known else None
    return {
        "capped": capped,
        "capped_known": len(known),
        "capped_fraction": capped / len(known) if known else None,
    }


def format_capped(row: dict[str, Any]) -> str:
    """``"3/16"`` (capped of all answers), ``"3/12 (4 unknown)"`` when some records predate
    the ``hit_cap`` field, ``"-"`` when none has it."""
    known, n = row.get("capped_known", 0), row["n"]
    if not known:
        return "-"
    text = f"{row['capped']}/{known}"
    return text if known == n else f"{text} ({n - known} unknown)"


def budget_note(records: list[dict[str, Any]], configured: int) -> str:
    """``"max_new_tokens 512"``: the budget the records were generated with (several values
    if a resumed run changed it); records that do not store it (written before the field
    existed) are counted and ``configured`` (this command's budget) is named beside them."""
    stored = sorted({int(r["max_new_tokens"]) for r in records if "max_new_tokens" in r})
    unknown = sum(1 for r in records if "max_new_tokens" not in r)
    if not stored and not unknown:
        return f"max_new_tokens {configured}"
    parts = [f"max_new_tokens {', '.join(map(str, stored))}"] if stored else []
    if unknown:
        parts.append(
            f"max_new_tokens of {unknown} older answers not stored (this command's: {configured})"
        )
    return "; ".join(parts)


def machines_note(records: list[dict[str, Any]]) -> str:
    """Which machines generated the records, with counts (records written before the field
    existed are counted apart), and a warning that tokens/s pools them when there are several;
    ``""`` when every record names one machine."""
    counts: dict[str, int] = {}
    for r in records:
        key = r.get("machine", "")
        counts[key] = counts.get(key, 0) + 1
    if len(counts) == 1 and "" not in counts:
        return ""
    parts = [f"{m} ({n})" for m, n in sorted(counts.items()) if m]
    if "" in counts:
        parts.append(f"not stored, written before the field existed ({counts['']})")
    return (
        "Records by machine: " + "; ".join(parts) + ". Median tokens/s pools the records of "
        "all of them; accuracy and NLL do not depend on the machine."
    )


def _by_method(records: Iterable[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{method: {item: record}}`` (a later record of the same method and item wins)."""
    by_method: dict[str, dict[str, dict[str, Any]]] = {}
    for rec in records:
        by_method.setdefault(rec["method"], {})[rec["item"]] = rec
    return by_method


def summarize(
    records: list[dict[str, Any]], baseline: str = BASELINE_LABEL
) -> list[dict[str, Any]]:
    """Accuracy with a 95% Wilson interval per method, the answers cut by the token budget
    (:func:`cap_counts`), the target NLL's quantiles, and, on the items shared with
    ``baseline``: the paired accuracy difference (bootstrap 95% interval, exact McNemar p,
    discordant counts, the verdict on "within :data:`MARGIN` of the baseline"
    (:func:`~smcspec.eval.stats.margin_verdict`) and the pairs a +-MARGIN interval would need
    at the observed spread), the paired NLL difference (bootstrap 95% interval, Wilcoxon
    signed-rank p) and capping by the budget, paired (:func:`_paired_budget`). A setting
    that answers by vote (records with ``drawn_correct``) also gets a row ``<method>
    (drawn)``: the same runs scored on the single drawn answer."""
    by_method = _by_method(records)
    for rec in records:
        if "drawn_correct" in rec:
            drawn = {**rec, "method": f"{rec['method']} (drawn)", "correct": rec["drawn_correct"]}
            by_method.setdefault(drawn["method"], {})[rec["item"]] = drawn
    base = by_method.get(baseline, {})
    rows = []
    for setting, recs in by_method.items():  # eval's setting names (smc-n8-k2-vote, ...)
        correct = [bool(r["correct"]) for r in recs.values()]
        low, high = wilson_interval(sum(correct), len(correct))
        tps = sorted(r["tokens_per_second"] for r in recs.values())
        row = {
            "method": setting,
            "n": len(correct),
            "correct": sum(correct),
            "accuracy": sum(correct) / len(correct),
            "ci_low": low,
            "ci_high": high,
            "median_tokens_per_second": tps[len(tps) // 2],
            "mean_seconds": float(np.mean([r["seconds"] for r in recs.values()])),
            **cap_counts(recs.values()),
        }
        nll = [r["target_nll"] for r in recs.values() if r.get("target_nll") is not None]
        if nll:
            q = np.quantile(nll, [0.1, 0.5, 0.9])
            row.update(
                nll_mean=float(np.mean(nll)),
                nll_p10=float(q[0]),
                nll_median=float(q[1]),
                nll_p90=float(q[2]),
            )
        if setting != baseline:
            row.update(_paired_accuracy(base, recs), **_paired_nll(base, recs))
            row.update(_paired_budget(base, recs))
        rows.append(row)
    return rows


def _pairs(base: dict[str, dict], recs: dict[str, dict], key: str) -> tuple[list, list]:
    """``record[key]`` of the baseline and of the method on the items both have a value for."""
    shared = sorted(
        i for i in set(recs) & set(base) if None not in (recs[i].get(key), base[i].get(key))
    )
    return [base[i][key] for i in shared], [recs[i][key] for i in shared]


def _paired_accuracy(base: dict[str, dict], recs: dict[str, dict]) -> dict[str, Any]:
    a, b = _pairs(base, recs, "correct")
    if len(a) < 2:
        return {}
    a, b = [bool(x) for x in a], [bool(y) for y in b]
    diff, dl, dh = paired_bootstrap_diff(a, b)
    lost = sum(x and not y for x, y in zip(a, b, strict=True))  # baseline right only
    gained = sum(y and not x for x, y in zip(a, b, strict=True))
    # no discordant pair: every bootstrap resample gives 0, an interval of one point that
    # says nothing about the margin (and no spread to plan from); with few, all one way,
    # the bootstrap never crosses 0: the verdict also needs the exact conditional interval
    seen = lost + gained > 0
    el, eh = paired_exact_interval(lost, gained, len(a))
    return {
        "paired_n": len(a),
        "diff_vs_baseline": diff,
        "diff_low": dl,
        "diff_high": dh,
        "mcnemar_p": mcnemar_pvalue(a, b),
        "lost": lost,
        "gained": gained,
        "exact_low": el,
        "exact_high": eh,
        "verdict": margin_verdict(min(dl, el), max(dh, eh), MARGIN) if seen else "not decidable",
        "pairs_for_margin": pairs_for_half_width(a, b, MARGIN) if seen else "-",
    }


def _paired_budget(base: dict[str, dict], recs: dict[str, dict]) -> dict[str, Any]:
    """Capping paired with the baseline (two exact samplers of the same target hit the budget
    equally often): answers capped only by the baseline, only by the method,
    by both, and the exact McNemar p; then accuracy on the items neither capped (a capped
    answer seldom holds a final one, so capping alone moves accuracy): lost/gained and its
    McNemar p; how many capped answers are right on each side; and the median difference in
    new tokens (method minus baseline) on the items neither capped. Items whose records
    predate ``hit_cap`` are left out."""
    shared = sorted(
        i
        for i in set(recs) & set(base)
        if None not in (recs[i].get("hit_cap"), base[i].get("hit_cap"))
    )
    if len(shared) < 2:
        return {}
    a = [bool(base[i]["hit_cap"]) for i in shared]
    b = [bool(recs[i]["hit_cap"]) for i in shared]
    neither = [i for i, x, y in zip(shared, a, b, strict=True) if not (x or y)]
    right_a = [bool(base[i]["correct"]) for i in neither]
    right_b = [bool(recs[i]["correct"]) for i in neither]
    cut_a = [i for i, x in zip(shared, a, strict=True) if x]
    cut_b = [i for i, y in zip(shared, b, strict=True) if y]
    length_diff = [recs[i]["new_tokens"] - base[i]["new_tokens"] for i in neither]
    return {
        "cap_paired_n": len(shared),
        "capped_baseline_only": sum(x and not y for x, y in zip(a, b, strict=True)),
        "capped_method_only": sum(y and not x for x, y in zip(a, b, strict=True)),
        "capped_both": sum(x and y for x, y in zip(a, b, strict=True)),
        "cap_mcnemar_p": mcnemar_pvalue(a, b),
        "uncapped_n": len(neither),
        "uncapped_lost": sum(x and not y for x, y in zip(right_a, right_b, strict=True)),
        "uncapped_gained": sum(y and not x for x, y in zip(right_a, right_b, strict=True)),
        "uncapped_mcnemar_p": mcnemar_pvalue(right_a, right_b) if neither else 1.0,
        "capped_right_baseline": (sum(bool(base[i]["correct"]) for i in cut_a), len(cut_a)),
        "capped_right_method": (sum(bool(recs[i]["correct"]) for i in cut_b), len(cut_b)),
        "uncapped_median_tokens_diff": float(np.median(length_diff)) if neither else None,
    }


def _paired_nll(base: dict[str, dict], recs: dict[str, dict]) -> dict[str, Any]:
    a, b = _pairs(base, recs, "target_nll")
    if len(a) < 2:
        return {}
    diff, dl, dh = paired_bootstrap_diff(a, b)
    return {
        "nll_paired_n": len(a),
        "nll_diff": diff,
        "nll_diff_low": dl,
        "nll_diff_high": dh,
        "nll_wilcoxon_p": wilcoxon_pvalue(a, b),
    }


def against_best_of_n(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """SMC-SD steered by a reward (settings whose label has ``-reward``,
    :mod:`smcspec.decoding.labels`) paired with every best-of-n setting of the same run
    (``ar-bon-nN``, reranked by the same reward), on the items both answered: the accuracy
    of each, the paired difference (steered minus
    best-of-n; bootstrap 95% interval, exact McNemar p, discordant counts) and the mean wall
    seconds per answer of each, whose ratio says whether the pair ran at matched time. A
    voting setting is scored on its vote, as in :func:`summarize`. Empty when the run has
    no such pair."""
    by_method = _by_method(records)
    labels = {m: parse_label(m) for m in by_method}  # None: a name that is no label
    steered = [m for m, label in labels.items() if label is not None and label.reward]
    best_of = [m for m, label in labels.items() if label is not None and label.best_of_n]
    rows = []
    for s in steered:
        for b in best_of:
            shared = sorted(set(by_method[s]) & set(by_method[b]))
            if len(shared) < 2:
                continue
            sr = {i: by_method[s][i] for i in shared}
            br = {i: by_method[b][i] for i in shared}
            row = {
                "method": s,
                "best_of_n": b,
                "accuracy": float(np.mean([bool(r["correct"]) for r in sr.values()])),
                "bon_accuracy": float(np.mean([bool(r["correct"]) for r in br.values()])),
                "seconds": float(np.mean([r["seconds"] for r in sr.values()])),
                "bon_seconds": float(np.mean([r["seconds"] for r in br.values()])),
            }
            rows.append({**row, **_paired_accuracy(br, sr)})
    return rows


def _best_of_n_table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        "SMC-SD steered by the reward against best-of-n reranked by the same reward, on the "
        "items both answered (diff: steered minus best-of-n, paired bootstrap 95% interval; "
        "lost/gained: items only best-of-n / only the steered setting answered right; time "
        "ratio: mean seconds per answer, steered over best-of-n, 1.0 = matched time):",
        "",
        "| steered | best-of-n | n | accuracy | best-of-n accuracy | diff (95% CI) "
        "| McNemar p | lost/gained | s/answer | best-of-n s/answer | time ratio |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['best_of_n']} | {r['paired_n']} | {100 * r['accuracy']:.1f}% "
            f"| {100 * r['bon_accuracy']:.1f}% | {100 * r['diff_vs_baseline']:+.1f} pts "
            f"({100 * r['diff_low']:+.1f}, {100 * r['diff_high']:+.1f}) | {r['mcnemar_p']:.3f} "
            f"| {r['lost']}/{r['gained']} | {r['seconds']:.1f} | {r['bon_seconds']:.1f} "
            f"| {r['seconds'] / r['bon_seconds']:.2f} |"
        )
    return lines


def write_report(
    rows: list[dict[str, Any]],
    out_dir: Path,
    title: str,
    note: str = "",
    speeds: dict[str, float] | None = None,
    baseline: str = BASELINE_LABEL,
    records: list[dict[str, Any]] | None = None,
) -> Path:
    """``summary.md`` (tables), ``pareto.png`` (tokens/s vs accuracy, 95% error bars) and
    ``accuracy-time.png`` (mean wall seconds per answer vs accuracy: what a setting buys for
    the time it takes, e.g. best-of-n against SMC-SD at matched time).

    ``speeds`` (method name -> tokens/s, e.g. medians of a ``smcspec bench`` run on the
    same machine) replaces the run's own per-answer medians on the plot's x axis and adds a
    column; methods missing from it are left off the plot. ``baseline`` names the method
    the rows were paired against (:func:`summarize`'s ``baseline``) in the tables' text.
    With ``records`` (the run's), reward-steered SMC-SD is also paired with the run's
    best-of-n settings (:func:`against_best_of_n`).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    tables = [
        *_accuracy_table(rows, speeds, baseline),
        *_best_of_n_table(against_best_of_n(records) if records else []),
        *_nll_table(rows, baseline),
        *_budget_table(rows, baseline),
    ]
    lines = [f"# {title}", "", note, "", *tables]
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    _pareto_plot(rows, speeds, title, out_dir / "pareto.png")
    _pareto_plot(rows, None, title, out_dir / "accuracy-time.png", per_second=True)
    return out_dir / "summary.md"


def _accuracy_table(
    rows: list[dict[str, Any]], speeds: dict[str, float] | None, baseline: str
) -> list[str]:
    m = f"{100 * MARGIN:g}"
    lines = [
        "capped: answers cut by the new-token budget (max_new_tokens reached without an end "
        'token), of all answers; "-" or "unknown": records written before this was stored.',
        "",
        f'"within {m} pts": the difference to {baseline} lies above -{m} points (met), below '
        "it (not met), or across it (not decidable) by the paired 95% interval shown: the "
        "paired-bootstrap one, widened to the exact interval conditional on the discordant "
        "pairs (Clopper-Pearson, as McNemar's test conditions) where that is wider, as when "
        "few discordant pairs all go one way (marked *); "
        f"pairs for +-{m}: how "
        "many paired questions an interval that narrow needs at the spread observed so far (a "
        f"planning figure). lost/gained: questions only {baseline} / only this method answered "
        "right.",
        "",
        "| method | n | accuracy | 95% CI | capped | median tokens/s | mean s/answer "
        f"| diff vs {baseline} (95% CI) | McNemar p | lost/gained | within {m} pts "
        f"| pairs for +-{m} |" + (" bench tokens/s |" if speeds else ""),
        "|---|---:|---:|---|---:|---:|---:|---|---:|---:|---|---:|" + ("---:|" if speeds else ""),
    ]
    for r in rows:
        if "diff_vs_baseline" in r:
            low, high, widened = _verdict_interval(r)
            paired = (
                f"{100 * r['diff_vs_baseline']:+.1f} pts ({100 * low:+.1f}, {100 * high:+.1f})"
                f"{'*' if widened else ''} | {r['mcnemar_p']:.3f} | {r['lost']}/{r['gained']}"
                f" | {r['verdict']} | {r['pairs_for_margin']}"
            )
        else:
            paired = "- | - | - | - | -"
        bench = ""
        if speeds:
            bench = f" {speeds[r['method']]:.2f} |" if r["method"] in speeds else " - |"
        lines.append(
            f"| {r['method']} | {r['n']} | {100 * r['accuracy']:.1f}% | "
            f"{100 * r['ci_low']:.1f}-{100 * r['ci_high']:.1f}% | {format_capped(r)} | "
            f"{r['median_tokens_per_second']:.2f} | {_seconds(r)} | {paired} |{bench}"
        )
    return lines


def _seconds(row: dict[str, Any]) -> str:
    return f"{row['mean_seconds']:.1f}" if "mean_seconds" in row else "-"


def _verdict_interval(row: dict[str, Any]) -> tuple[float, float, bool]:
    """The paired interval the margin verdict reads: the bootstrap one, widened to the exact
    one where that is wider (``exact_*`` absent in records summarised before it existed)."""
    low, high = row["diff_low"], row["diff_high"]
    el, eh = row.get("exact_low", low), row.get("exact_high", high)
    return min(low, el), max(high, eh), el < low or eh > high


def _nll_table(rows: list[dict[str, Any]], baseline: str) -> list[str]:
    if not any("nll_mean" in r for r in rows):
        return []
    lines = [
        "",
        f"Target NLL of the outputs (nats/token, temperature 1), and paired against {baseline} "
        "on the questions both answered: the mean difference (bootstrap 95% interval; "
        f"positive = less likely under the target than {baseline}'s answers) and the Wilcoxon "
        "signed-rank p:",
        "",
        "| method | mean | p10 | median | p90 | paired n "
        f"| diff vs {baseline} (95% CI) | Wilcoxon p |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in (r for r in rows if "nll_mean" in r):
        if "nll_diff" in r:
            paired = (
                f"{r['nll_paired_n']} | {r['nll_diff']:+.4f} ({r['nll_diff_low']:+.4f}, "
                f"{r['nll_diff_high']:+.4f}) | {r['nll_wilcoxon_p']:.3f}"
            )
        else:
            paired = "- | - | -"
        lines.append(
            f"| {r['method']} | {r['nll_mean']:.3f} | {r['nll_p10']:.3f} | "
            f"{r['nll_median']:.3f} | {r['nll_p90']:.3f} | {paired} |"
        )
    return lines


def _budget_table(rows: list[dict[str, Any]], baseline: str) -> list[str]:
    paired = [r for r in rows if "cap_paired_n" in r]
    if not paired:
        return []
    lines = [
        "",
        f"The token budget, paired against {baseline}: answers cut by it only for {baseline}, "
        "only for the method, for both (two exact samplers of the same target are cut equally "
        "often), with the exact McNemar p; then accuracy on the questions neither answer "
        "was cut on (a cut answer seldom holds a final one, so cutting alone moves accuracy); "
        f"right when cut: right answers among the cut ones, {baseline}'s and the method's; "
        f"length diff: the median of the method's new tokens minus {baseline}'s on the "
        "questions neither answer was cut on:",
        "",
        f"| method | paired n | capped: only {baseline} / only method / both | McNemar p "
        f"| neither capped: n | lost/gained | McNemar p | right when cut: {baseline} / method "
        "| length diff (tokens) |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in paired:
        (ra, na), (rb, nb) = r["capped_right_baseline"], r["capped_right_method"]
        diff = r["uncapped_median_tokens_diff"]
        lines.append(
            f"| {r['method']} | {r['cap_paired_n']} | {r['capped_baseline_only']} / "
            f"{r['capped_method_only']} / {r['capped_both']} | {r['cap_mcnemar_p']:.3f} | "
            f"{r['uncapped_n']} | {r['uncapped_lost']}/{r['uncapped_gained']} | "
            f"{r['uncapped_mcnemar_p']:.3f} | {ra} of {na} / {rb} of {nb} | "
            f"{'-' if diff is None else f'{diff:+g}'} |"
        )
    return lines


def _pareto_plot(
    rows: list[dict[str, Any]],
    speeds: dict[str, float] | None,
    title: str,
    path: Path,
    per_second: bool = False,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if per_second:
            x = r.get("mean_seconds")
        else:
            x = speeds.get(r["method"]) if speeds else r["median_tokens_per_second"]
        if x is None:
            continue
        err = [[r["accuracy"] - r["ci_low"]], [r["ci_high"] - r["accuracy"]]]
        ax.errorbar(x, r["accuracy"], yerr=err, fmt="o", capsize=3)
        ax.annotate(
            r["method"], (x, r["accuracy"]), textcoords="offset points", xytext=(5, 5), fontsize=8
        )
    if per_second:
        ax.set_xlabel("mean wall seconds per answer (all samples of best-of-n / votes)")
    else:
        ax.set_xlabel("median tokens/s per request" + (" (bench run)" if speeds else ""))
    ax.set_ylabel("accuracy (95% Wilson interval)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
