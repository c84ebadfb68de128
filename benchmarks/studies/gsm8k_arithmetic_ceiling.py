"""How much the arithmetic check can tell on GSM8K: false equations in right and wrong answers.

Reads a GSM8K run's records (``smcspec eval gsm8k --out DIR``) and checks every recorded
answer with :func:`smcspec.rewards.check_arithmetic`. Per method: answers with a checkable
equation, and answers with a false one, among those scored right and those scored wrong. The
reward can only move answers it sees a slip in: the wrong answers with a false equation bound
what steering by it can gain, and the right answers with one are its false alarms.

  python benchmarks/studies/gsm8k_arithmetic_ceiling.py docs/benchmarks/gsm8k-400 \
      --out docs/benchmarks/gsm8k-steering/arithmetic-ceiling.md
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

from smcspec.eval.results import ResultFile
from smcspec.rewards import check_arithmetic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="the eval's --out folder (results.jsonl)")
    ap.add_argument("--out", type=Path, default=None, help="write the Markdown table here")
    ap.add_argument("--examples", type=int, default=0, help="also list this many slips")
    args = ap.parse_args()
    records = ResultFile(args.run / "results.jsonl").records()
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    slips: list[str] = []
    for r in records:
        found = check_arithmetic(r["output"])
        false = [e for e in found if not e.holds]
        side = "right" if r["correct"] else "wrong"
        c = counts[r["method"]]
        c[side] += 1
        c[side + " checked"] += bool(found)
        c[side + " false"] += bool(false)
        c["equations"] += len(found)
        c["false equations"] += len(false)
        slips += [
            f"{r['id']} ({side}): `{e.line[:100]}` ({e.left:g} vs {e.right:g})" for e in false
        ]
    rows = [
        "| method | right answers | with an equation | with a false one | wrong answers | with an"
        " equation | with a false one | equations checked | false |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in sorted(counts):
        c = counts[m]
        rows.append(
            f"| {m} | {c['right']} | {c['right checked']} | {c['right false']} | {c['wrong']} | "
            f"{c['wrong checked']} | {c['wrong false']} | {c['equations']} | "
            f"{c['false equations']} |"
        )
    lines = [
        f"# The arithmetic check on {args.run.name}'s answers",
        "",
        "Command: `python benchmarks/studies/gsm8k_arithmetic_ceiling.py "
        f"{' '.join(sys.argv[1:])}`",
        "",
        "Each answer's checkable equations (`smcspec.rewards.check_arithmetic`: an `=` between "
        "two pieces of pure arithmetic), by whether the answer was scored right.",
        "",
        *rows,
        "",
    ]
    if args.examples:
        lines += ["Slips found:", "", *[f"- {s}" for s in slips[: args.examples]], ""]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
