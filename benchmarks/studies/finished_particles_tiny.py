"""Length error of SMC-SD's outputs with a stop token, banking vs the paper's rule.

The tiny enumerable pair of ``tests/test_smc_finished_statistical.py`` (3-token vocabulary,
stop token 0, at most 9 tokens; the target ends early with probability 0.31, the draft with
0.94): for each N and each ``finished_particles`` rule, RUNS seeded requests, the total
variation between the exact and the sampled distribution of output lengths, and how often
an output ended before the budget. Writes a Markdown table to stdout.

    python benchmarks/studies/finished_particles_tiny.py --runs 1000 --particles 2,4,8,16
"""

from __future__ import annotations

import argparse
import math
from collections import Counter

import torch

from smcspec.config import GenerationConfig
from smcspec.decoding import decode_smc
from smcspec.eval.exact import stopped_sequence_log_probs, tiny_transformer

PROMPT, V, LENGTH, STOP, K = [1, 2, 0], 3, 9, 0, 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--particles", default="2,4,8,16")
    args = ap.parse_args()
    target = tiny_transformer(seed=1, vocab=V, scale=0.6)
    draft = tiny_transformer(seed=2, vocab=V, scale=0.6)
    exact = stopped_sequence_log_probs(target, PROMPT, LENGTH, 1.0, STOP)
    want: Counter = Counter()
    for seq, lp in exact.items():
        want[len(seq)] += math.exp(lp)
    early = 1 - want[LENGTH]
    print(f"target: P(ends before {LENGTH} tokens) = {early:.3f}; K = {K}, {args.runs} runs\n")
    print("| N | rule | P(ends early) | length TV |\n|---:|---|---:|---:|")
    for n in (int(x) for x in args.particles.split(",")):
        for rule in ("keep", "bank"):
            cfg = GenerationConfig(
                method="smc", max_new_tokens=LENGTH, particles=n, draft_tokens=K,
                temperature=1.0, draft_temperature=1.0, finished_particles=rule,
            )  # fmt: skip
            got: Counter = Counter()
            for i in range(args.runs):
                g = torch.Generator().manual_seed(i)
                out = decode_smc(target, draft, PROMPT, cfg, frozenset({STOP}), V, g)
                got[len(out.tokens)] += 1 / args.runs
            tv = 0.5 * sum(abs(want[m] - got[m]) for m in set(want) | set(got))
            print(f"| {n} | {rule} | {1 - got[LENGTH]:.3f} | {tv:.3f} |", flush=True)


if __name__ == "__main__":
    main()
