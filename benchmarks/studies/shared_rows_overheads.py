"""Where an SMC-SD request spends its time outside the forwards, with distinct rows.

``profile N K``: cProfile of one ``smc`` request (96 tokens, EOS ignored, seed 1, llamacpp
backend, 2 threads) on the default pair, the top functions by own time, and the request's
tokens/s and distinct fraction. ``gather``: one-thread timings of gathering the logits of
shared rows (``index_select`` of a 151,936-token vocabulary: 144 rows from 88, 36 from 22,
8 from 5) beside the decoders' log-softmax over the same rows.

Usage:
  python benchmarks/studies/shared_rows_overheads.py profile 8 4
  python benchmarks/studies/shared_rows_overheads.py gather
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from smcspec import Engine, GenerationConfig


def profile(particles: int, draft_tokens: int) -> None:
    engine = Engine.load(backend="llamacpp", threads=2)
    warm = GenerationConfig(method="smc", particles=4, draft_tokens=4, max_new_tokens=8, seed=0)
    engine.generate("Hello", warm)
    cfg = GenerationConfig(
        method="smc",
        particles=particles,
        draft_tokens=draft_tokens,
        max_new_tokens=96,
        ignore_eos=True,
        seed=1,
    )
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    r = engine.generate("Explain how a hash map works, with an example in Python.", cfg)
    prof.disable()
    print(
        f"wall {time.perf_counter() - t0:.2f} s, {r.tokens_per_second:.2f} tokens/s, "
        f"distinct target rows {r.stats['distinct_rows_target']:.2f}"
    )
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def gather(vocab: int = 151936, reps: int = 20) -> None:
    torch.set_num_threads(1)
    for rows, distinct in ((144, 88), (36, 22), (8, 5)):
        x = torch.randn(distinct, vocab)
        idx = torch.randint(0, distinct, (rows,))
        for _ in range(3):
            y = x.index_select(0, idx)
        t0 = time.perf_counter()
        for _ in range(reps):
            y = x.index_select(0, idx)
        copy = (time.perf_counter() - t0) / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.log_softmax(y / 0.7, -1)
        lsm = (time.perf_counter() - t0) / reps
        print(f"{rows} rows from {distinct}: gather {copy * 1e3:.1f} ms, "
              f"log-softmax {lsm * 1e3:.1f} ms")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("profile")
    p.add_argument("particles", type=int)
    p.add_argument("draft_tokens", type=int)
    sub.add_parser("gather")
    args = ap.parse_args()
    if args.what == "profile":
        profile(args.particles, args.draft_tokens)
    else:
        gather()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
