"""Does the tuner choose the same way twice? Fresh tunings of the default pair on one machine.

Each repetition measures everything again (``tune(engine, remeasure=True)``: the forward
costs and the sd runs that give alpha and the log-weights) and records what ``--method smc``
without -N/-K and ``--method auto`` choose, under two rules, side by side:

- ``pooled``: today's tuner (:data:`~smcspec.tuning.measure.ACCEPTANCE_PROMPTS` pooled, and
  the documented default N=8 K=2 kept unless another is predicted faster by more than
  :data:`~smcspec.tuning.predict.CHOICE_MARGIN`);
- ``one prompt``: the tuner before (one prompt, 128 tokens, the fastest setting that meets
  the floors), reproduced by measuring on the first prompt only and choosing with no default.

The two rules alternate repetition by repetition. Reported per repetition: each rule's
choices, and the predicted tokens/s and ESS of every smc setting near the floor. Also
reported: the spread (max / min - 1) of each setting's predicted tokens/s over the
repetitions, which is the noise :data:`CHOICE_MARGIN` must exceed.

  python benchmarks/tuner_stability.py --reps 3 --out docs/benchmarks/tuner-stability/README.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import smcspec.tuning.measure as measure
from smcspec import Engine
from smcspec.config import DEFAULT_MIN_ESS
from smcspec.tuning import choose, default_grid, tune
from smcspec.tuning.cache import cpu_model
from smcspec.tuning.predict import CHOICE_MARGIN, DEFAULT_SMC


def one_tuning(engine: Engine, rule: str) -> dict:
    """A fresh tuning under ``rule`` (``pooled`` or ``one prompt``): choices and predictions."""
    prompts = measure.ACCEPTANCE_PROMPTS
    grid = default_grid("cpu")
    if rule == "one prompt":
        measure.ACCEPTANCE_PROMPTS = prompts[:1]
        grid = replace(grid, acceptance_tokens=128)
    try:
        t0 = time.perf_counter()
        t = tune(engine, min_particles=4, remeasure=True, grid=grid)
        seconds = time.perf_counter() - t0
    finally:
        measure.ACCEPTANCE_PROMPTS = prompts
    default = None if rule == "one prompt" else DEFAULT_SMC
    pick = dict(min_particles=4, min_ess=DEFAULT_MIN_ESS, default=default)
    smc = choose(t.predictions, "smc", **pick)
    auto = choose(t.predictions, "auto", **pick)
    preds = {p.setting.name: (p.tokens_per_second, p.ess) for p in t.predictions}
    return {"rule": rule, "smc": smc.setting.name, "auto": auto.setting.name,
            "alpha": t.acceptance["alpha"], "seconds": seconds, "preds": preds}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = Engine.load(backend="llamacpp")
    runs = []
    for r in range(args.reps):
        for rule in ("pooled", "one prompt") if r % 2 == 0 else ("one prompt", "pooled"):
            run = one_tuning(engine, rule)
            runs.append(run)
            line = f"rep {r} {rule}: smc {run['smc']}, auto {run['auto']}"
            print(f"{line}, alpha {run['alpha']:.3f}, {run['seconds']:.0f} s", file=sys.stderr)
    report = _report(args, runs)
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)
    return 0


def _report(args, runs: list[dict]) -> str:
    lines = [
        "# Tuner stability: fresh tunings of the default pair",
        "",
        f"{date.today()}, {cpu_model()} ({os.cpu_count()} CPUs), llamacpp backend, default "
        f"pair; {args.reps} repetitions of each rule, alternated; every tuning measured afresh "
        "(`remeasure=True`). min_particles 4, min_ess "
        f"{DEFAULT_MIN_ESS:g}; margin {CHOICE_MARGIN:g} for the pooled rule.",
        "",
        "Command: `python benchmarks/tuner_stability.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "| rep | rule | smc chooses | auto chooses | alpha | seconds to tune |",
        "|---|---|---|---|---:|---:|",
    ]
    for i, r in enumerate(runs):
        lines.append(f"| {i // 2} | {r['rule']} | {r['smc']} | {r['auto']} | "
                     f"{r['alpha']:.3f} | {r['seconds']:.0f} |")  # fmt: skip
    lines += ["", "Predicted tokens/s (and ESS after a round) of the smc settings:", ""]
    names = [n for n in runs[0]["preds"] if n.startswith("smc")]
    lines += ["| setting | " + " | ".join(f"{r['rule']} {i // 2}" for i, r in enumerate(runs))
              + " | spread, pooled | spread, one prompt |",
              "|---|" + "---:|" * (len(runs) + 2)]  # fmt: skip
    for n in names:
        cells = []
        for r in runs:
            tps, ess = r["preds"][n]
            cells.append(f"{tps:.2f} ({ess:.2f})" if ess is not None else f"{tps:.2f}")
        spreads = []
        for rule in ("pooled", "one prompt"):
            v = [r["preds"][n][0] for r in runs if r["rule"] == rule]
            spreads.append(f"{max(v) / min(v) - 1:.1%}")
        lines.append(f"| {n} | " + " | ".join(cells) + " | " + " | ".join(spreads) + " |")
    for rule in ("pooled", "one prompt"):
        v = [r["smc"] for r in runs if r["rule"] == rule]
        same = "the same choice every time" if len(set(v)) == 1 else f"choices {sorted(set(v))}"
        lines.append("")
        secs = statistics.median(r["seconds"] for r in runs if r["rule"] == rule)
        lines.append(f"- {rule}: smc {same} ({', '.join(v)}); median tuning time {secs:.0f} s.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
