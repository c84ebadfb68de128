"""Throughput on a serving-like workload: tokens/s and time to first token per request.

Every method decodes every prompt once, one request at a time; the methods alternate on
each prompt and their order rotates from prompt to prompt, so slow drifts of the machine
(thermal, other load) fall on all methods alike. Per request we record the wall seconds
from the start of prefill to the last token, tokens/s (new tokens / those seconds) and the
time to first token (TTFT: until the first streamed text; for SMC-SD that is the first
token all particles share, the first one a streaming client can be sent) and the longest gap
between two streamed pieces (what a streaming client waits at most once the answer has
started: SMC-SD streams what every particle holds, so a long disagreement is one long gap).
Reported: medians
per method, the ratio of median tokens/s to ``ar``'s, and for each SMC-SD setting the
roofline prediction (:mod:`smcspec.eval.roofline`) beside the measured ratio.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from smcspec.decoding.labels import BASELINE_LABEL
from smcspec.decoding.output import hit_token_cap
from smcspec.decoding.registry import decoder_for
from smcspec.engine import Engine
from smcspec.errors import ConfigError
from smcspec.eval.harness import MethodSpec, answer_stop_ids
from smcspec.eval.report import cap_counts, format_capped
from smcspec.eval.roofline import predicted_speedup, smc_forward_costs
from smcspec.input_files import loads_bounded, read_text_file

__all__ = [
    "load_bench_speeds",
    "roofline_rows",
    "run_bench",
    "summarize_bench",
    "write_bench_report",
]


def run_bench(
    engine: Engine,
    prompts: list[str],
    specs: list[MethodSpec],
    seed: int = 0,
    warmup: bool = True,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Decode each prompt (a user message, chat template applied) with each method.

    Prompt ``i`` uses seed ``seed + i`` for every method (paired) and visits the methods
    starting at ``specs[i % len(specs)]``. With ``warmup``, each method first decodes a
    short prompt untimed (first calls allocate memory and pick kernels).

    Returns:
        one record per (prompt, method): ``prompt``, ``method``, ``prompt_tokens``,
        ``new_tokens``, ``max_new_tokens``, ``hit_cap`` (cut by the budget, see
        :func:`smcspec.decoding.output.hit_token_cap`; ``None`` when the config ignores EOS,
        since then every request runs to the budget), ``seconds``, ``tokens_per_second``,
        ``ttft_seconds`` (``None`` if nothing was streamed), ``max_gap_seconds`` (the longest
        wait between two streamed token batches; ``None`` with fewer than two),
        ``max_burst_tokens`` (the most tokens streamed at once) and the decoder's ``stats``.
    Raises:
        ConfigError, ContextLengthError: from :meth:`Engine.generate`.
    """
    if warmup:
        for s in specs:
            engine.generate("Hello", replace(s.config, seed=seed, max_new_tokens=4))
    records = []
    total = len(prompts) * len(specs)
    with tqdm(total=total, desc="bench", unit="request", disable=not progress) as bar:
        for i, text in enumerate(prompts):
            ids = engine.encode(text)
            order = specs[i % len(specs) :] + specs[: i % len(specs)]
            for s in order:
                first: list[float] = []

                def on_text(piece: str, first: list[float] = first) -> None:
                    if not first and piece:
                        first.append(time.perf_counter())

                cfg = replace(s.config, seed=seed + i)
                t0 = time.perf_counter()
                r = engine.generate(ids, cfg, on_text=on_text)
                capped = (
                    None
                    if cfg.ignore_eos
                    else hit_token_cap(
                        r.token_ids, cfg.max_new_tokens, answer_stop_ids(engine, cfg)
                    )
                )
                records.append(
                    {
                        "prompt": i,
                        "method": s.name,
                        "prompt_tokens": len(ids),
                        "new_tokens": r.new_tokens,
                        "max_new_tokens": cfg.max_new_tokens,
                        "hit_cap": capped,
                        "seconds": round(r.seconds, 4),
                        "tokens_per_second": round(r.tokens_per_second, 3),
                        "ttft_seconds": round(first[0] - t0, 4) if first else None,
                        "max_gap_seconds": (
                            round(r.max_gap_s, 4) if r.max_gap_s is not None else None
                        ),
                        "max_burst_tokens": r.max_burst,
                        "stats": {k: v for k, v in r.stats.items() if k != "seed"},
                        "text": r.text,
                    }
                )
                bar.update(1)
    return records


