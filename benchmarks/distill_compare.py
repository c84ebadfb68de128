"""Paired comparison of a fitted draft's eval records with the base draft's (issue 84).

Pairs records by item: the fitted draft's run of each method against the base draft's run of
the same method (same questions, seeds and settings) and against the baseline method (``ar``,
no draft), on the items every side has; prints a markdown table: right answers, exact McNemar
p (:func:`smcspec.eval.mcnemar_pvalue`), and the SMC-SD statistics reported beside (mean ESS,
resampling rate = all resamples / all rounds, tokens a round = all new tokens / all rounds,
pooled over the paired items: :func:`distill_report.smc_stats`).

  python benchmarks/distill_compare.py docs/benchmarks/distill-gsm8k/results.jsonl \\
      docs/benchmarks/gsm8k-gpu-settings/results.jsonl --methods smc-n4-k12,smc-n8-k8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from distill_report import smc_stats  # noqa: E402

from smcspec.eval import mcnemar_pvalue  # noqa: E402


def read(path: Path) -> dict[tuple[str, str], dict]:
    """``(method, item) -> record`` of a results file (the last record of a pair wins)."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out[(r["method"], r["item"])] = r
    return out


def right(r: dict) -> bool:
    """A GSM8K record's ``correct`` or a HumanEval record's ``passed``."""
    return bool(r["correct"] if "correct" in r else r["passed"])


def smc_stats_text(records: list[dict]) -> tuple[str, str, str]:
    """:func:`distill_report.smc_stats` to two decimals (``-`` where records lack them)."""
    if not all("mean_ess" in (r.get("stats") or {}) for r in records):
        return "-", "-", "-"
    return tuple(f"{x:.2f}" for x in smc_stats(records))


def compare(fitted: Path, base: Path, methods: list[str], baseline: str) -> str:
    """The markdown table of :mod:`this script <benchmarks.distill_compare>`."""
    f, b = read(fitted), read(base)
    rows = [
        "| method | items | fitted right | base right | "
        f"{baseline} right | p fitted vs base | p fitted vs {baseline} | "
        "ESS fitted / base | resampling rate fitted / base | tokens a round fitted / base |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for m in methods:
        items = sorted(i for (mm, i) in f if mm == m and (m, i) in b and (baseline, i) in f | b)
        if not items:
            rows.append(f"| {m} | 0 | | | | | | | | |")
            continue
        fr = [f[(m, i)] for i in items]
        br = [b[(m, i)] for i in items]
        ar = [(f | b)[(baseline, i)] for i in items]
        a, c, z = [right(r) for r in fr], [right(r) for r in br], [right(r) for r in ar]
        rows.append(
            f"| {m} | {len(items)} | {sum(a)} | {sum(c)} | {sum(z)} | "
            f"{mcnemar_pvalue(a, c):.3f} | {mcnemar_pvalue(a, z):.3f} | "
            + " | ".join(
                f"{x} / {y}" for x, y in zip(smc_stats_text(fr), smc_stats_text(br), strict=True)
            )
            + " |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("fitted", type=Path, help="the fitted draft's results.jsonl")
    ap.add_argument("base", type=Path, help="the base draft's results.jsonl")
    ap.add_argument("--methods", required=True, help="comma-separated settings, e.g. smc-n8-k8")
    ap.add_argument("--baseline", default="ar", help="the method both are also paired with")
    args = ap.parse_args()
    print(compare(args.fitted, args.base, args.methods.split(","), args.baseline))


if __name__ == "__main__":
    main()
