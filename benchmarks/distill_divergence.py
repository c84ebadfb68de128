"""Per-token D2, KL and TV of the base and a fitted draft against the target, on eval answers.

For each record of ``--records`` whose method is ``--method`` (GSM8K, first ``--answers``):
the question's chat prompt and the record's answer (re-encoded), every answer position's
next-token distribution from the target, the base draft and the fitted draft, each after
the temperature (``log_softmax(logits / T)``), then the divergences of
:mod:`smcspec.distill.objectives` on the full vocabulary (no top-k bucketing): D2(p||q) =
log sum p^2 / q, KL(p||q), TV. The fitted draft runs on llama.cpp (its LoRA GGUF), and with
``--torch`` also on torch (its merged folder), with the largest logit difference between
the two: the export's check on the real pair.

  python benchmarks/distill_divergence.py --fitted runs/distill/chi2/draft \\
      --records docs/benchmarks/gsm8k-gpu-settings/results.jsonl --method ar --torch
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from smcspec import Engine
from smcspec.distill import objectives
from smcspec.eval import gsm8k
from smcspec.models import load_model


def log_probs(model, ids: list[int], p: int, temperature: float):
    """float32 ``[L - p, V]`` tempered log-probabilities of positions ``p .. L-1`` of ``ids``
    (and the raw logits)."""
    cache = model.new_cache(1, 8)
    try:
        logits = model.prefill(torch.tensor(ids), cache, all_logits=True)[p - 1 : -1].float()
    finally:
        cache.close()
    return torch.log_softmax(logits / temperature, -1), logits


def divergences(lp: torch.Tensor, lq: torch.Tensor) -> tuple[float, float, float]:
    """Mean per-token (D2, KL, TV) of target ``lp`` against draft ``lq`` (``[L, V]``), by
    :func:`smcspec.distill.objectives.divergences` (the fit's validation figures)."""
    figs = objectives.divergences(lp, lq)
    return tuple(figs[k].mean().item() for k in ("d2", "kl", "tv"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fitted", type=Path, required=True, help="the fitted draft's folder")
    ap.add_argument("--records", type=Path, required=True, help="a GSM8K results.jsonl")
    ap.add_argument("--method", default="ar", help="whose answers (a method of the records)")
    ap.add_argument("--answers", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--torch", action="store_true", help="also the merged folder on torch")
    args = ap.parse_args()
    engine = Engine.load()
    drafts = {
        "base": engine.draft.model,
        "fitted-llamacpp": load_model(args.fitted, backend="llamacpp", tokenizer=False).model,
    }
    if args.torch:
        drafts["fitted-torch"] = load_model(args.fitted, backend="torch", tokenizer=False).model
    items = {it.id: it for it in gsm8k.load_gsm8k()}
    records = [json.loads(line) for line in args.records.read_text().splitlines() if line]
    records = [r for r in records if r["method"] == args.method][: args.answers]
    print(f"answers: {args.method} of {args.records}, T = {args.temperature}")
    totals: dict[str, list[tuple[int, tuple[float, float, float]]]] = {}
    for r in records:
        prompt = engine.encode(gsm8k.build_messages(items[r["item"]].question))
        answer = engine.target.tokenizer.encode(r["output"], add_special_tokens=False)
        ids, p = prompt + answer, len(prompt)
        lp, _ = log_probs(engine.target.model, ids, p, args.temperature)
        logits = {}
        for name, model in drafts.items():
            lq, logits[name] = log_probs(model, ids, p, args.temperature)
            figs = divergences(lp, lq)
            totals.setdefault(name, []).append((len(answer), figs))
            print(f"{r['item']} {name}: {len(answer)} tokens, D2 %.3f KL %.3f TV %.3f" % figs)
        if args.torch:
            diff = (logits["fitted-llamacpp"] - logits["fitted-torch"]).abs().max().item()
            apart = (logits["base"] - logits["fitted-torch"]).abs().max().item()
            print(f"  largest logit difference, fitted llama.cpp vs torch {diff:.3f} "
                  f"(base vs fitted {apart:.3f})")  # fmt: skip
    for name, rows in totals.items():
        n = sum(t for t, _ in rows)
        mean = [sum(t * f[i] for t, f in rows) / n for i in range(3)]
        print(f"{name}, over {n} tokens: D2 %.3f KL %.3f TV %.3f" % tuple(mean))


if __name__ == "__main__":
    main()
