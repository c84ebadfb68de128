"""Banked against kept ended particles on the same GSM8K questions: reads a results file of
``smcspec eval gsm8k`` that holds ``smc-nN-kK`` (``finished_particles="bank"``) and
``smc-nN-kK-keep`` (the paper's rule) answers with the same per-question seeds, and writes,
per setting, the paired report of bank against keep (accuracy, McNemar, target NLL) on the
questions both answered, with ``ar`` on those questions beside them.

    python benchmarks/studies/finished_particles_paired.py \\
        --results docs/benchmarks/gsm8k-400/results.jsonl \\
        --out docs/benchmarks/finished-particles/gsm8k-paired
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from smcspec.eval import report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path("docs/benchmarks/gsm8k-400/results.jsonl"))
    ap.add_argument(
        "--out", type=Path, default=Path("docs/benchmarks/finished-particles/gsm8k-paired")
    )
    args = ap.parse_args()
    records = [json.loads(line) for line in args.results.read_text().splitlines() if line]
    methods = {r["method"] for r in records}
    for keep in sorted(m for m in methods if m.endswith("-keep")):
        bank = keep.removesuffix("-keep")
        if bank not in methods:
            continue
        answered = [{r["item"] for r in records if r["method"] == m} for m in (keep, bank)]
        shared = answered[0] & answered[1]
        mine = [r for r in records if r["method"] in (keep, bank, "ar") and r["item"] in shared]
        rows = report.summarize(mine, baseline=keep)
        rows.sort(key=lambda r: (r["method"] != keep, r["method"] != bank))
        note = (
            f"{len(shared)} GSM8K questions answered by both `{bank}` (ended particles banked) "
            f"and `{keep}` (the paper's rule: ended particles keep their weight), same "
            f"per-question seeds; `ar` on the same questions for reference (its row, too, is "
            f"paired against `{keep}`: its difference is keep vs ar with the sign flipped). "
            f"Records: "
            f"`{args.results}`. Command: `python benchmarks/studies/finished_particles_paired.py "
            f"--results {args.results} --out {args.out}`"
        )
        summary = report.write_report(rows, args.out / bank, f"{bank}: bank vs keep", note,
                                      baseline=keep)  # fmt: skip
        print(summary.read_text())


if __name__ == "__main__":
    main()
