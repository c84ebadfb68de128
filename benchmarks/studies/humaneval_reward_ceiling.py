"""How much the execution reward can tell: the prompt's examples against the hidden tests.

Reads a HumanEval run's records (``smcspec eval humaneval --out DIR``) and, for every problem
that every method answered, scores each recorded answer with the execution reward of
``smcspec.rewards.CodeExamples`` (the share of the prompt's own examples passed, run in the
sandbox) beside its hidden-test verdict. Per method: answers that pass every example and the
hidden tests, every example but not the hidden tests, and so on. A reward can only help
where it separates answers: an answer that fails an example never passes the hidden tests
here, but one that passes them all may still fail, and a method whose answers already pass
every example leaves the reward nothing to choose.

  python benchmarks/studies/humaneval_reward_ceiling.py docs/benchmarks/humaneval-reward \
      --out docs/benchmarks/humaneval-reward/ceiling.md
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

from smcspec.eval.humaneval import load_humaneval
from smcspec.eval.results import ResultFile
from smcspec.rewards import CodeExamples, examples_from_prompt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="the eval's --out folder (results.jsonl)")
    ap.add_argument("--out", type=Path, default=None, help="write the Markdown table here")
    ap.add_argument("--first", type=int, default=None, help="only HumanEval/0 .. /FIRST-1")
    args = ap.parse_args()
    problems = {p.task_id: p for p in load_humaneval()}
    # the last record of each id; a line the running eval is still writing is skipped
    records = ResultFile(args.run / "results.jsonl").records()
    by_item: dict[str, dict[str, dict]] = collections.defaultdict(dict)
    for r in records:
        by_item[r["item"]][r["method"]] = r
    methods = sorted({m for answers in by_item.values() for m in answers})
    complete = [i for i, answers in by_item.items() if set(answers) == set(methods)]
    if args.first is not None:
        complete = [i for i in complete if int(i.split("/")[1]) < args.first]
    counts: dict[str, collections.Counter] = {m: collections.Counter() for m in methods}
    without = 0
    for item in complete:
        problem = problems[item]
        found = examples_from_prompt(problem.prompt, problem.entry_point)
        if not found:
            without += 1
            continue
        examples = CodeExamples(found, problem.prompt, problem.entry_point)  # as eval's reward
        for m in methods:
            r = by_item[item][m]
            all_passed = examples.score([r["output"]])[0] == 1.0
            counts[m][(all_passed, bool(r["correct"]))] += 1
    lines = [
        f"# The execution reward against the hidden tests ({len(complete)} problems)",
        "",
        "Command: `python benchmarks/studies/humaneval_reward_ceiling.py "
        f"{' '.join(sys.argv[1:])}`",
        "",
        f"Problems every method answered: {len(complete)}; without examples in the prompt "
        f"(no reward): {without}. Each recorded answer (for a `-vote` setting, the vote's) is "
        "scored on the prompt's own examples and on the hidden tests.",
        "",
        "| method | passed (hidden tests) | examples all passed, hidden passed "
        "| examples all passed, hidden failed | an example failed, hidden passed "
        "| an example failed, hidden failed | one behaviour at the end (votes) "
        "| median resamplings |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in methods:
        c = counts[m]
        answers = [by_item[i][m] for i in complete]
        votes = [r["vote"]["answers"] for r in answers if r.get("vote")]
        one = f"{sum(v == 1 for v in votes)} of {len(votes)}" if votes else "-"
        resamples = [r["stats"]["resamples"] for r in answers if "resamples" in r["stats"]]
        median = f"{statistics.median(resamples):g}" if resamples else "-"
        lines.append(
            f"| {m} | {sum(bool(r['correct']) for r in answers)} | {c[(True, True)]} "
            f"| {c[(True, False)]} | {c[(False, True)]} | {c[(False, False)]} | {one} "
            f"| {median} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
