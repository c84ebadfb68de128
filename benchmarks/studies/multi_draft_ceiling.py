"""How many tokens a round could any exact verifier of N drafted chains give on the default pair?

Issue 74 asks multi-draft sd N=8 K=4 for >= 1.3x chain sd K=4's tokens a round; measured
1.09x (``docs/benchmarks/multi-draft-cpu``). This study measures, at the positions of real
outputs, what a node with ``m`` candidates can accept at best, so that the shortfall can be
split into what the verification rule leaves and what the draft's proposals allow.

For every position of each prompt's output (``sd`` K=4, T = ``--temperature`` for both
models, seed = the prompt's index, ``--max-new-tokens`` tokens, EOS ignored) both models'
tempered distributions ``p`` (target) and ``q`` (draft) are read from one teacher-forced
forward each (:func:`smcspec.tuning.measure.pair_log_probs`), restricted to the ``--support``
tokens most likely under either model (the mass left out is recorded). For ``m = 1..8``:

- ``rrs``: the acceptance of our rule with ``m`` i.i.d. candidates
  (:func:`smcspec.sampling.tree_verify.multi_draft_verify`), exact: ``1 - prod_i (1 - beta_i)``
  with ``beta_i = sum_x min(r_{i-1}(x), q(x))`` (``smcspec.tuning.multi_draft``, eq. 1).
- ``iid_bound``: ``sum_x min(p(x), 1 - (1 - q(x))^m)``, an upper bound for any exact rule on
  ``m`` i.i.d. candidates: the token it accepts is one of them, so ``P(accept x) <=
  min(p(x), P(x drafted))`` (as in SpecTr, Sun et al. 2023).
- ``wor_rrs`` / ``wor_bound``: the same for ``m`` candidates drawn *without replacement*
  (Gumbel top-m), verified by recursive rejection with each candidate's proposal the draft
  without the tokens tried before it (Jeon et al. 2024, "Recursive Speculative Decoding"):
  Monte Carlo over ``--draws`` candidate sets per position (seeded).

Tokens a round at depth K, from the per-position means ``a`` (depths independent, as the
tuner's predictions assume): ``1 + sum_{j=1..K} a^j``; with ``m = N`` at every depth this is a
ceiling for N chains (a node never has more than N candidates, and acceptance grows with
``m``); chain sd's is ``m = 1``. Counts only: no clock is read for a claim.

Resumable: one record a prompt in ``--out``/records.jsonl. ``--report`` writes
``--out``/README-table.md.

Usage:
  nohup nice -n 15 .venv/bin/python benchmarks/studies/multi_draft_ceiling.py --prompts 10 \
      --threads 1 --out docs/benchmarks/multi-draft-ceiling >> ceiling.log 2>&1 &
  .venv/bin/python benchmarks/studies/multi_draft_ceiling.py --prompts 10 \
      --out docs/benchmarks/multi-draft-ceiling --report
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from smcspec import Engine, GenerationConfig
from smcspec.eval.sharegpt import load_sharegpt_prompts
from smcspec.sampling.tree_verify import _residual  # the rule's own residual step
from smcspec.tuning.measure import pair_log_probs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from ngram_drafts import prompts as rewrite_prompts  # noqa: E402
from records import append_record, read_records  # noqa: E402

M = 8  # the most candidates a node is measured with
KEYS = ("rrs", "iid_bound", "wor_rrs", "wor_bound")  # a record's per-m sums


def iid_node(p: torch.Tensor, q: torch.Tensor) -> tuple[list[float], list[float]]:
    """``(rrs, iid_bound)`` for ``m = 1..M`` at one node (float64 ``[S]`` each)."""
    r, reject, rrs, bound = p, 1.0, [], []
    for m in range(1, M + 1):
        beta = float(torch.minimum(r, q).sum())
        reject *= 1 - min(beta, 1.0)
        rrs.append(1 - reject)
        r = _residual(r, q)
        bound.append(float(torch.minimum(p, 1 - (1 - q) ** m).sum()))
    return rrs, bound


def wor_node(
    p: torch.Tensor, q: torch.Tensor, draws: int, g: torch.Generator
) -> tuple[list[float], list[float]]:
    """``(wor_rrs, wor_bound)`` for ``m = 1..M`` at one node, over ``draws`` Gumbel top-M
    candidate sets (the first ``m`` of each are a without-replacement sample of ``m``)."""
    s = q.shape[0]
    gumbel = -torch.log(-torch.log(torch.rand(draws, s, generator=g, dtype=torch.float64)))
    order = (q.clamp_min(1e-300).log() + gumbel).topk(M, -1).indices  # [draws, M]
    seen = torch.zeros(draws, s, dtype=torch.bool)
    r = p.expand(draws, s)
    reject = torch.ones(draws, dtype=torch.float64)
    rrs, bound = [], []
    for m in range(M):
        x = order[:, m : m + 1]
        rest = q.masked_fill(seen, 0)
        q_new = rest / rest.sum(-1, keepdim=True).clamp_min(1e-300)
        ratio = (r.gather(1, x) / q_new.gather(1, x).clamp_min(1e-300))[:, 0]
        reject = reject * (1 - ratio.clamp(max=1.0))
        rrs.append(float(1 - reject.mean()))
        r = _residual(r, q_new)
        seen = seen.scatter(1, x, True)
        included = seen.double().mean(0)  # P(x among the first m + 1 drawn)
        bound.append(float(torch.minimum(p, included).sum()))
    return rrs, bound


def prompt_record(lp: torch.Tensor, lq: torch.Tensor, support: int, draws: int, seed: int):
    """Sums over the positions of one output (``lp``, ``lq``: float64 ``[L, V]``)."""
    g = torch.Generator().manual_seed(seed)
    sums = {key: [0.0] * M for key in KEYS}
    lost = 0.0
    for lpi, lqi in zip(lp, lq, strict=True):
        pi, qi = lpi.exp(), lqi.exp()
        top = torch.maximum(pi, qi).topk(support).indices
        p, q = pi[top], qi[top]
        lost = max(lost, 1 - float(p.sum()), 1 - float(q.sum()))
        p, q = p / p.sum(), q / q.sum()
        for key, vals in zip(("rrs", "iid_bound"), iid_node(p, q), strict=True):
            sums[key] = [a + b for a, b in zip(sums[key], vals, strict=True)]
        for key, vals in zip(("wor_rrs", "wor_bound"), wor_node(p, q, draws, g), strict=True):
            sums[key] = [a + b for a, b in zip(sums[key], vals, strict=True)]
    return {"positions": int(lp.shape[0]), "max_mass_left_out": lost, **sums}


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    done = {r["prompt"] for r in read_records(path)}
    engine = Engine.load(backend="llamacpp", threads=args.threads)
    texts = [("chat", t) for t in load_sharegpt_prompts(args.prompts, engine.tokenizer, seed=0)]
    texts += [("code", t) for t in rewrite_prompts(args.prompts, "rewrite")]
    for i, (workload, text) in enumerate(texts):
        if i in done:
            continue
        cfg = GenerationConfig(
            method="sd", draft_tokens=4, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, draft_temperature=args.temperature, seed=i,
            ignore_eos=True,
        )  # fmt: skip
        ids = engine.encode(text)
        result = engine.generate(ids, cfg)
        lp, lq = pair_log_probs(
            engine.target.model, engine.draft.model, ids, result.token_ids,
            args.temperature, args.temperature, engine.vocab,
        )  # fmt: skip
        rec = {"prompt": i, "workload": workload}
        rec.update(prompt_record(lp, lq, args.support, args.draws, seed=i))
        append_record(path, rec)
        print(json.dumps({k: rec[k] for k in ("prompt", "workload", "positions")}), flush=True)


def _tokens_a_round(a: float, k: int) -> float:
    return 1 + sum(a**j for j in range(1, k + 1))


def report(args: argparse.Namespace) -> str:
    recs = read_records(Path(args.out) / "records.jsonl")
    left_out = max((r["max_mass_left_out"] for r in recs), default=0.0)
    lines = [f"Prompts: {len(recs)}; positions: {sum(r['positions'] for r in recs)}; most mass "
             f"left out at a position: {left_out:.1e}.",
             "", "| workload | m | rrs | iid bound | w/o-repl. rrs | w/o-repl. bound |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    means: dict[tuple[str, str], list[float]] = {}
    for workload in ("chat", "code", "all"):
        rows = [r for r in recs if workload in ("all", r["workload"])]
        n = sum(r["positions"] for r in rows)
        if not n:
            continue
        for key in KEYS:
            means[workload, key] = [sum(r[key][m] for r in rows) / n for m in range(M)]
        for m in (1, 2, 4, 8):
            cells = [f"{means[workload, key][m - 1]:.3f}" for key in KEYS]
            lines.append(f"| {workload} | {m} | " + " | ".join(cells) + " |")
    lines += ["", "Tokens a round, `1 + sum_j a^j` with the node acceptance `a` at every depth "
              "(x: over chain sd's, m = 1, same positions; `both`: the mean of the chat and "
              "code figures, the benchmark's equal mix):", "",
              "| workload | K | chain sd | N=8 rrs | N=8 iid bound | N=8 w/o-repl. rrs | "
              "N=8 w/o-repl. bound |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for k in (4, 8):
        figures: dict[str, list[float]] = {}
        for workload in ("chat", "code"):
            if (workload, "rrs") in means:
                chain = _tokens_a_round(means[workload, "rrs"][0], k)
                ceilings = [_tokens_a_round(means[workload, key][M - 1], k) for key in KEYS]
                figures[workload] = [chain, *ceilings]
        if len(figures) == 2:
            figures["both"] = [(a + b) / 2 for a, b in zip(*figures.values(), strict=True)]
        for workload, (chain, *ceilings) in figures.items():
            cells = [f"{chain:.2f}"] + [f"{t:.2f} ({t / chain:.2f}x)" for t in ceilings]
            lines.append(f"| {workload} | {k} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (Path(args.out) / "README-table.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10, help="chat prompts, and as many code")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--support", type=int, default=512, help="tokens kept at a position")
    ap.add_argument("--draws", type=int, default=256, help="candidate sets a position (w/o repl.)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="docs/benchmarks/multi-draft-ceiling")
    ap.add_argument("--report", action="store_true", help="write the table of the records")
    args = ap.parse_args()
    print(report(args) if args.report else run(args) or "done")


if __name__ == "__main__":
    main()
