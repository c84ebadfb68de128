"""Rerun the hidden tests of committed HumanEval answers in today's sandbox (issue 62).

Reads a HumanEval run's records (``smcspec eval humaneval --out DIR``), takes the answers of
one method (default ``ar``, 164 answers in ``docs/benchmarks/humaneval-reward``), and runs
each answer's hidden tests again exactly as ``eval`` scored them (``extract_code`` on the
recorded output, then ``run_completion`` with eval's limits: 10 s, 1024 MiB), in the sandbox
asked for (default ``bwrap``: no capabilities, the minimal view of the host, the seccomp
policy). Prints the pass count beside the committed one, the verdicts by status, and every
answer whose verdict changed; a sandbox that blocks attacks, not honest test programs,
changes none.

  python benchmarks/studies/humaneval_rescore_sandbox.py docs/benchmarks/humaneval-reward \
      --out docs/benchmarks/humaneval-reward/sandbox-rescore.txt
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import sys
import time
from pathlib import Path

from smcspec import sandbox
from smcspec.eval.humaneval import (
    ExecResult,
    HumanEvalProblem,
    extract_code,
    load_humaneval,
    run_completion,
)
from smcspec.eval.results import ResultFile


def rescore(problem: HumanEvalProblem, record: dict, kind: str) -> tuple[ExecResult, bool]:
    """Run the hidden tests of ``record``'s answer in sandbox ``kind``; returns the verdict
    and whether the extracted code is the code the record holds (it must be)."""
    code = extract_code(record["output"], problem.prompt, problem.entry_point)
    res = run_completion(problem, code.code, full_program=code.full_program, sandbox=kind)
    return res, code.code == record.get("extracted", code.code)


def report(rows: list[tuple[dict, ExecResult, bool]], args: argparse.Namespace) -> list[str]:
    """The lines printed: counts, statuses and changed verdicts."""
    committed = sum(bool(r["correct"]) for r, _, _ in rows)
    now = sum(res.passed for _, res, _ in rows)
    before_status = collections.Counter(r["status"] for r, _, _ in rows)
    after_status = collections.Counter(res.status for _, res, _ in rows)
    changed = [(r, res) for r, res, _ in rows if res.passed != bool(r["correct"])]
    mismatched = [r["item"] for r, _, same in rows if not same]
    lines = [
        f"Command: python benchmarks/studies/humaneval_rescore_sandbox.py {' '.join(sys.argv[1:])}",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, uid {os.geteuid()}; "
        f"sandbox {args.sandbox}; bwrap works: {sandbox.bwrap_works()}",
        f"Records: {args.run / 'results.jsonl'}, method {args.method}: {len(rows)} answers",
        "",
        f"passed (committed records): {committed} of {len(rows)}",
        f"passed (rerun in the sandbox): {now} of {len(rows)}",
        f"status committed: {dict(sorted(before_status.items()))}",
        f"status rerun:     {dict(sorted(after_status.items()))}",
        f"verdicts changed: {len(changed)}",
    ]
    for r, res in changed:
        lines.append(f"  {r['item']}: {r['status']} -> {res.status} ({res.detail[:160]})")
    status_changed = [(r, res) for r, res, _ in rows if res.status != r["status"]]
    lines.append(f"statuses changed (same verdict): {len(status_changed) - len(changed)}")
    for r, res in status_changed:
        if res.passed == bool(r["correct"]):
            lines.append(f"  {r['item']}: {r['status']} -> {res.status} ({res.detail[:160]})")
    lines.append(f"extracted code differing from the record's: {len(mismatched)} {mismatched}")
    return lines


def main() -> int:
    """Rescore and print (and write ``--out``); returns 0, or 1 if a verdict changed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="the eval's --out folder (results.jsonl)")
    ap.add_argument("--method", default="ar", help="the setting whose answers rerun (ar)")
    ap.add_argument("--sandbox", default="bwrap", choices=sandbox.SANDBOXES)
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = ap.parse_args()
    problems = {p.task_id: p for p in load_humaneval()}
    records = ResultFile(args.run / "results.jsonl").records()
    chosen = {r["item"]: r for r in records if r["method"] == args.method}  # the last per item
    start = time.monotonic()
    rows = []
    for item in sorted(chosen, key=lambda i: int(i.rsplit("/", 1)[1])):
        res, same = rescore(problems[item], chosen[item], args.sandbox)
        rows.append((chosen[item], res, same))
    lines = report(rows, args)
    lines.append(f"wall time: {time.monotonic() - start:.0f} s")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    return 1 if any(res.passed != bool(r["correct"]) for r, res, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
