"""Predicted against measured ESS of SMC-SD settings (the fidelity floor's check).

Reads a ``smcspec bench`` run (``runs.jsonl``: each SMC-SD request's stats) and the tuner's
cached per-token log-weight quantiles of the same pair and sampling settings, and writes one
row per setting: the predicted ESS after a round that starts from equal weights
(:func:`smcspec.tuning.predict.predicted_ess`) beside the measured ``mean_round_ess`` (the
same quantity, averaged over such rounds of each request), the measured mean and minimum
ESS over all rounds, the share of degenerate rounds (ESS < 1.1) and the median tokens/s.

Usage:
  smcspec bench --methods smc --grid "N=4,8;K=2,4,8" --prompts 4 --no-roofline \
      --out docs/benchmarks/fidelity-floor/bench
  python benchmarks/ess_check.py docs/benchmarks/fidelity-floor/bench/runs.jsonl \
      --out docs/benchmarks/fidelity-floor/ess-check.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from smcspec.models.loading import cache_root
from smcspec.tuning.predict import predicted_ess


def _quantiles(costs_dir: Path) -> tuple[list[float], str]:
    """The log-weight quantiles of the one llamacpp cost file that has them."""
    for path in sorted(costs_dir.glob("*.json")):
        data = json.loads(path.read_text())
        for key, acc in data.get("acceptance", {}).items():
            if acc.get("log_weight_quantiles"):
                return acc["log_weight_quantiles"], f"{path.name} ({key})"
    raise SystemExit(f"no measured log-weight quantiles under {costs_dir}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", help="runs.jsonl of a smcspec bench run with smc settings")
    ap.add_argument("--costs", default=None, help="cost cache folder (default: the user's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    quantiles, source = _quantiles(Path(args.costs) if args.costs else cache_root() / "costs")
    by: dict[str, list[dict]] = defaultdict(list)
    for line in Path(args.runs).read_text().splitlines():
        rec = json.loads(line)
        if rec["method"].startswith("smc-"):
            by[rec["method"]].append(rec)
    lines = [
        "| setting | predicted ESS after a round | measured (rounds begun with equal weights) "
        "| mean ESS, all rounds | min ESS | degenerate rounds | median tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in sorted(by, key=lambda m: tuple(int(x[1:]) for x in m.split("-")[1:])):
        recs = by[name]
        n, k = (int(x[1:]) for x in name.split("-")[1:])
        st = [r["stats"] for r in recs]
        fresh = statistics.mean(s["mean_round_ess"] for s in st)
        rounds = sum(s["rounds"] for s in st)
        degenerate = sum(s["degenerate_rounds"] for s in st)
        lines.append(
            f"| {name} | {predicted_ess(n, k, quantiles):.2f} | {fresh:.2f} | "
            f"{statistics.mean(s['mean_ess'] for s in st):.2f} | "
            f"{min(s['min_ess'] for s in st):.2f} | {degenerate}/{rounds} | "
            f"{statistics.median(r['tokens_per_second'] for r in recs):.2f} |"
        )
    report = (
        f"Log-weight quantiles: {source}. Measured: {len(by)} settings, "
        f"{sum(len(v) for v in by.values())} requests from `{args.runs}`; each measured column "
        "is the mean over that setting's requests.\n\n" + "\n".join(lines) + "\n"
    )
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
