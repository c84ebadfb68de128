"""What a forward with shared rows costs on llama.cpp: a batch whose tokens belong to several
sequences against batches of the same number of distinct rows, on the default target.

Times (median of 7, after one warm-up) decode forwards of 5 tokens after a 100-token
prompt: 8 rows in 4 identical pairs with sharing on (20 distinct rows), 4 distinct rows
without (20), the same 8 rows without sharing (40), 8 identical rows with sharing (5), and
one row (5).

Usage: python benchmarks/shared_forward_cost.py [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from smcspec import Engine


def time_decode(
    model, prompt, rows: int, tokens: torch.Tensor, shared: bool, reps: int = 7
) -> float:
    """Median ms of ``reps`` decode forwards of ``tokens`` ``[rows, T]`` (T <= 15) after
    prefilling ``prompt``, after one warm-up; the cache is truncated between forwards."""
    cache = model.new_cache(rows, 16, shared_rows=shared)
    try:
        model.prefill(prompt, cache)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            model.decode(tokens, cache)
            times.append(time.perf_counter() - t0)
            cache.truncate(0)
        return statistics.median(times[1:]) * 1e3
    finally:
        cache.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    model = Engine.load(backend="llamacpp", threads=args.threads, with_draft=False).target.model
    prompt = (torch.arange(100) + 1000) % model.vocab_size
    base = torch.arange(5)[None] + 500
    four = torch.cat([base + 7 * i for i in range(4)])
    pairs = four.repeat_interleave(2, dim=0)
    cases = [
        ("8 x 5 rows in 4 identical pairs, shared (20 distinct)", 8, pairs, True),
        ("4 x 5 distinct rows (20)", 4, four, False),
        ("8 x 5 rows in 4 identical pairs, every row (40)", 8, pairs, False),
        ("8 x 5 identical rows, shared (5 distinct)", 8, base.repeat(8, 1), True),
        ("1 x 5 (5)", 1, base, False),
    ]
    print("| forward | median ms |\n|---|---:|")
    for name, rows, toks, shared in cases:
        print(f"| {name} | {time_decode(model, prompt, rows, toks, shared):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
