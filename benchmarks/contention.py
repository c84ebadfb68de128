"""Decoding speed beside other CPU-bound processes: the llamacpp backend's fair share of the
CPU (``LlamaCppSettings.fair_share``) against fixed threads and raw llama-cpp-python.

Conditions: idle, then 1 (and optionally 2) competing processes running
``python -c "while True: pass"`` at the same priority. Systems, alternated run by run in
one process, on the default pair (llamacpp backend, physical cores as threads):
  ar-fair     smcspec ar, threads following the free cores (the default)
  ar-fixed    smcspec ar, every forward at the configured threads (before this change)
  smc-fair    smcspec SMC-SD N=8 K=2, fair share
  smc-fixed   the same, fixed threads
  raw         llama-cpp-python's ``Llama.create_completion`` on the same GGUF, same threads
Every run: the same chat prompt, ``--max-new-tokens`` tokens (EOS ignored), T = 0.7.
Reported: median tokens/s (new tokens / wall seconds, prefill included) per system and
condition, and each one's share of its own idle speed.

Usage:
  python benchmarks/contention.py --reps 2 --max-new-tokens 16 \
      --out docs/benchmarks/contention-cpu/README.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from smcspec import Engine, GenerationConfig
from smcspec.tuning.cache import machine_name

PROMPT = "Write a Python function that checks whether a number is prime."
SPIN = "while True: pass"


def competitors(n: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
    time.sleep(0.5)  # their interpreters' start
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--conditions", default="0,1,2", help="competing processes per condition")
    ap.add_argument("--systems", default="ar-fair,ar-fixed,smc-fair,smc-fixed,raw")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    systems = args.systems.split(",")
    engine = Engine.load()
    models = [engine.target.model, engine.draft.model]
    threads = models[0].threads
    raw = None
    if "raw" in systems:
        from llama_cpp import Llama

        raw = Llama(str(engine.target.path), n_threads=threads, n_ctx=2048, verbose=False)
    prompt_ids = engine.encode(PROMPT, chat=True)
    raw_prompt = engine.tokenizer.decode(prompt_ids)

    def run(system: str, rep: int) -> tuple[int, float]:
        if system == "raw":
            raw.reset()  # no prompt cache from the last run: prefill counted, as for ours
            t0 = time.perf_counter()
            out = raw.create_completion(
                raw_prompt, max_tokens=args.max_new_tokens, temperature=0.7, top_k=0,
                top_p=1.0, min_p=0.0, seed=rep, logit_bias={raw.token_eos(): -1e9},
            )  # fmt: skip
            return out["usage"]["completion_tokens"], time.perf_counter() - t0
        method = "ar" if system.startswith("ar") else "smc"
        for m in models:
            m.set_fair_share(system.endswith("fair"))
        cfg = GenerationConfig(
            method=method, particles=8, draft_tokens=2, max_new_tokens=args.max_new_tokens,
            temperature=0.7, ignore_eos=True, seed=rep,
        )  # fmt: skip
        r = engine.generate(prompt_ids, cfg)
        return r.new_tokens, r.seconds

    for s in systems:  # warm-up, idle
        run(s, 0)
    rows = []
    for cond in [int(c) for c in args.conditions.split(",")]:
        procs = competitors(cond)
        try:
            for rep in range(args.reps):
                order = systems[rep % len(systems) :] + systems[: rep % len(systems)]
                for s in order:
                    tokens, seconds = run(s, rep + 1)
                    row = dict(competing=cond, system=s, rep=rep, tokens=tokens,
                               seconds=round(seconds, 3), tokens_per_s=tokens / seconds,
                               threads_now=[m.threads_now for m in models])  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            stop(procs)
    med = {
        (c, s): statistics.median(
            r["tokens_per_s"] for r in rows if (r["competing"], r["system"]) == (c, s)
        )
        for c, s in {(r["competing"], r["system"]) for r in rows}
    }
    conds = sorted({c for c, _ in med})
    lines = [
        "# Decoding beside competing CPU-bound processes",
        "",
        f"{date.today()}, {machine_name('cpu')}, threads = {threads} "
        f"(the physical cores), default pair on the llamacpp backend, {args.max_new_tokens} "
        f"new tokens per run, T = 0.7, median of {args.reps} runs per cell, systems alternated "
        'run by run. A competitor is `python -c "while True: pass"` at the same priority. '
        "Command: `python benchmarks/contention.py " + " ".join(sys.argv[1:]) + "`.",
        "",
        "| system | "
        + " | ".join(f"{c} competing: tokens/s (share of idle)" for c in conds)
        + " |",
        "| --- | " + " | ".join("---:" for _ in conds) + " |",
    ]
    for s in systems:
        cells = []
        for c in conds:
            v = med.get((c, s))
            idle = med.get((0, s))
            share = f" ({v / idle:.0%})" if v is not None and idle else ""
            cells.append(f"{v:.2f}{share}" if v is not None else "-")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    report = "\n".join(lines) + "\n\nRows:\n\n```\n" + "\n".join(json.dumps(r) for r in rows)
    report += "\n```\n"
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
