"""Ended particles under the keep rule, with and without hosts (``decoding/smc/round_end.py``).

Under the keep rule (a reward, a constraint, alpha != 1) a particle that ends stays among the
N, and a request runs until its last particle ends. Without hosts every ended particle is
still fed a row in each forward; with them it rides on a running particle's rows, which
distinct rows compute once. Same seed both ways: the draws are the same, so the answers must
be identical (checked); only the rows computed and the time change.

Requests: HumanEval prompts as ``smcspec eval humaneval`` sends them, with the eval's
``smc-nN-kK-reward-vote`` setting (execution reward on the prompt's own examples, beta 5,
vote over behaviours), the eval's seed for each problem (``--seed`` + its index), hosts on and
off alternated (the order flips from one problem to the next).

Usage:
  python benchmarks/studies/keep_rule_hosts.py --problems 2,3,6 \
      --out docs/benchmarks/keep-rule-hosts/README.md
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from datetime import date
from pathlib import Path

import smcspec.decoding.smc.round_end as round_end
from smcspec import Engine, GenerationConfig
from smcspec.eval import harness
from smcspec.eval.humaneval import load_humaneval
from smcspec.tuning.cache import cpu_model


def run(engine: Engine, item, index: int, spec, seed: int, hosts: bool) -> dict:
    """One answer of ``spec`` to ``item``; ``hosts`` False replaces ``round_end.host_ended``
    by a no-op."""
    real = round_end.host_ended
    if not hosts:
        round_end.host_ended = lambda ps, tcache, dcache: None
    try:
        cfg = replace(spec.config, seed=seed + index)
        ans = harness._answer(
            engine, "humaneval", item, spec, harness._humaneval_messages(item), cfg
        )
    finally:
        round_end.host_ended = real
    st = ans.result.stats
    return {
        "text": ans.text,
        "seconds": ans.seconds,
        "tokens": ans.new_tokens,
        "rounds": st["rounds"],
        "distinct_target": st["distinct_rows_target"],
        "distinct_draft": st["distinct_rows_draft"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", default="2,3,6", help="HumanEval indices")
    ap.add_argument("--method", default="smc-n8-k2-reward-vote")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    engine = Engine.load(backend="llamacpp", threads=args.threads)
    base = GenerationConfig(
        max_new_tokens=args.max_new_tokens, temperature=0.7, draft_temperature=0.7
    )
    (spec,) = harness.method_specs(args.method, base)
    problems = load_humaneval()
    engine.generate("Hello", GenerationConfig(method="ar", max_new_tokens=4, seed=0))  # warm-up
    rows = []
    for n, index in enumerate(int(p) for p in args.problems.split(",")):
        item = problems[index]
        order = (True, False) if n % 2 == 0 else (False, True)
        got = {h: run(engine, item, index, spec, args.seed, h) for h in order}
        if got[True]["text"] != got[False]["text"]:
            raise SystemExit(f"{item.task_id}: the answers differ with and without hosts")
        rows.append((item.task_id, got[True], got[False]))
        on, off = got[True], got[False]
        print(f"{item.task_id}: {off['seconds']:.1f} s -> {on['seconds']:.1f} s", flush=True)
    lines = [
        "# Ended particles ride on running ones under the keep rule",
        "",
        f"{date.today()}, {cpu_model()}, llamacpp backend, {args.threads} threads, default pair, "
        f"`{args.method}` as in `smcspec eval humaneval` (512 new tokens at most, T = 0.7), "
        "hosts on and off alternated per problem, same seed: the answers were identical.",
        "",
        "Command: `python benchmarks/studies/keep_rule_hosts.py "
        f"--problems {args.problems} --method {args.method}"
        + (f" --out {args.out}`" if args.out else "`"),
        "",
        "| problem | tokens | rounds | seconds without hosts | seconds with hosts | ratio "
        "| target rows computed without / with |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for task_id, on, off in rows:
        lines.append(
            f"| {task_id} | {on['tokens']} | {on['rounds']} | {off['seconds']:.1f} "
            f"| {on['seconds']:.1f} | {on['seconds'] / off['seconds']:.2f} "
            f"| {off['distinct_target']:.2f} / {on['distinct_target']:.2f} |"
        )
    ratios = [on["seconds"] / off["seconds"] for _, on, off in rows]
    lines += ["", f"Median time ratio (with / without hosts): {statistics.median(ratios):.2f}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
