"""GSM8K, first 400: each setting's accuracy, mean seconds per answer and median tokens/s by
range of questions (the per-VM and per-range figures of ``docs/benchmarks/gsm8k-sc-400``).

Questions 0-293 were answered on a Zen 5 EPYC VM and 294-399 on an AVX2 one; 100-399 are the
questions after the first 100 of ``gsm8k-steering``; 369-399 the last 31. Reads the run's
``results.jsonl`` (by default the committed one, found from this file's place, so the script
runs from any directory) and prints one line per range and setting.

  python benchmarks/studies/gsm8k_sc_400_splits.py > docs/benchmarks/gsm8k-sc-400/splits.txt
"""

from __future__ import annotations

import argparse
import json
import statistics as st
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "benchmarks" / "gsm8k-sc-400" / "results.jsonl"
RANGES = [(0, 294), (294, 400), (100, 400), (369, 400)]
METHODS = ["ar", "smc-n8-k2", "ar-greedy", "ar-sc-n4", "smc-n8-k2-reward-vote"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="an eval's results.jsonl")
    args = ap.parse_args()
    recs = [json.loads(line) for line in args.results.read_text().splitlines() if line]
    for lo, hi in RANGES:
        for m in METHODS:
            rs = [
                r for r in recs if r["method"] == m and lo <= int(r["prompt_id"].split("-")[1]) < hi
            ]
            print(
                f"q {lo}-{hi - 1} {m}: right {100 * st.mean(r['correct'] for r in rs):.1f}%, "
                f"mean s/answer {st.mean(r['seconds'] for r in rs):.1f}, "
                f"median tokens/s {st.median(r['tokens_per_second'] for r in rs):.1f}"
            )


if __name__ == "__main__":
    main()
