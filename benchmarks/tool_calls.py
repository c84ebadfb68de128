"""Tool calling on the real pair: masked AR, masked SD and constrained SMC-SD.

20 tool-use prompts (``benchmarks/data/tool_use.jsonl``, each naming the function a person
would call) over one five-function toolset; every method decodes every prompt with the same
seed, the method order rotating prompt by prompt. With ``tool_choice`` ``required`` the
reply is constrained to one or more ``<tool_call>`` blocks whose names are the offered
functions and whose arguments follow each function's schema
(:class:`smcspec.tool_calls.ToolCalls`); ``auto-ar`` and ``auto-smc`` decode the same prompt
under ``auto`` (text, ``<tool_call>`` calls, or one call as a ``json`` block opening the
reply) to show what the model does when it may choose.

tokens/s is new tokens over the request's wall time, prefill included: the toolset makes
the prompt about 330 tokens, so these are lower than the throughput tables' decode rates.

Reported per method: the valid-call rate (every call parses and ``jsonschema_rs`` validates
its arguments, the reply complete), the rate of the expected function being the first
call's, tokens/s, and the target's log-likelihood of the reply (temperature 1, nats).

Usage:
  python benchmarks/tool_calls.py --out docs/benchmarks/tool-calls-cpu
  python benchmarks/tool_calls.py --methods auto-ar,auto-smc-n8-k2 --out OUT
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import jsonschema_rs
import torch
from structured_outputs import _configs, target_log_likelihood

from smcspec import Engine, GenerationConfig
from smcspec.tool_calls import FunctionTool, ToolCalls, parse_tool_calls

PROMPTS = Path(__file__).parent / "data" / "tool_use.jsonl"


def _obj(props: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}  # fmt: skip


TOOLS = (
    FunctionTool("get_weather", "Get the current weather in a city", _obj(
        {"city": {"type": "string", "maxLength": 40},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"])),
    FunctionTool("calculator", "Evaluate an arithmetic expression", _obj(
        {"expression": {"type": "string", "maxLength": 60}}, ["expression"])),
    FunctionTool("convert_currency", "Convert an amount between currencies", _obj(
        {"amount": {"type": "number"},
         "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
         "to": {"type": "string", "pattern": "^[A-Z]{3}$"}}, ["amount", "from", "to"])),
    FunctionTool("create_event", "Create a calendar event", _obj(
        {"title": {"type": "string", "maxLength": 60},
         "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
         "time": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"},
         "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 600}},
        ["title", "date", "time"])),
    FunctionTool("send_email", "Send an email", _obj(
        {"to": {"type": "string", "maxLength": 60},
         "subject": {"type": "string", "maxLength": 60},
         "body": {"type": "string", "maxLength": 200}}, ["to", "body"])),
)  # fmt: skip
SCHEMAS = {t.name: t.parameters for t in TOOLS}


def check_calls(text: str) -> tuple[bool, str | None]:
    """``(valid, first call's name)``: valid when there is at least one call, every call is
    complete and its arguments validate against its function's schema."""
    _, calls = parse_tool_calls(text)
    if not calls:
        return False, None
    for c in calls:
        try:
            ok = c.complete and jsonschema_rs.validator_for(SCHEMAS[c.name]).is_valid(
                json.loads(c.arguments)
            )
        except (ValueError, KeyError):
            ok = False
        if not ok:
            return False, calls[0].name
    return True, calls[0].name


def configs(args: argparse.Namespace) -> dict[str, GenerationConfig]:
    """ar, sd and smc under ``required`` (structured_outputs' three), then ar and smc under
    ``auto``."""
    cfgs = _configs(args, ToolCalls(TOOLS, "required"))
    auto = ToolCalls(TOOLS, "auto")
    cfgs["auto-ar"] = replace(cfgs["ar"], constraint=auto)
    smc = f"smc-n{args.n}-k{args.k}"
    cfgs[f"auto-{smc}"] = replace(cfgs[smc], constraint=auto)
    return cfgs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default=None, help="comma-separated subset, e.g. auto-ar")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    cfgs = configs(args)
    names = args.methods.split(",") if args.methods else list(cfgs)
    unknown = sorted(set(names) - set(cfgs))
    if unknown:
        p.error(f"unknown method {unknown[0]!r}; choose from {', '.join(cfgs)}")
    args.out.mkdir(parents=True, exist_ok=True)
    engine = Engine.load(threads=args.threads)
    items = [json.loads(line) for line in PROMPTS.read_text().splitlines()][: args.prompts]
    runs = []
    with open(args.out / "runs.jsonl", "w") as f:
        for i, item in enumerate(items):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                cfg = GenerationConfig(**{**cfgs[name].__dict__, "seed": args.seed + i})
                job = engine.prepare(item["prompt"], cfg)
                t0 = time.perf_counter()
                r = engine.generate(item["prompt"], cfg)
                wall = time.perf_counter() - t0
                valid, first = check_calls(r.text)
                rec = {
                    "id": item["id"], "method": name, "expected": item["tool"],
                    "valid": valid, "first_call": first, "text": r.text,
                    "new_tokens": r.new_tokens, "seconds": round(wall, 3),
                    "tokens_per_second": round(r.new_tokens / wall, 3),
                    "target_loglik": round(target_log_likelihood(engine, job.ids, r.token_ids), 3),
                    "finish_reason": r.finish_reason,
                }  # fmt: skip
                runs.append(rec)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(f"{item['id']:>2} {name:<12} valid={valid!s:<5} {first} "
                      f"{rec['tokens_per_second']:.2f} tok/s", file=sys.stderr)  # fmt: skip
    (args.out / "summary.md").write_text(summary(runs, args, names))
    print((args.out / "summary.md").read_text())
    return 0


def summary(runs: list[dict], args: argparse.Namespace, names: list[str]) -> str:
    cpu = platform.machine()
    for line in (
        Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    ):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    lines = [
        f"# Tool calls on the default pair ({date.today()})",
        "",
        f"Machine: {cpu}, {torch.get_num_threads()} torch threads; llamacpp backend; "
        f"{len({r['id'] for r in runs})} prompts, T={args.temperature}, "
        f"max_new_tokens={args.max_new_tokens}, seed {args.seed}+prompt.",
        "",
        "Command: `python benchmarks/tool_calls.py " + " ".join(a for a in sys.argv[1:]) + "`",
        "",
        "| method | tool_choice | valid calls | expected function first | median tokens/s "
        "| median target log-lik (nats) | median new tokens |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        rs = [r for r in runs if r["method"] == name]
        if not rs:
            continue
        valid = sum(r["valid"] for r in rs)
        right = sum(r["first_call"] == r["expected"] for r in rs)
        lines.append(
            f"| {name} | {'auto' if name.startswith('auto') else 'required'} | "
            f"{valid}/{len(rs)} | {right}/{len(rs)} | "
            f"{statistics.median(r['tokens_per_second'] for r in rs):.2f} | "
            f"{statistics.median(r['target_loglik'] for r in rs):.1f} | "
            f"{statistics.median(r['new_tokens'] for r in rs):.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
