"""Which answer tokens carry the fitted draft's extra target NLL (issue 84, step 3's records).

SMC-SD's answers with the chi2 draft have a higher target NLL than with the base draft at the
same settings (``--nll``), yet no fewer right answers. This study re-scores both drafts'
answers to the same GSM8K questions under the target (temperature 1, as ``--nll``: each
record's ``output`` re-encoded, one prefill with every position's logits) and splits each
answer's summed ``-log p`` by token class:

* ``number``: the token holds a digit;
* ``symbol``: only operators, punctuation, brackets and white space (``+ - * / = $ ( ) . ,``,
  line breaks, code fences' back-quotes);
* ``word``: anything else (wording, names, code words).

It prints per draft and class: tokens, their share, mean ``-log p`` a token, and the class's
part of the answers' mean NLL (its summed ``-log p`` over all answer tokens), then the
difference fitted minus base per class, on all paired questions and on those both got right.

  python benchmarks/studies/distill_token_nll.py \\
      --fitted docs/benchmarks/distill-gsm8k/results.jsonl \\
      --base docs/benchmarks/gsm8k-gpu-settings/results.jsonl --method smc-n8-k8 --questions 30
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import distill_compare  # noqa: E402
from distill_divergence import log_probs  # noqa: E402

from smcspec import Engine  # noqa: E402
from smcspec.eval import gsm8k  # noqa: E402

CLASSES = ("number", "symbol", "word")
_SYMBOL = re.compile(r"^[\s+\-*/=$()\[\]{}.,:;!?%<>^`'\"#|_&~\\×÷]*$")


def token_class(piece: str) -> str:
    """``number``, ``symbol`` or ``word`` of one decoded token (see the module's docstring)."""
    if any(c.isdigit() for c in piece):
        return "number"
    return "symbol" if _SYMBOL.match(piece) else "word"


def read(path: Path, method: str, first: int) -> dict[str, dict]:
    """``item -> record`` of ``method`` among GSM8K's first ``first`` questions, from
    :func:`distill_compare.read`."""
    return {
        item: r
        for (m, item), r in distill_compare.read(path).items()
        if m == method and int(item.rsplit("-", 1)[1]) < first
    }


def class_nll(engine: Engine, question: str, output: str) -> dict[str, list[float]]:
    """``class -> [-log p of each token]`` of ``output`` under the target (temperature 1)."""
    prompt = engine.encode(gsm8k.build_messages(question))
    tok = engine.target.tokenizer
    answer = tok.encode(output, add_special_tokens=False)
    lp, _ = log_probs(engine.target.model, prompt + answer, len(prompt), 1.0)
    nll = -lp[torch.arange(len(answer)), torch.tensor(answer)]
    out: dict[str, list[float]] = defaultdict(list)
    for t, x in zip(answer, nll.tolist(), strict=True):
        out[token_class(tok.decode([t]))].append(x)
    return out


def table(title: str, sums: dict[str, dict[str, list[float]]]) -> None:
    """Print one markdown table: per draft and class, tokens, share, mean and part of NLL."""
    print(f"\n{title}\n")
    print("| draft | class | tokens | share | mean -log p | part of mean NLL |")
    print("|---|---|---:|---:|---:|---:|")
    parts: dict[str, dict[str, float]] = {}
    for draft, by_class in sums.items():
        total = sum(len(v) for v in by_class.values())
        parts[draft] = {}
        for c in CLASSES:
            v = by_class.get(c, [])
            parts[draft][c] = sum(v) / total if total else float("nan")
            mean = sum(v) / len(v) if v else float("nan")
            print(
                f"| {draft} | {c} | {len(v)} | {len(v) / total:.3f} | {mean:.3f} "
                f"| {parts[draft][c]:.4f} |"
            )
        print(f"| {draft} | all | {total} | 1 | | {sum(parts[draft].values()):.4f} |")
    if {"fitted", "base"} <= parts.keys():
        diff = {c: parts["fitted"][c] - parts["base"][c] for c in CLASSES}
        print(
            "| fitted - base | | | | | "
            + ", ".join(f"{c} {d:+.4f}" for c, d in diff.items())
            + f"; all {sum(diff.values()):+.4f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fitted", type=Path, required=True, help="the fitted draft's records")
    ap.add_argument("--base", type=Path, required=True, help="the base draft's records")
    ap.add_argument("--method", default="smc-n8-k8")
    ap.add_argument("--first", type=int, default=100, help="GSM8K's first questions")
    ap.add_argument("--questions", type=int, default=100, help="paired questions scored")
    args = ap.parse_args()
    fitted = read(args.fitted, args.method, args.first)
    base = read(args.base, args.method, args.first)
    items = sorted(set(fitted) & set(base), key=lambda i: int(i.rsplit("-", 1)[1]))
    items = items[: args.questions]
    questions = {it.id: it.question for it in gsm8k.load_gsm8k()}
    engine = Engine.load()
    every: dict[str, dict[str, list[float]]] = {
        "fitted": defaultdict(list),
        "base": defaultdict(list),
    }
    both_right: dict[str, dict[str, list[float]]] = {
        "fitted": defaultdict(list),
        "base": defaultdict(list),
    }
    apart = 0.0  # re-scored against the record's own target_nll (its answer as generated)
    for item in items:
        right = fitted[item]["correct"] and base[item]["correct"]
        for draft, recs in (("fitted", fitted), ("base", base)):
            by_class = class_nll(engine, questions[item], recs[item]["output"])
            for c, v in by_class.items():
                every[draft][c] += v
                if right:
                    both_right[draft][c] += v
            scored = [x for v in by_class.values() for x in v]
            apart = max(apart, abs(sum(scored) / len(scored) - recs[item]["target_nll"]))
        print(f"{item} scored", file=sys.stderr, flush=True)
    print(f"{args.method}: fitted {args.fitted}, base {args.base}; {len(items)} paired questions")
    print(f"largest difference of an answer's re-scored mean NLL from its record's: {apart:.4f}")
    table(f"all {len(items)} paired questions", every)
    n_right = sum(fitted[i]["correct"] and base[i]["correct"] for i in items)
    table(f"the {n_right} questions both answered right", both_right)


if __name__ == "__main__":
    main()
