"""Distinct rows on and off, side by side: SMC-SD tokens/s, distinct fractions and round
time on the default pair, with the tuner's prediction beside each setting.

One run alternates every SMC-SD setting with and without sharing on the same prompts and
seeds (each prompt visits the settings in a rotated order, sharing on and off next to each
other), with ``ar`` as the reference: 8 prompts (4 ShareGPT first turns, 4 GSM8K test
questions in the eval's prompt), 128 new tokens (EOS ignored), T_t = T_d = 0.7, one request
at a time. Records are appended to ``runs.jsonl`` as they finish and a rerun skips the ones
present (resumable). The report gives, per setting: median tokens/s with and without
sharing and their ratio, the distinct target and draft fractions, the median seconds a
round, and the tuner's predicted tokens/s with sharing (distinct rows) and without (all
N x (K+1) rows), from the cost cache of this machine and pair.

Usage:
  python benchmarks/shared_rows.py --out docs/benchmarks/shared-rows [--threads 2]
  python benchmarks/shared_rows.py --out docs/benchmarks/shared-rows --report-only
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import replace
from datetime import date
from pathlib import Path

from smcspec import Engine, GenerationConfig
from smcspec.eval.gsm8k import PROMPT_TEMPLATE, load_gsm8k
from smcspec.eval.harness import MethodSpec
from smcspec.eval.sharegpt import load_sharegpt_prompts
from smcspec.eval.throughput import run_bench
from smcspec.tuning import TuningGrid, tune

SETTINGS = [(n, k) for n in (4, 8, 16) for k in (4, 8)]
TOKENS = 128


def _specs(base: GenerationConfig) -> list[MethodSpec]:
    specs = [MethodSpec("ar", replace(base, method="ar"))]
    for n, k in SETTINGS:
        smc = replace(base, method="smc", particles=n, draft_tokens=k)
        specs.append(MethodSpec(f"smc-n{n}-k{k}", smc))
        specs.append(MethodSpec(f"smc-n{n}-k{k}-unshared", replace(smc, shared_rows=False)))
    return specs


def _prompts(engine: Engine) -> list[str]:
    share = load_sharegpt_prompts(4, engine.tokenizer, seed=0)
    gsm = [PROMPT_TEMPLATE.format(question=q.question.strip()) for q in load_gsm8k(limit=4)]
    return share + gsm


def run(out: Path, threads: int | None) -> None:
    engine = Engine.load(backend="llamacpp", threads=threads)
    base = GenerationConfig(max_new_tokens=TOKENS, ignore_eos=True, temperature=0.7)
    # the predictions' costs: every shape of the settings (N=16 K=8 is above the CPU grid's
    # cap) and the agreement profiles, measured once into the user's cost cache
    tune(engine, GenerationConfig(), grid=TuningGrid(max_forward_tokens=144), log=print)
    prompts, specs = _prompts(engine), _specs(base)
    path = out / "runs.jsonl"
    done = set()
    if path.is_file():
        done = {(r["prompt"], r["method"]) for r in map(json.loads, path.read_text().splitlines())}
    for i, text in enumerate(prompts):
        todo = [s for s in specs if (i, s.name) not in done]
        if not todo:
            continue
        # run_bench rotates the order by the prompt index; one prompt at a time keeps the
        # file growing (resumable) and the rotation is done here
        shift = (2 * i) % len(specs)
        order = [s for s in specs[shift:] + specs[:shift] if s in todo]
        records = run_bench(engine, [text], order, seed=i, warmup=i == 0, progress=False)
        with open(path, "a") as fh:
            for r in records:
                r["prompt"] = i
                fh.write(json.dumps(r) + "\n")
        print(f"prompt {i}: {len(records)} requests", flush=True)


def _costs(costs_dir: Path):
    """The cost file of this machine with the agreement profiles at T = 0.7 (written by the
    tuner: run ``smcspec bench --predict`` once): (ForwardCosts, file name)."""
    from smcspec.config import GenerationConfig
    from smcspec.tuning.cache import machine_name, read_costs, sampling_key

    acc_key = sampling_key(GenerationConfig(temperature=0.7, draft_temperature=0.7))
    for path in sorted(costs_dir.glob("*.json")):
        key = json.loads(path.read_text()).get("key", {})
        if key.get("backend") != "llamacpp" or key.get("machine") != machine_name("cpu"):
            continue
        record = read_costs(path, key)
        costs = record.forward_costs(record.acceptance.get(acc_key))
        if costs.draft_top_probs is not None:
            return costs, path.name
    raise SystemExit(f"no measured agreement profiles under {costs_dir}")


def report(out: Path, costs_dir: Path, threads: int | None) -> str:
    from smcspec.tuning.cache import machine_name
    from smcspec.tuning.predict import Setting, predict

    recs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    by: dict[str, list[dict]] = defaultdict(list)
    for r in recs:
        by[r["method"]].append(r)
    costs, source = _costs(costs_dir)

    def med(name: str, key=lambda r: r["tokens_per_second"]) -> float:
        return statistics.median(key(r) for r in by[name])

    ar = med("ar")
    lines = [
        "| setting | tokens/s shared | tokens/s unshared | ratio | x ar | distinct target "
        "| distinct draft | s/round shared | s/round unshared | predicted shared "
        "| predicted unshared | predicted distinct |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, k in SETTINGS:
        name = f"smc-n{n}-k{k}"
        if name not in by or f"{name}-unshared" not in by:
            continue
        on, off = med(name), med(f"{name}-unshared")
        dt = statistics.mean(r["stats"]["distinct_rows_target"] for r in by[name])
        dd = statistics.mean(r["stats"]["distinct_rows_draft"] for r in by[name])

        def per_round(r):
            return r["seconds"] / r["stats"]["rounds"]

        shared_p = predict(Setting("smc", n, k), costs)
        all_p = predict(Setting("smc", n, k), costs, shared_rows=False)
        lines.append(
            f"| {name} | {on:.2f} | {off:.2f} | {on / off:.2f} | {on / ar:.2f} | {dt:.2f} | "
            f"{dd:.2f} | {med(name, per_round):.3f} | {med(f'{name}-unshared', per_round):.3f} "
            f"| {shared_p.tokens_per_second:.2f} | {all_p.tokens_per_second:.2f} | "
            f"{shared_p.distinct:.2f} |"
        )
    prompts = len({r["prompt"] for r in recs})
    text = (
        f"# Distinct rows on and off ({date.today().isoformat()})\n\n"
        f"Machine: {machine_name('cpu')}. llamacpp backend, default pair; "
        f"{prompts} prompts (4 ShareGPT first turns, 4 GSM8K test questions), {TOKENS} new "
        "tokens (EOS ignored), T_t = T_d = 0.7, kappa 0.5, one request at a time, settings "
        "alternated (sharing on and off next to each other). Medians over prompts; "
        f"`ar`: {ar:.2f} tokens/s. Predictions: the tuner's, from the cost cache {source}.\n\n"
        + "\n".join(lines)
        + "\n\nCommand: `python benchmarks/shared_rows.py --out "
        + f"{out}{'' if threads is None else f' --threads {threads}'}` (the report again: "
        "`--report-only`); every request in `runs.jsonl`.\n"
    )
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/benchmarks/shared-rows")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--costs", default=None, help="cost cache folder (default: the user's)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        run(out, args.threads)
    from smcspec.models.loading import cache_root

    text = report(out, Path(args.costs) if args.costs else cache_root() / "costs", args.threads)
    (out / "README.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
