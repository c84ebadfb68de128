"""Throughput of smcspec (AR, SD, SMC-SD) against Hugging Face transformers on one machine.

Systems, alternated prompt by prompt in one process (the order rotates every prompt):
  hf-ar        transformers ``generate`` on the target alone (sampling, T=0.7, top_k=0, top_p=1)
  hf-assisted  transformers assisted generation with the same draft (sampling)
  ar, sd, smc  smcspec's decoders (smc at N=4,K=4 and at --best N,K)

Every system gets the same chat-templated prompt, 128 new tokens (EOS ignored, so every run
does the same amount of work), float32 weights from the same converted GGUF files. Reported:
median tokens/s per system (new tokens / wall time including prefill) and its ratio to hf-ar,
plus the roofline prediction of SMC-SD's speed-up from measured forward costs.

Usage:
  python benchmarks/throughput.py --prompts 6 --max-new-tokens 128 --best 4,4 \
      --out docs/benchmarks/throughput-cpu.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

from smcspec import Engine, GenerationConfig
from smcspec.decoding.registry import decoder_named
from smcspec.eval.gsm8k import packaged_test_path
from smcspec.eval.roofline import predicted_speedup, smc_forward_costs

SMC = decoder_named("smc")  # the decoder the roofline prices

CODING = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case.",
    "Write a Python class implementing a stack with push, pop and peek.",
    "Explain what a Python list comprehension is and give two examples.",
]


def prompts(n: int) -> list[str]:
    with open(packaged_test_path()) as f:
        qs = [json.loads(line)["question"] for line in f]
    math = [q + "\nSolve step by step." for q in qs[: (n + 1) // 2]]
    code = CODING[: n // 2]
    out = [p for pair in zip(math, code, strict=False) for p in pair]
    return out + math[len(code) :]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--best", default="4,4", help="second SMC-SD setting N,K")
    ap.add_argument("--systems", default="hf-ar,hf-assisted,ar,sd,smc-4x4,smc-best")
    ap.add_argument("--out", default=None, help="also write a Markdown report here")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    engine = Engine.load()
    hf_t = AutoModelForCausalLM.from_pretrained(engine.target.path, dtype=torch.float32).eval()
    hf_d = AutoModelForCausalLM.from_pretrained(engine.draft.path, dtype=torch.float32).eval()
    tok = engine.tokenizer
    bn, bk = (int(x) for x in args.best.split(","))
    m = args.max_new_tokens
    base = dict(max_new_tokens=m, temperature=0.7, draft_temperature=0.7, ignore_eos=True)
    ours = {
        "ar": GenerationConfig(method="ar", **base),
        "sd": GenerationConfig(method="sd", draft_tokens=4, **base),
        "smc-4x4": GenerationConfig(method="smc", particles=4, draft_tokens=4, **base),
        "smc-best": GenerationConfig(method="smc", particles=bn, draft_tokens=bk, **base),
    }
    systems = args.systems.split(",")

    def run(system: str, ids: list[int], seed: int) -> tuple[float, int, dict]:
        if system in ours:
            r = engine.generate(ids, GenerationConfig(**{**ours[system].__dict__, "seed": seed}))
            return r.seconds, r.new_tokens, r.stats
        torch.manual_seed(seed)
        x = torch.tensor([ids])
        kw = dict(
            do_sample=True,
            temperature=0.7,
            top_k=0,
            top_p=1.0,
            max_new_tokens=m,
            min_new_tokens=m,
            pad_token_id=tok.pad_token_id or tok.eos_token_id,
        )
        if system == "hf-assisted":
            kw["assistant_model"] = hf_d
        s = time.perf_counter()
        with torch.inference_mode():
            out = hf_t.generate(x, attention_mask=torch.ones_like(x), **kw)
        return time.perf_counter() - s, out.shape[1] - x.shape[1], {}

    texts = prompts(args.prompts)
    results: dict[str, list[float]] = {s: [] for s in systems}
    log = []
    warm = engine.encode("Hello")
    for s in systems:  # warm-up: first calls allocate and load kernels
        run(s, warm, 0)
    for i, text in enumerate(texts):
        ids = engine.encode(text)
        order = systems[i % len(systems) :] + systems[: i % len(systems)]
        for s in order:
            secs, n_new, stats = run(s, ids, seed=1000 + i)
            results[s].append(n_new / secs)
            log.append(
                {
                    "prompt": i,
                    "system": s,
                    "prompt_tokens": len(ids),
                    "new_tokens": n_new,
                    "seconds": round(secs, 3),
                    "tokens_per_second": round(n_new / secs, 3),
                    **{k: v for k, v in stats.items() if k != "seed"},
                }
            )
            print(json.dumps(log[-1]), flush=True)

    costs = {
        f"{n}x{k}": smc_forward_costs(engine.target.model, engine.draft.model, n, k, SMC)
        for n, k in {(4, 4), (bn, bk)}
    }
    base_tps = statistics.median(results["hf-ar"]) if "hf-ar" in results else None
    lines = [
        f"# Throughput on CPU ({date.today().isoformat()})",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}.",
        f"Models: target {engine.target.path.name}, draft {engine.draft.path.name}, float32.",
        f"Settings: {len(texts)} prompts (GSM8K test questions and coding requests), {m} new "
        "tokens (EOS ignored), T_t = T_d = 0.7, full-vocabulary sampling, systems alternated.",
        "",
        f"Command: `python {' '.join(sys.argv)}`",
        "",
        "| system | median tokens/s | min | max | ratio to hf-ar |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in systems:
        med = statistics.median(results[s])
        ratio = f"{med / base_tps:.2f}x" if base_tps else "-"
        lines.append(
            f"| {s} | {med:.2f} | {min(results[s]):.2f} | {max(results[s]):.2f} | {ratio} |"
        )
    lines += [
        "",
        "Roofline prediction of SMC-SD's speed-up over our AR, from measured forwards:",
        "",
    ]
    lines += [
        "| setting | c = draft/target cost | memory-bound (K+1)/((K+1)c+1) | "
        "from measured N-row forwards | measured smc / our ar |",
        "|---|---:|---:|---:|---:|",
    ]
    ar_tps = statistics.median(results["ar"]) if "ar" in results else None
    for key, sysname in (("4x4", "smc-4x4"), (f"{bn}x{bk}", "smc-best")):
        n, k = (int(v) for v in key.split("x"))
        rf = predicted_speedup(costs[key], n, k, SMC)
        meas = (
            f"{statistics.median(results[sysname]) / ar_tps:.2f}x"
            if ar_tps and sysname in results
            else "-"
        )
        lines.append(
            f"| N={n}, K={k} | {rf['c']:.3f} | {rf['memory_bound']:.2f}x | "
            f"{rf['measured_costs']:.2f}x | {meas} |"
        )
    lines += (
        [
            "",
            "Forward costs (median seconds):",
            "",
            "```",
            json.dumps(costs, indent=1),
            "```",
            "",
            "Per-run log:",
            "",
            "```",
        ]
        + [json.dumps(r) for r in log]
        + ["```"]
    )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
