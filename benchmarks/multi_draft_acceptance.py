"""Accepted tokens a round of chain sd against multi-draft sd on the default pair (issue 74).

Settings: ``sd`` with N chains in ``--particles`` (N = 1 is chain sd) and K in
``--draft-tokens``, every (N, K); prompts: ``--prompts`` ShareGPT first turns (open chat)
and as many HumanEval canonical solutions to rewrite (code, ``benchmarks/ngram_drafts.py``),
chat-templated, each decoded ``--max-new-tokens`` tokens (end of stream ignored) at
T = ``--temperature`` for target and draft, seed = the prompt's index, llamacpp backend.
Measured per request: rounds, drafted depth and accepted tokens (the decoder's stats), so
``tokens a round = 1 + accepted / rounds``. No clock is read for a claim: the figure is a
count, the same on any machine for a seed (up to llama.cpp's batched arithmetic).

With the committed H200 forward costs (``docs/benchmarks/gpu-h200-graphs``, random weights
at Llama-3.1-8B / 3.2-1B shapes: a round's seconds for chain sd K and SMC-SD's N x K forwards,
whose shapes multi-draft sd shares) the report also gives each setting's predicted H200
tokens/s, labelled as a prediction: tokens a round measured here over seconds a round
measured there.

Resumable: records go to ``--out``/records.jsonl, one per (setting, prompt); a rerun skips
those present. The report (``--report``) is ``--out``/README-table.md.

Usage (a background run):
  nohup nice -n 10 .venv/bin/python benchmarks/multi_draft_acceptance.py --prompts 20 \
      --out docs/benchmarks/multi-draft-cpu >> multi-draft.log 2>&1 &
  .venv/bin/python benchmarks/multi_draft_acceptance.py --prompts 20 \
      --out docs/benchmarks/multi-draft-cpu --report
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from ngram_drafts import prompts as rewrite_prompts  # noqa: E402

from smcspec import Engine, GenerationConfig  # noqa: E402
from smcspec.eval.sharegpt import load_sharegpt_prompts  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _label(n: int, k: int) -> str:
    return f"sd-k{k}" if n == 1 else f"sd-n{n}-k{k}"


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    done = {(r["setting"], r["prompt"]) for r in _records(path)}
    engine = Engine.load(backend="llamacpp", threads=args.threads)
    texts = [("chat", t) for t in load_sharegpt_prompts(args.prompts, engine.tokenizer, seed=0)]
    texts += [("code", t) for t in rewrite_prompts(args.prompts, "rewrite")]
    settings = [(n, k) for k in _ints(args.draft_tokens) for n in _ints(args.particles)]
    for i, (workload, text) in enumerate(texts):
        for n, k in settings:  # every setting on a prompt before the next prompt
            name = _label(n, k)
            if (name, i) in done:
                continue
            cfg = GenerationConfig(
                method="sd", particles=n, draft_tokens=k, max_new_tokens=args.max_new_tokens,
                temperature=args.temperature, draft_temperature=args.temperature, seed=i,
                ignore_eos=True,
            )  # fmt: skip
            t0 = time.perf_counter()
            result = engine.generate(text, cfg)
            s = result.stats
            rec = {
                "setting": name, "particles": n, "draft_tokens": k, "prompt": i,
                "workload": workload, "tokens": len(result.token_ids), "rounds": s["rounds"],
                "drafted": s["drafted"], "accepted": s["accepted"],
                "acceptance_by_depth": s.get("acceptance_by_depth"),
                "seconds": round(time.perf_counter() - t0, 3),
            }  # fmt: skip
            with path.open("a") as fh:
                fh.write(json.dumps(rec) + "\n")
            print(json.dumps(rec), flush=True)


# H200 seconds a round (random weights, 8B/1B shapes, bf16, CUDA graphs, batch 1), from the
# committed campaign (docs/benchmarks/gpu-h200-graphs/README.md); keys (N, K); filled in the
# report only where the campaign measured that shape
H200_ROUND_S: dict[tuple[int, int], float] = {}


def report(args: argparse.Namespace) -> str:
    recs = _records(Path(args.out) / "records.jsonl")
    by: dict[str, list[dict]] = {}
    for r in recs:
        by.setdefault(r["setting"], []).append(r)
    prompts = set.intersection(*({r["prompt"] for r in v} for v in by.values())) if by else set()
    lines = [
        f"Prompts answered by every setting: {len(prompts)} "
        f"({sum(1 for p in prompts if p < args.prompts)} chat, "
        f"{sum(1 for p in prompts if p >= args.prompts)} code).",
        "",
        "| setting | N | K | tokens a round (all) | chat | code | x chain sd, same K |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    tpr: dict[str, float] = {}
    for name in sorted(by, key=lambda s: (by[s][0]["draft_tokens"], by[s][0]["particles"])):
        rows = [r for r in by[name] if r["prompt"] in prompts]

        def per_round(rs: list[dict]) -> float:
            rounds = sum(r["rounds"] for r in rs)
            return 1 + sum(r["accepted"] for r in rs) / rounds if rounds else float("nan")

        tpr[name] = per_round(rows)
        n, k = rows[0]["particles"], rows[0]["draft_tokens"]
        chain = tpr.get(_label(1, k))
        ratio = f"{tpr[name] / chain:.2f}" if chain else "-"
        chat = per_round([r for r in rows if r["workload"] == "chat"])
        code = per_round([r for r in rows if r["workload"] == "code"])
        lines.append(
            f"| `{name}` | {n} | {k} | {tpr[name]:.2f} | {chat:.2f} | {code:.2f} | {ratio} |"
        )
    spread = [statistics.median(r["seconds"] for r in v) for v in by.values()]
    if spread:
        lines += ["", f"Median seconds a request over the settings: {min(spread):.1f} to "
                  f"{max(spread):.1f} (beside other work; not a speed claim)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=20, help="per workload (chat, code)")
    ap.add_argument("--particles", default="1,2,4,8", help="N chains (1: chain sd)")
    ap.add_argument("--draft-tokens", default="2,4,8")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--report", action="store_true", help="write the report from the records")
    args = ap.parse_args()
    if args.report:
        text = report(args)
        (Path(args.out) / "README-table.md").write_text(text)
        print(text)
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
