"""Structured outputs on the real pair: masked AR, masked SD and constrained SMC-SD.

Two workloads, every method on every item with the same seed (paired), the method order
rotating item by item so slow drifts of the machine fall on all methods alike:

* **JSON extraction** (``benchmarks/data/json_extraction.jsonl``): a source text and a JSON
  schema (nested objects, enums, arrays, ranged numbers). Each method decodes under
  ``JsonSchema(schema)``; ``free-ar`` decodes the same prompt without the constraint, as the
  reference for what the model does unaided. Reported per method: validity (the output
  parses as JSON and ``jsonschema_rs`` validates it against the schema), tokens/s, the
  target's log-likelihood of the output (temperature 1, nats), and the time spent in the
  constraint (masks, matchers, their copies) beside the request's wall time.
* **GSM8K with the answer format constrained**: the packaged test split's seeded subset,
  ``Regex(r"[\\s\\S]*#### -?[0-9]+(\\.[0-9]+)?")`` (the answer must end with
  ``#### <number>``) with masked AR and constrained SMC-SD, against unconstrained AR; accuracy
  by :func:`smcspec.eval.gsm8k.is_correct`.

Masked AR and SD sample the locally-masked distribution (what structured-output engines
do); constrained SMC-SD targets the target conditioned on the constraint
(``docs/constraints.md``), so its outputs should be more likely under the target.

Usage:
  python benchmarks/structured_outputs.py --json-tasks 32 --gsm8k 20 \
      --out docs/benchmarks/structured-cpu
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Any

import jsonschema_rs
import torch

from smcspec import Engine, GenerationConfig, JsonSchema, Regex
from smcspec.eval.fidelity import target_nll
from smcspec.eval.gsm8k import build_messages, extract_answer, is_correct, load_gsm8k

TASKS = Path(__file__).parent / "data" / "json_extraction.jsonl"
GSM8K_ANSWER = r"[\s\S]*#### -?[0-9]+(\.[0-9]+)?"


def target_log_likelihood(engine: Engine, prompt_ids: list[int], output: list[int]) -> float:
    """``log p_T(output | prompt)`` in nats at temperature 1 (:func:`target_nll` is its mean
    negative per token)."""
    return -target_nll(engine.target.model, prompt_ids, output) * len(output) if output else 0.0


def json_validity(text: str, schema: dict[str, Any]) -> bool:
    """Whether ``text`` is JSON that validates against ``schema``."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return bool(jsonschema_rs.validator_for(schema).is_valid(value))


def _configs(args: argparse.Namespace, constraint: Any) -> dict[str, GenerationConfig]:
    base = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    base["draft_temperature"] = args.temperature
    return {
        "ar": GenerationConfig(method="ar", constraint=constraint, **base),
        f"sd-k{args.k}": GenerationConfig(
            method="sd", draft_tokens=args.k, constraint=constraint, **base
        ),
        f"smc-n{args.n}-k{args.k}": GenerationConfig(
            method="smc", particles=args.n, draft_tokens=args.k, constraint=constraint, **base
        ),
    }


def _record(engine: Engine, prompt: Any, name: str, cfg: GenerationConfig) -> dict[str, Any]:
    ids = engine.encode(prompt)
    r = engine.generate(prompt, cfg)
    rounds = r.stats.get("rounds") or r.stats.get("forwards") or 1
    return {
        "method": name,
        "text": r.text,
        "new_tokens": r.new_tokens,
        "finish_reason": r.finish_reason,
        "seconds": r.seconds,
        "tokens_per_second": r.tokens_per_second,
        "rounds": rounds,
        "constraint_seconds": r.stats.get("constraint_seconds", 0.0),
        "log_likelihood": target_log_likelihood(engine, ids, r.token_ids),
        "log_normalizer": r.stats.get("log_normalizer"),
        "stats": {k: v for k, v in r.stats.items() if isinstance(v, int | float)},
    }


def _rotated(names: list[str], i: int) -> list[str]:
    return names[i % len(names) :] + names[: i % len(names)]


