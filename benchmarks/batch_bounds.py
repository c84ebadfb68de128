"""The aggregate-throughput bounds docs/gpu.md quotes for many concurrent requests.

Computed, not measured (:func:`smcspec.eval.roofline.batch_bound`): per forward the longer
of one read of its weights and 2 FLOPs per parameter per token row. Defaults: Llama-3.1-8B /
3.2-1B in bf16 on an H200 (datasheet 4.8 TB/s, 989 TFLOP/s dense bf16); ``--fp8`` halves the
weight bytes and doubles the peak (1,979 TFLOP/s dense FP8).

Usage: python benchmarks/batch_bounds.py [--fp8]
"""

from __future__ import annotations

import argparse

from smcspec.eval.roofline import batch_bound

WEIGHTS_BF16 = (15.0e9, 2.5e9)  # bytes a forward reads: target, draft (tied embedding once)
WEIGHTS_FP8 = (8.0e9, 1.5e9)  # projections in FP8, embeddings and norms in bf16
PARAMS = (8.0e9, 1.24e9)
SETTINGS = [(8, 8), (8, 2), (4, 8), (4, 4), (4, 2), (2, 8), (2, 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp8", action="store_true", help="FP8 weights and peak")
    ap.add_argument("--bandwidth", type=float, default=4.8e12)
    args = ap.parse_args()
    weights, flops = (WEIGHTS_FP8, 1979e12) if args.fp8 else (WEIGHTS_BF16, 989e12)
    print("| requests | N | K | ar bound tokens/s | SMC-SD bound tokens/s | x ar |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch in (1, 4, 8, 16, 32):
        for n, k in SETTINGS:
            b = batch_bound(weights, PARAMS, n, k, batch, args.bandwidth, flops)
            print(
                f"| {batch} | {n} | {k} | {b['ar_bound_tps']:.0f} | {b['smc_bound_tps']:.0f} "
                f"| {b['bound_speedup']:.2f} |"
            )


if __name__ == "__main__":
    main()
