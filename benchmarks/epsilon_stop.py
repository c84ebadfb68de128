"""Time to answer of the README's main command with and without the epsilon stop (issue 74).

The main command is ``smcspec generate PROMPT``: the default pair on llama.cpp, ``smc`` with
the setting the tuner chooses on this machine (no -N/-K), the bank rule, T = 0.7, the
model's end of turn or 1024 new tokens. Here the engine is loaded and the setting chosen
once (as the command does on every call, from the cached costs), then every prompt is
answered at each ``--epsilons`` value (``stop_epsilon``; 0 is off), the values' order
rotated from prompt to prompt, seed = the prompt's index, so that a prompt's runs share a
seed: a stopped run follows its unstopped run exactly up to where the running particles'
mass fell below epsilon. Measured per run: the decode's seconds (``result.seconds``, from the
prefill to the answer: what the user waits after the models are loaded), tokens, rounds,
whether the stop ended it.

Prompts: the README's prompt, then HumanEval's first problems to implement (signature and
docstring, ``benchmarks/ngram_drafts.py``'s ``complete`` workload), ``--prompts`` in all.

Resumable: records go to ``--out``/records.jsonl, one per (epsilon, prompt); a rerun skips
those present. ``--report`` writes ``--out``/README-table.md: per epsilon the median and p90
seconds over the prompts every epsilon has answered, and the paired ratios to epsilon 0.

Usage (a background run, on a machine with nothing else running):
  nohup nice -n 10 .venv/bin/python benchmarks/epsilon_stop.py --prompts 20 \\
      --out docs/benchmarks/epsilon-stop-cpu >> epsilon-stop.log 2>&1 &
  .venv/bin/python benchmarks/epsilon_stop.py --out docs/benchmarks/epsilon-stop-cpu --report
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from ngram_drafts import prompts as humaneval_prompts  # noqa: E402
from records import append_record, comma_list, read_records  # noqa: E402

from smcspec import Engine, GenerationConfig  # noqa: E402
from smcspec.tuning import tune  # noqa: E402

README_PROMPT = "Write a Python function that checks whether a number is prime."


def prompts(n: int) -> list[str]:
    """The README's prompt, then ``n - 1`` HumanEval problems to implement."""
    return [README_PROMPT] + (humaneval_prompts(n - 1, "complete") if n > 1 else [])


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    done = {(r["epsilon"], r["prompt"]) for r in read_records(path)}
    engine = Engine.load(threads=args.threads)
    base = GenerationConfig(method="smc", max_new_tokens=args.max_new_tokens)
    pick = tune(engine, base, log=lambda line: print(f"tune: {line}", flush=True)).pick("smc")
    cfg = pick.setting.apply(base).validate()
    print(f"setting: {pick.setting.name} (N={cfg.particles}, K={cfg.draft_tokens})", flush=True)
    epsilons = comma_list(args.epsilons, float)
    for i, text in enumerate(prompts(args.prompts)):
        order = epsilons[i % len(epsilons) :] + epsilons[: i % len(epsilons)]
        for eps in order:
            if (eps, i) in done:
                continue
            run_cfg = replace(cfg, stop_epsilon=eps, seed=i)
            t0 = time.perf_counter()
            result = engine.generate(text, run_cfg)
            wall = time.perf_counter() - t0
            s = result.stats
            rec = {
                "epsilon": eps, "prompt": i, "setting": pick.setting.name,
                "seconds": round(result.seconds, 3), "wall_seconds": round(wall, 3),
                "new_tokens": result.new_tokens, "rounds": s.get("rounds"),
                "stopped_early": bool(s.get("stopped_early", False)),
                "finish_reason": result.finish_reason, "text_head": result.text[:80],
            }  # fmt: skip
            append_record(path, rec)
            print(json.dumps(rec), flush=True)


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0]


def report(args: argparse.Namespace) -> str:
    recs = read_records(Path(args.out) / "records.jsonl")
    epsilons = sorted({r["epsilon"] for r in recs})
    by = {(r["epsilon"], r["prompt"]): r for r in recs}
    answered = [{p for e, p in by if e == x} for x in epsilons]
    common = sorted(set.intersection(*answered)) if answered else []
    lines = [
        f"Prompts answered at every epsilon: {len(common)}; setting "
        f"{', '.join(sorted({r['setting'] for r in recs}))}.",
        "",
        "| epsilon | median s | p90 s | p90 vs 0 | median paired ratio | stopped early "
        "| median tokens | median rounds |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if not common:
        return "\n".join(lines)
    base = [by[(0.0, p)]["seconds"] for p in common] if 0.0 in epsilons else None
    for e in epsilons:
        rows = [by[(e, p)] for p in common]
        secs = [r["seconds"] for r in rows]
        p90_vs = f"{_p90(secs) / _p90(base):.2f}x" if base else "-"
        ratio = (
            f"{statistics.median(s / b for s, b in zip(secs, base, strict=True)):.2f}x"
            if base
            else "-"
        )
        lines.append(
            f"| {e:g} | {statistics.median(secs):.1f} | {_p90(secs):.1f} | {p90_vs} | {ratio} "
            f"| {sum(r['stopped_early'] for r in rows)}/{len(rows)} "
            f"| {statistics.median(r['new_tokens'] for r in rows):.0f} "
            f"| {statistics.median(r['rounds'] or 0 for r in rows):.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--epsilons", default="0,0.02", help="stop_epsilon values (0: off)")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all)")
    ap.add_argument("--out", default="docs/benchmarks/epsilon-stop-cpu")
    ap.add_argument("--report", action="store_true", help="write README-table.md from records")
    args = ap.parse_args()
    if args.report:
        table = report(args)
        (Path(args.out) / "README-table.md").write_text(table + "\n")
        print(table)
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
