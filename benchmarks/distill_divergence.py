"""Per-token D2, KL and TV of the base and a fitted draft against the target, on eval answers.

For each record of ``--records`` whose method is ``--method`` (GSM8K, first ``--answers``):
the question's chat prompt and the record's answer (re-encoded), every answer position's
next-token distribution from the target, the base draft and the fitted draft, each after
the temperature (``log_softmax(logits / T)``), then the divergences of
:mod:`smcspec.distill.objectives` on the full vocabulary (no top-k bucketing): D2(p||q) =
log sum p^2 / q, KL(p||q), TV. The fitted draft runs on llama.cpp (its LoRA GGUF), and with
``--torch`` also on torch (its merged folder), with the largest logit difference between
the two: the export's check on the real pair. ``--fitted`` takes several drafts
(``NAME=FOLDER``), each run on llama.cpp.

With ``--blocks N,K`` (repeatable), what those per-token distributions mean for SMC-SD's
rounds, by :func:`smcspec.distill.rounds.simulate_rounds` (the independent-positions model
of a round, not a run of the decoder): the round's ESS (the records' ``mean_round_ess``
measured in the engine), the ESS as N grows (N ``exp(-sum D2)``), and the ``-log p`` of the
tokens of the particle kept by weight (how far what SMC-SD keeps is from the target's own
tokens, whose mean is the target's entropy) and of every drafted particle.
``--draft-temperatures`` adds each draft at other temperatures against the target at
``--temperature`` (SMC-SD's ``--draft-temperature``: the weights stay exact, the proposal
sharpens or spreads).

  python benchmarks/distill_divergence.py --fitted runs/distill/chi2/draft \\
      --records docs/benchmarks/gsm8k-gpu-settings/results.jsonl --method ar --torch
  python benchmarks/distill_divergence.py --fitted chi2=docs/benchmarks/distill/draft-chi2 \\
      kl=docs/benchmarks/distill/draft-kl \\
      --records docs/benchmarks/gsm8k-gpu-settings/results.jsonl --answers 8 \\
      --blocks 4,12 --blocks 8,8
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from smcspec import Engine
from smcspec.distill import objectives
from smcspec.distill.rounds import simulate_rounds
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


def parse_drafts(specs: list[str]) -> dict[str, Path]:
    """``NAME=FOLDER`` (or a bare FOLDER, named ``fitted``) to ``{name: folder}``."""
    out = {}
    for spec in specs:
        name, _, folder = spec.rpartition("=")
        out[name or "fitted"] = Path(folder)
    return out


Sims = dict[tuple[str, int, int], list[tuple[int, dict[str, float]]]]


def load_drafts(engine: Engine, fitted: dict[str, Path], on_torch: bool) -> dict:
    """The base draft, each fitted one on llama.cpp, and the first on torch too."""
    drafts = {"base": engine.draft.model}
    for name, folder in fitted.items():
        drafts[f"{name}-llamacpp"] = load_model(folder, backend="llamacpp", tokenizer=False).model
    if on_torch:
        name, folder = next(iter(fitted.items()))
        drafts[f"{name}-torch"] = load_model(folder, backend="torch", tokenizer=False).model
    return drafts


def report(totals: dict, sims: Sims, reps: int) -> None:
    """Token-weighted means of the divergences (and of the target's entropy, row
    ``target``), block-weighted means of the simulations."""
    for name, rows in totals.items():
        n = sum(t for t, _ in rows)
        mean = tuple(sum(t * f[i] for t, f in rows) / n for i in range(len(rows[0][1])))
        if name == "target":
            print(f"the target's entropy over {n} tokens: {mean[0]:.3f} nats a token")
        else:
            print(f"{name}, over {n} tokens: D2 %.3f KL %.3f TV %.3f" % mean)
    for (name, n, k), rows in sims.items():
        b = sum(c for c, _ in rows)
        mean = {key: sum(c * s[key] for c, s in rows) / b for key in rows[0][1] if key != "blocks"}
        print(f"{name} N={n} K={k}, {b} blocks x {reps}: simulated round ESS "
              f"{mean['ess']:.2f}, large-N {mean['ess_large_n']:.2f}; -log p a token: kept "
              f"{mean['kept_nll']:.3f}, drafted {mean['draft_nll']:.3f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fitted", nargs="+", required=True, help="fitted drafts: [NAME=]FOLDER")
    ap.add_argument("--records", type=Path, required=True, help="a GSM8K results.jsonl")
    ap.add_argument("--method", default="ar", help="whose answers (a method of the records)")
    ap.add_argument("--answers", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--torch", action="store_true", help="also the first fitted on torch")
    ap.add_argument("--blocks", action="append", default=[], help="N,K: simulate SMC-SD rounds")
    ap.add_argument("--reps", type=int, default=64, help="simulated rounds a block")
    ap.add_argument("--draft-temperatures", default="", help="e.g. 0.5,0.6: drafts also at these")
    args = ap.parse_args()
    engine = Engine.load()
    drafts = load_drafts(engine, parse_drafts(args.fitted), args.torch)
    on_torch = [name for name in drafts if name.endswith("-torch")]
    settings = [tuple(int(v) for v in b.split(",")) for b in args.blocks]
    temps = [args.temperature] + [float(t) for t in args.draft_temperatures.split(",") if t]
    gen = torch.Generator().manual_seed(0)
    items = {it.id: it for it in gsm8k.load_gsm8k()}
    records = [json.loads(line) for line in args.records.read_text().splitlines() if line]
    records = [r for r in records if r["method"] == args.method][: args.answers]
    print(f"answers: {args.method} of {args.records}, T = {args.temperature}")
    totals: dict[str, list[tuple[int, tuple[float, ...]]]] = {}
    sims: Sims = {}
    for r in records:
        prompt = engine.encode(gsm8k.build_messages(items[r["item"]].question))
        answer = engine.target.tokenizer.encode(r["output"], add_special_tokens=False)
        ids, p = prompt + answer, len(prompt)
        lp, _ = log_probs(engine.target.model, ids, p, args.temperature)
        entropy = -(lp.exp() * lp).sum(-1).mean().item()
        print(f"{r['item']}: {len(answer)} tokens, the target's entropy {entropy:.3f} nats a token")
        totals.setdefault("target", []).append((len(answer), (entropy,)))
        logits = {}
        for model_name, model in drafts.items():
            _, logits[model_name] = log_probs(model, ids, p, args.temperature)
            for t in temps if not model_name.endswith("-torch") else temps[:1]:
                name = model_name if t == args.temperature else f"{model_name} at T {t}"
                lq = torch.log_softmax(logits[model_name] / t, -1)
                figs = divergences(lp, lq)
                totals.setdefault(name, []).append((len(answer), figs))
                print(f"{r['item']} {name}: {len(answer)} tokens, D2 %.3f KL %.3f TV %.3f" % figs)
                for n, k in settings:
                    if sim := simulate_rounds(lp, lq, n, k, args.reps, gen):
                        sims.setdefault((name, n, k), []).append((sim.blocks, asdict(sim)))
        if on_torch:
            torch_name = on_torch[0]
            cpp = logits[torch_name.replace("-torch", "-llamacpp")]
            diff = (cpp - logits[torch_name]).abs().max().item()
            apart = (logits["base"] - logits[torch_name]).abs().max().item()
            print(f"  largest logit difference, fitted llama.cpp vs torch {diff:.3f} "
                  f"(base vs fitted {apart:.3f})")  # fmt: skip
    report(totals, sims, args.reps)


if __name__ == "__main__":
    main()
