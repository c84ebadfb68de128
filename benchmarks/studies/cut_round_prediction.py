"""Why the tuner's tokens a round for SMC-SD rounds cut where the ESS falls are low (issue 74).

:func:`smcspec.tuning.predict.predicted_cut_round` (what ``bench --predict`` and ``auto`` price
``smc-nN-kK-ess`` with) draws every particle's per-token log-weight independently from one
pooled set of quantiles. On the GSM8K runs (``docs/benchmarks/gsm8k-frontier``) it predicted
4.41 tokens a round at N=8 K=8 where the runs gave 6.5-7. Two candidate causes: the quantiles
come from other text (the tuner's four short calibration prompts, not GSM8K answers), and
pooling makes particles' log-weights independent where, at one position, all particles face
the same pair of distributions (an easy position gives every particle a log-weight near 0 at once).

This study separates them on the committed ``ar`` answers of the first ``--questions`` GSM8K
questions (their text re-tokenized; the prompt as the harness builds it): both models'
tempered distributions at every position (:func:`smcspec.tuning.measure.pair_log_probs`,
T = 0.7), then, from equal weights, kappa = 0.5:

- ``pooled``: the tuner's simulation on these positions' quantiles
  (:func:`~smcspec.tuning.measure.quantiles_of_log_weights`, then ``predicted_cut_round``);
- ``by position``: ``--rounds`` simulated rounds, each from a random position ``t`` of a
  random answer, particle ``i``'s token ``j`` drawn from the draft's distribution at
  ``t + j`` and weighted ``log p - log q`` there (particles share the positions' distributions;
  their own drafts do not change the context: an approximation);

beside the committed pair file's pooled prediction and the tokens a round the runs measured
(``mean_round_tokens`` of the ``-ess`` records). Counts only: no clock is read for a claim.

Usage:
  nice .venv/bin/python benchmarks/studies/cut_round_prediction.py --questions 20 --threads 1 \
      > docs/benchmarks/gsm8k-frontier/cut-round-prediction.txt
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch

from smcspec import Engine
from smcspec.eval.gsm8k import build_messages, load_gsm8k
from smcspec.tuning.measure import pair_log_probs, quantiles_of_log_weights
from smcspec.tuning.predict import predicted_cut_round

RECORDS = Path("docs/benchmarks/gsm8k-frontier/results.jsonl")
PAIR_FILE = Path("benchmarks/pair_stats/qwen2.5-coder-1.5b-q4km_0.5b.json")
SETTINGS = ((8, 8), (4, 12), (8, 16))
KAPPA = 0.5
SUPPORT = 1024  # draft tokens kept a position (the mass left out is printed)


def _on_draft_support(
    lp: torch.Tensor, lq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Both models' log-probabilities at each position's :data:`SUPPORT` likeliest draft
    tokens (float32 ``[L, SUPPORT]``; the draft's renormalised there), what drawing from the
    draft reads: a whole vocabulary a position in float64 does not fit in memory for long
    answers. Third: the most draft mass left out at a position."""
    top = lq.topk(SUPPORT, -1).indices
    q = lq.gather(1, top)
    kept = q.logsumexp(-1, keepdim=True)
    left = float(1 - kept.exp().min())
    return lp.gather(1, top).float(), (q - kept).float(), left


def by_position(
    logs: list[tuple[torch.Tensor, torch.Tensor]], n: int, k: int, rounds: int, seed: int
) -> float:
    """Mean tokens a round (``j* + 1``) of ``rounds`` simulated cut rounds, the particles
    sharing each position's distributions (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    tokens = []
    for _ in range(rounds):
        lp, lq = logs[int(rng.integers(len(logs)))]
        t = int(rng.integers(lp.shape[0] - k + 1))
        q = lq[t : t + k].exp()  # [K, V]
        x = torch.multinomial(q, n, replacement=True, generator=g).T  # [N, K]
        pos = torch.arange(k)
        logw = (lp[t + pos, x] - lq[t + pos, x]).cumsum(-1).numpy()  # [N, K]
        w = np.exp(logw - logw.max(0, keepdims=True))
        ess = w.sum(0) ** 2 / (w**2).sum(0)  # [K]
        below = ess < KAPPA * n
        tokens.append((int(below.argmax()) if below.any() else k - 1) + 2)
    return float(np.mean(tokens))


def measured(n: int, k: int, items: set[str]) -> tuple[int, float, float]:
    """(answers, median, pooled-by-rounds tokens a round) of the ``smc-nN-kK-ess`` records."""
    recs = [json.loads(line) for line in RECORDS.read_text().splitlines()]
    recs = [r for r in recs if r["method"] == f"smc-n{n}-k{k}-ess" and r["item"] in items]
    if not recs:
        return 0, float("nan"), float("nan")
    per = [r["stats"]["mean_round_tokens"] for r in recs]
    pooled = sum(r["stats"]["mean_round_tokens"] * r["stats"]["rounds"] for r in recs) / sum(
        r["stats"]["rounds"] for r in recs
    )
    return len(recs), statistics.median(per), pooled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    recs = [json.loads(line) for line in RECORDS.read_text().splitlines()]
    ar = {r["item"]: r["output"] for r in recs if r["method"] == "ar"}
    questions = {it.id: it.question for it in load_gsm8k()}
    items = [f"gsm8k-{i}" for i in range(args.questions) if f"gsm8k-{i}" in ar]
    engine = Engine.load(backend="llamacpp", threads=args.threads)
    logs, left_out = [], 0.0
    for item in items:
        ids = engine.encode(build_messages(questions[item]))
        out = engine.encode(ar[item], chat=False)
        lp, lq = pair_log_probs(
            engine.target.model, engine.draft.model, ids, out, 0.7, 0.7, engine.vocab
        )
        *pair, left = _on_draft_support(lp, lq)
        logs.append(tuple(pair))
        left_out = max(left_out, left)
    quantiles = quantiles_of_log_weights(
        torch.cat([p for p, _ in logs]).double(), torch.cat([q for _, q in logs]).double()
    )
    pair = json.loads(PAIR_FILE.read_text())["acceptance"]
    committed = pair["T=0.7,Td=0.7,top_k=0,top_p=1.0,min_p=0.0"]["log_weight_quantiles"]
    positions = sum(p.shape[0] for p, _ in logs)
    print(f"GSM8K answers: {len(items)} (`ar`, questions 0-{args.questions - 1}); positions: "
          f"{positions}; kappa {KAPPA}; T 0.7; {args.rounds} rounds; {SUPPORT} draft tokens "
          f"a position (most draft mass left out: {left_out:.1e}).")  # fmt: skip
    print("| setting | pair file, pooled | these answers, pooled | these answers, by position "
          "| measured (answers: median / pooled) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    for n, k in SETTINGS:
        a = predicted_cut_round(n, k, committed, KAPPA)[0]
        b = predicted_cut_round(n, k, quantiles, KAPPA)[0]
        c = by_position(logs, n, k, args.rounds, seed=0)
        m, med, pooled = measured(n, k, set(items))
        row = f"| smc-n{n}-k{k}-ess | {a:.2f} | {b:.2f} | {c:.2f} | {m}: {med:.2f} / {pooled:.2f} |"
        print(row)


if __name__ == "__main__":
    main()
