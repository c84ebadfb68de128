"""How many different answers a vote had to choose from: SMC-SD's particles against n
independent ``ar`` samples.

Reads an eval run's records (``smcspec eval gsm8k|humaneval --out DIR``). For a ``-vote``
setting, ``vote.answers`` is the number of distinct answers (a GSM8K number, a behaviour of
code on the prompt's examples) among the particles that ended with weight; for best-of-n and
self-consistency (``ar-bon-nN``, ``ar-sc-nN``), ``distinct_answers`` is the same count among
the n samples (records written before that field existed are left out). Per setting: the
answers with one distinct answer, the mean count, how often the vote changed the drawn
answer's verdict, and for SMC-SD the share of target rows that were distinct over the request
(particles that are copies of one another after resampling share rows) and the median number
of resamplings.

If independent samples often disagree where the particles agree, the particles' agreement
comes from resampling (path degeneracy), not from a peaked distribution.

  python benchmarks/answer_diversity.py docs/benchmarks/gsm8k-steering \
      --out docs/benchmarks/gsm8k-steering/diversity.md
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

from smcspec.eval.results import ResultFile


def _count(r: dict) -> int | None:
    """Distinct answers the record's vote (or best-of-n / self-consistency) chose among."""
    if "vote" in r:
        return r["vote"]["answers"] if r["vote"] else 0
    return r.get("distinct_answers")


def _number(r: dict) -> int:
    """The item's index in task order (``gsm8k-12`` -> 12, ``HumanEval/12`` -> 12)."""
    return int(r["item"].replace("/", "-").rsplit("-", 1)[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="the eval's --out folder (results.jsonl)")
    ap.add_argument("--out", type=Path, default=None, help="write the Markdown table here")
    ap.add_argument("--first", type=int, default=None, help="only items 0 .. FIRST-1")
    args = ap.parse_args()
    # the last record of each id; a line the running eval is still writing is skipped
    records = ResultFile(args.run / "results.jsonl").records()
    if args.first is not None:
        records = [r for r in records if _number(r) < args.first]
    by_method: dict[str, list[dict]] = collections.defaultdict(list)
    for r in records:
        if _count(r) is not None:
            by_method[r["method"]].append(r)
    rows = [
        "| setting | answers | one distinct answer | mean distinct answers | vote changed the"
        " verdict (gained / lost) | distinct target rows (mean) | resamplings (median) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in sorted(by_method):
        rs = by_method[m]
        counts = [_count(r) for r in rs]
        one = sum(c == 1 for c in counts)
        voted = [r for r in rs if "vote" in r and "drawn_correct" in r]
        gained = sum(bool(r["correct"]) and not r["drawn_correct"] for r in voted)
        lost = sum(not r["correct"] and bool(r["drawn_correct"]) for r in voted)
        stats = [r.get("stats", {}) for r in rs]
        rows_share = [s["distinct_rows_target"] for s in stats if "distinct_rows_target" in s]
        resamples = [s["resamples"] for s in stats if "resamples" in s]
        rows.append(
            f"| {m} | {len(rs)} | {one} ({100 * one / len(rs):.0f}%) | "
            f"{statistics.mean(counts):.2f} | "
            + (f"{gained} / {lost}" if voted else "-")
            + " | "
            + (f"{statistics.mean(rows_share):.2f}" if rows_share else "-")
            + " | "
            + (f"{statistics.median(resamples):g}" if resamples else "-")
            + " |"
        )
    first = f", items 0-{args.first - 1}" if args.first is not None else ""
    lines = [
        f"# Distinct answers among particles and samples ({args.run.name}{first})",
        "",
        f"Command: `python benchmarks/answer_diversity.py {' '.join(sys.argv[1:])}`",
        "",
        "A vote's count is over the particles that ended with weight (N of them); best-of-n's "
        "and self-consistency's over their n independent samples. `answers`: records with the "
        "count (self-consistency and best-of-n records made before the field existed have "
        "none). Distinct target rows: the share of rows the target computed that were not "
        "copies of another particle's (1.0: no two particles alike).",
        "",
        *rows,
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
