"""Can a prompt's own n-grams tell, before decoding, whether n-gram drafts will pay? (issue 40)

For each prompt, the n-gram index (``smcspec.decoding.sd.ngram.NgramIndex``) is built token by
token over the prompt itself; at each position its proposal (if any) is compared with the
prompt's actual next token. Reported per workload (medians over prompts): the share of
positions with a proposal, and the share of proposals that were right: a model-free proxy
for the acceptance n-gram drafts will see, costing one pass over the prompt's token ids.
Workloads as in ``benchmarks/llamacpp_speculative.py`` (HumanEval rewrite prompts and
ShareGPT first turns), tokenized with the default target's tokenizer (no chat template).

Usage:
  python benchmarks/studies/prompt_ngram_acceptance.py --prompts 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from smcspec import Engine
from smcspec.decoding.sd.ngram import NgramIndex
from smcspec.eval.sharegpt import load_sharegpt_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from ngram_drafts import prompts as rewrite_prompts  # noqa: E402


def self_acceptance(ids: list[int], n_min: int) -> tuple[float, float]:
    """(share of positions with a proposal, share of proposals equal to the next token)."""
    index, proposed, right = NgramIndex(n_min=n_min), 0, 0
    for t in ids:
        p = index.propose(1)
        if p:
            proposed += 1
            right += p[0] == t
        index.extend([t])
    return proposed / len(ids), right / max(proposed, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args()
    tok = Engine.load(backend="llamacpp", threads=1, with_draft=False).tokenizer
    work = {
        "rewrite": rewrite_prompts(args.prompts, "rewrite"),
        "chat": load_sharegpt_prompts(args.prompts, tok, seed=0),
    }
    print("| workload | n-grams from | prompt tokens (median) | positions proposed | "
          "proposals right (median) | per prompt |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|")
    for name, texts in work.items():
        ids = [tok(t)["input_ids"] for t in texts]
        for n_min in (1, 2):
            rows = [self_acceptance(i, n_min) for i in ids]
            print(
                f"| {name} | {n_min} | {statistics.median(len(i) for i in ids):.0f} "
                f"| {statistics.median(r[0] for r in rows):.2f} "
                f"| {statistics.median(r[1] for r in rows):.2f} "
                f"| {', '.join(f'{r[1]:.2f}' for r in rows)} |"
            )


if __name__ == "__main__":
    main()
