"""What one target forward costs by its number of rows: the price of verifying K drafted tokens.

Loads the default pair's target (llamacpp backend), prefills a ``--context``-token random
prompt, then times one-sequence forwards of 1..9 new rows from that length (each rolled back
after), median of ``--repeats`` after 2 warm-ups. An sd round with K drafted tokens costs one
forward of K+1 rows, so n-gram sd's roofline speed-up over ar is
``mean accepted length x cost(1 row) / cost(K+1 rows)``.

Usage: python benchmarks/verify_cost.py --context 300
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from smcspec import Engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rows", default="1,2,3,5,9")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    model = Engine.load(with_draft=False, backend="llamacpp").target.model
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(1, args.context + 64)
    model.prefill(torch.randint(100, 5000, (args.context,), generator=g), cache)
    length = cache.length
    costs = {}
    for rows in (int(r) for r in args.rows.split(",")):
        times = []
        for _ in range(args.repeats + 2):
            toks = torch.randint(100, 5000, (1, rows), generator=g)
            t0 = time.perf_counter()
            model.decode(toks, cache)
            times.append(time.perf_counter() - t0)
            cache.truncate(length)
        costs[rows] = statistics.median(times[2:])
    print(f"| rows | median ms | x 1 row |   (context {args.context} tokens)")
    print("|---|---|---|")
    for rows, c in costs.items():
        print(f"| {rows} | {c * 1000:.1f} | {c / costs[min(costs)]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