def load_bench_speeds(path: str | Path) -> dict[str, float]:
    """Median tokens/s per method of a bench ``runs.jsonl``.

    Raises:
        ConfigError: the file cannot be read with bounds
            (:func:`smcspec.input_files.read_text_file`) or holds no bench records.
    """
    p = Path(path)
    text = read_text_file(p, "the bench runs file")
    try:
        records = [loads_bounded(line, f"{p}") for line in text.splitlines() if line.strip()]
        rows = summarize_bench(records)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{p} is not a bench runs.jsonl: {exc}") from exc
    if not rows:
        raise ConfigError(f"{p} holds no bench records")
    return {r["method"]: r["median_tokens_per_second"] for r in rows}


def summarize_bench(
    records: list[dict[str, Any]], baseline: str = BASELINE_LABEL
) -> list[dict[str, Any]]:
    """Per method: request count, median/min/max tokens/s, median TTFT, the ratio of the
    median tokens/s to the ``baseline`` method's (``None`` without a baseline), and the
    requests cut by the token budget (:func:`smcspec.eval.report.cap_counts`; ``capped`` is
    None for runs that ignore EOS and for older records), and smc's mean distinct fraction
    of the target's rows (``distinct_rows``, :mod:`smcspec.backends.shared_rows`; None for
    other methods and older records), and the median and 90th percentile of each request's
    longest gap between streamed tokens (``median_max_gap_seconds``, ``p90_max_gap_seconds``;
    None for older records)."""
    by_method: dict[str, list[dict]] = {}
    for r in records:
        by_method.setdefault(r["method"], []).append(r)
    base = by_method.get(baseline)
    base_med = statistics.median(r["tokens_per_second"] for r in base) if base else None
    rows = []
    for method, recs in by_method.items():
        tps = [r["tokens_per_second"] for r in recs]
        ttft = [r["ttft_seconds"] for r in recs if r["ttft_seconds"] is not None]
        gaps = sorted(r["max_gap_seconds"] for r in recs if r.get("max_gap_seconds") is not None)
        med = statistics.median(tps)
        distinct = [
            r["stats"]["distinct_rows_target"]
            for r in recs
            if "distinct_rows_target" in r.get("stats", {})
        ]
        rows.append(
            {
                "method": method,
                "requests": len(recs),
                "median_tokens_per_second": med,
                "min_tokens_per_second": min(tps),
                "max_tokens_per_second": max(tps),
                "median_ttft_seconds": statistics.median(ttft) if ttft else None,
                "ratio_vs_baseline": med / base_med if base_med else None,
                "distinct_rows": statistics.mean(distinct) if distinct else None,
                "median_max_gap_seconds": statistics.median(gaps) if gaps else None,
                "p90_max_gap_seconds": _quantile(gaps, 0.9) if gaps else None,
                **cap_counts(recs),
            }
        )
    return rows


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values``, linear between order statistics (numpy's
    default, "type 7" of Hyndman & Fan 1996)."""
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def roofline_rows(
    engine: Engine, specs: list[MethodSpec], rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """For each SMC-SD spec: measured forward costs, the memory-bound and measured-cost
    predictions of its speed-up over AR, and the measured ratio from ``rows`` (the output
    of :func:`summarize_bench`). Needs the engine's draft model."""
    measured = {r["method"]: r["ratio_vs_baseline"] for r in rows}
    out = []
    for s in specs:
        decoder = decoder_for(s.config)
        if not decoder.particles:
            continue
        n, k = s.config.particles, s.config.draft_tokens
        costs = smc_forward_costs(engine.target.model, engine.draft.model, n, k, decoder)
        out.append(
            {
                "method": s.name,
                **predicted_speedup(costs, n, k, decoder),
                "measured": measured.get(s.name),
                "costs": costs,
            }
        )
    return out


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def _throughput_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown table of :func:`summarize_bench` rows; a capped column only when some run
    honoured EOS (runs that ignore it, the default, run every request to the budget)."""
    show_capped = any(r.get("capped_known") for r in rows)
    show_gaps = any(r.get("median_max_gap_seconds") is not None for r in rows)
    lines = [
        "| method | requests | median tokens/s | min | max | median TTFT (s) | vs ar "
        "| distinct rows |"
        + (" median max gap (s) | p90 max gap (s) |" if show_gaps else "")
        + (" capped |" if show_capped else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|"
        + ("---:|---:|" if show_gaps else "")
        + ("---:|" if show_capped else ""),
    ]
    for r in rows:
        gaps = (f" {_fmt(r['median_max_gap_seconds'], '.2f')} | "
                f"{_fmt(r['p90_max_gap_seconds'], '.2f')} |")  # fmt: skip
        lines.append(
            f"| {r['method']} | {r['requests']} | {r['median_tokens_per_second']:.2f} | "
            f"{r['min_tokens_per_second']:.2f} | {r['max_tokens_per_second']:.2f} | "
            f"{_fmt(r['median_ttft_seconds'], '.2f')} | "
            f"{_fmt(r['ratio_vs_baseline'], '.2f', 'x')} | {_fmt(r.get('distinct_rows'), '.2f')} |"
            + (gaps if show_gaps else "")
            + (f" {format_capped({**r, 'n': r['requests']})} |" if show_capped else "")
        )
    return lines


def _roofline_lines(roofline: list[dict[str, Any]]) -> list[str]:
    """The roofline predictions beside the measured speed-ups, then the forward costs."""
    lines = [
        "SMC-SD speed-up over ar: roofline predictions (``smcspec.eval.roofline``, from "
        "median forward times measured on this machine) beside the measurement:",
        "",
        "| setting | c = draft/target cost | memory-bound (K+1)/((K+1)c+1) | "
        "from measured N-row forwards | measured |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in roofline:
        lines.append(
            f"| {r['method']} | {r['c']:.3f} | {r['memory_bound']:.2f}x | "
            f"{r['measured_costs']:.2f}x | {_fmt(r['measured'], '.2f', 'x')} |"
        )
    lines += ["", "Forward costs (median seconds):", ""]
    for r in roofline:
        costs = ", ".join(f"{k} {v:.4f}" for k, v in r["costs"].items())
        lines.append(f"- {r['method']}: {costs}")
    return lines


def _plot_throughput(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """Two bar panels per method: median tokens/s and median TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["method"] for r in rows]
    a1.bar(names, [r["median_tokens_per_second"] for r in rows])
    a1.set_ylabel("median tokens/s per request")
    a2.bar(names, [r["median_ttft_seconds"] or 0.0 for r in rows], color="tab:orange")
    a2.set_ylabel("median time to first token (s)")
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelrotation=45)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_bench_report(
    rows: list[dict[str, Any]],
    roofline: list[dict[str, Any]],
    out_dir: Path,
    title: str,
    note: str = "",
) -> Path:
    """Write ``summary.md`` (tables) and ``throughput.png`` (tokens/s and TTFT per method)
    under ``out_dir`` (created if missing); returns the path of ``summary.md``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}", "", note, "", *_throughput_table(rows)]
    if roofline:
        lines += ["", *_roofline_lines(roofline)]
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n")
    _plot_throughput(rows, title, out_dir / "throughput.png")
    return out_dir / "summary.md"