def run_json(engine: Engine, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines() if line.strip()]
    records = []
    with (out / "json_runs.jsonl").open("w") as f:
        for i, task in enumerate(tasks[: args.json_tasks]):
            cfgs = _configs(args, JsonSchema(task["schema"]))
            cfgs["free-ar"] = GenerationConfig(
                method="ar", max_new_tokens=args.max_new_tokens, temperature=args.temperature
            )
            for name in _rotated(list(cfgs), i):
                cfg = replace(cfgs[name], seed=args.seed + i)
                rec = {"task": task["id"], **_record(engine, task["prompt"], name, cfg)}
                rec["valid"] = json_validity(rec["text"], task["schema"])
                records.append(rec)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(
                    f"{task['id']:28s} {name:12s} valid={rec['valid']!s:5s} "
                    f"{rec['tokens_per_second']:6.2f} tok/s loglik={rec['log_likelihood']:8.2f}",
                    file=sys.stderr,
                )
    return records


def run_gsm8k(engine: Engine, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    subset = load_gsm8k(limit=args.gsm8k, seed=args.seed)
    constraint = Regex(GSM8K_ANSWER)
    cfgs = {
        "free-ar": GenerationConfig(
            method="ar", max_new_tokens=args.gsm8k_max_new_tokens, temperature=args.temperature
        )
    }
    for name, cfg in _configs(args, constraint).items():
        if not name.startswith("sd"):
            cfgs[name] = replace(cfg, max_new_tokens=args.gsm8k_max_new_tokens)
    records = []
    with (out / "gsm8k_runs.jsonl").open("w") as f:
        for i, item in enumerate(subset):
            messages = build_messages(item.question)
            for name in _rotated(list(cfgs), i):
                cfg = replace(cfgs[name], seed=args.seed + i)
                rec = {"item": item.id, **_record(engine, messages, name, cfg)}
                rec["extracted"] = extract_answer(rec["text"])
                rec["correct"] = is_correct(rec["extracted"], item.answer)
                records.append(rec)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(
                    f"{item.id:12s} {name:12s} correct={rec['correct']!s:5s} "
                    f"{rec['tokens_per_second']:6.2f} tok/s",
                    file=sys.stderr,
                )
    return records


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarize(records: list[dict[str, Any]], key: str) -> list[str]:
    """Markdown table rows: one per method, medians over items (``key``: valid/correct)."""
    rows = []
    for name in dict.fromkeys(r["method"] for r in records):
        rs = [r for r in records if r["method"] == name]
        share = [r["constraint_seconds"] / r["seconds"] for r in rs if r["seconds"] > 0]
        per_round = [1000 * r["constraint_seconds"] / r["rounds"] for r in rs]
        round_ms = [1000 * r["seconds"] / r["rounds"] for r in rs]
        ok = sum(bool(r[key]) for r in rs)
        rows.append(
            f"| {name} | {ok}/{len(rs)} | {_median([r['tokens_per_second'] for r in rs]):.2f} | "
            f"{_median([r['new_tokens'] for r in rs]):.0f} | "
            f"{_median([r['log_likelihood'] for r in rs]):.2f} | "
            f"{_median([r['log_likelihood'] / max(r['new_tokens'], 1) for r in rs]):.3f} | "
            f"{_median(per_round):.2f} | {_median(round_ms):.1f} | "
            f"{100 * _median(share):.1f}% / {100 * max(share, default=math.nan):.1f}% |"
        )
    return rows


def paired_log_likelihood(records: list[dict[str, Any]], a: str, b: str, item_key: str) -> str:
    """How often ``a``'s output is more likely under the target than ``b``'s on one item
    (the same text counts as a tie), and the median difference where the texts differ."""
    by = {(r[item_key], r["method"]): r for r in records}
    items = sorted({r[item_key] for r in records})
    pairs = [(by[(i, a)], by[(i, b)]) for i in items if (i, a) in by and (i, b) in by]
    differ = [(x, y) for x, y in pairs if x["text"] != y["text"]]
    wins = sum(x["log_likelihood"] > y["log_likelihood"] for x, y in differ)
    diff = _median([x["log_likelihood"] - y["log_likelihood"] for x, y in differ])
    return (
        f"{a} vs {b}: higher target log-likelihood on {wins}, lower on {len(differ) - wins} "
        f"of {len(pairs)} items ({len(pairs) - len(differ)} with the same text); median "
        f"difference where the texts differ {diff:+.2f} nats"
    )


HEADER = (
    "| method | {key} | median tokens/s | median new tokens | median log p_T(output) | "
    "median log p_T per token | constraint ms / round | round ms | constraint share of "
    "wall time (median / max) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json-tasks", type=int, default=32, help="JSON tasks (of 32) to run")
    p.add_argument("--gsm8k", type=int, default=20, help="GSM8K problems (0: skip)")
    p.add_argument("-N", type=int, default=4, dest="n", help="particles of SMC-SD")
    p.add_argument("-K", type=int, default=4, dest="k", help="draft tokens of SD and SMC-SD")
    p.add_argument("-m", "--max-new-tokens", type=int, default=256, help="JSON tasks")
    p.add_argument("--gsm8k-max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--summarize-only",
        action="store_true",
        help="decode nothing: rebuild summary.md from the runs files in --out (items every "
        "method finished), e.g. after a run was stopped",
    )
    p.add_argument("--note", default="", help="a sentence added to the summary's header")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.summarize_only:
        backend = "as in the note"
        json_recs = _complete(args.out / "json_runs.jsonl", "task")
        gsm_recs = _complete(args.out / "gsm8k_runs.jsonl", "item")
    else:
        engine = Engine.load(threads=args.threads)
        backend = engine.target.backend
        json_recs = run_json(engine, args, args.out) if args.json_tasks else []
        gsm_recs = run_gsm8k(engine, args, args.out) if args.gsm8k else []
    lines = [
        "# Structured outputs on the real pair",
        "",
        f"{date.today().isoformat()}; {platform.processor() or platform.machine()} "
        f"({torch.get_num_threads()} torch threads), backend {backend}; default pair "
        f"(Qwen2.5-Coder-1.5B-Instruct Q4_K_M target, 0.5B draft); T {args.temperature}; "
        f"SMC-SD N={args.n} K={args.k}; methods rotated item by item, seed = item index. "
        + args.note,
        "",
        "Command: `python benchmarks/structured_outputs.py "
        + " ".join(argv if argv is not None else sys.argv[1:])
        + "`",
        "",
    ]
    smc = f"smc-n{args.n}-k{args.k}"
    if json_recs:
        lines += [
            f"## JSON extraction ({len({r['task'] for r in json_recs})} tasks, "
            f"max {args.max_new_tokens} new tokens)",
            "",
            HEADER.format(key="schema-valid"),
            *summarize(json_recs, "valid"),
            "",
            paired_log_likelihood(json_recs, smc, "ar", "task"),
            "",
            paired_log_likelihood(json_recs, smc, f"sd-k{args.k}", "task"),
            "",
        ]
    if gsm_recs:
        lines += [
            "## GSM8K, answer constrained to end with `#### <number>` "
            f"({len({r['item'] for r in gsm_recs})} problems, "
            f"max {args.gsm8k_max_new_tokens} new tokens)",
            "",
            f"Constraint: `Regex({GSM8K_ANSWER!r})`; free-ar: unconstrained AR, same seeds.",
            "",
            HEADER.format(key="correct"),
            *summarize(gsm_recs, "correct"),
            "",
            paired_log_likelihood(gsm_recs, smc, "ar", "item"),
            "",
        ]
    if not args.summarize_only:
        lines.append(f"Total wall time: {time.perf_counter() - t0:.0f} s.")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _complete(path: Path, item_key: str) -> list[dict[str, Any]]:
    """The records of ``path`` (JSONL; none if missing) for items every method finished."""
    if not path.is_file():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    methods = {r["method"] for r in recs}
    done = {i for i in {r[item_key] for r in recs}
            if {r["method"] for r in recs if r[item_key] == i} == methods}  # fmt: skip
    return [r for r in recs if r[item_key] in done]


if __name__ == "__main__":
    sys.exit(main())
