"""Why smcspec computes projections as ``(W @ x^T)^T`` instead of ``F.linear(x, W)``.

Times both forms (same weight tensor ``W [out, in]``, float32, CPU) for the row counts
that AR (1), SD (K+1) and SMC-SD (N, N*(K+1)) decoding produce, on the 1.5B target's
projection shapes. Usage: ``python benchmarks/studies/linear_layout.py``.
"""

from __future__ import annotations

import platform
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {
    "gate_up 17920x1536": (17920, 1536),
    "down 1536x8960": (1536, 8960),
    "qkv 2048x1536": (2048, 1536),
}


def median_ms(fn, reps: int = 15) -> float:
    fn()
    ts = []
    for _ in range(reps):
        s = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - s)
    return statistics.median(ts) * 1000


def main() -> None:
    torch.manual_seed(0)
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )
    print("| weight | rows | F.linear ms | (W @ x.T).T ms | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for name, (o, i) in SHAPES.items():
        w = torch.randn(o, i)
        for m in (1, 2, 4, 5, 8, 20):
            x = torch.randn(m, i)
            a = median_ms(lambda x=x, w=w: F.linear(x, w))
            b = median_ms(lambda x=x, w=w: (w @ x.t()).t())
            print(f"| {name} | {m} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
