"""Re-run single GSM8K questions as the GSM8K harness runs them (same chat prompt, seed =
the question's index) with SMC-SD under both ``finished_particles`` rules, and print each
output's start, its length, the request's stats and, with ``--particles``, every candidate
particle with its weight.

    python benchmarks/studies/finished_particles_gsm8k.py --questions 25,28,32 -N 8 -K 2
"""

from __future__ import annotations

import argparse

from smcspec.config import GenerationConfig
from smcspec.engine import Engine
from smcspec.eval import gsm8k

STATS = ("rounds", "resamples", "min_ess", "mean_ess", "banked")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", default="25,28,32", help="indices into the test split")
    ap.add_argument("-N", type=int, default=8)
    ap.add_argument("-K", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--particles", action="store_true", help="print every candidate")
    args = ap.parse_args()
    items = gsm8k.load_gsm8k(gsm8k.packaged_test_path(), None, 0)
    engine = Engine.load(backend="llamacpp", threads=args.threads)
    for idx in (int(q) for q in args.questions.split(",")):
        for rule in ("keep", "bank"):
            cfg = GenerationConfig(
                method="smc", particles=args.N, draft_tokens=args.K, max_new_tokens=512,
                temperature=0.7, draft_temperature=0.7, seed=idx, return_particles=True,
                finished_particles=rule,
            )  # fmt: skip
            r = engine.generate(gsm8k.build_messages(items[idx].question), cfg)
            stats = {k: round(r.stats[k], 2) for k in STATS}
            print(f"gsm8k-{idx} {rule}: {r.new_tokens} tokens {r.text[:40]!r} {stats}")
            for p in r.particles if args.particles else []:
                print(f"    weight {p['weight']:.3g}: {p['tokens']} tokens {p['text'][:40]!r}")


if __name__ == "__main__":
    main()
