"""Is a shape's first forward slower than the next ones, once its row count's first forward ran?

For each model and row count: a fresh cache, a 100-token prefill, then four forwards of each
token count in order, each rolled back; prints the first forward's milliseconds and the next
three's (docs/benchmarks/tuner-warm-up/).

  python benchmarks/tuner_warm_up.py llamacpp      # the real default pair on llama.cpp
  python benchmarks/tuner_warm_up.py torch         # its draft, float32 and bfloat16
"""

from __future__ import annotations

import sys
import time

import torch

from smcspec import Engine
from smcspec.models import load_model
from smcspec.models.default_pair import DEFAULT_DRAFT, ensure_packaged_model
from smcspec.models.loading import cache_root

LLAMACPP_SHAPES = ((1, (1, 3, 5, 9)), (4, (1, 3, 5, 9)), (8, (1, 3, 9)), (16, (1, 3, 5)))
TORCH_SHAPES = ((1, (1, 3, 5, 9)), (8, (1, 3, 9)))


def first_and_next(model, label: str, shapes) -> None:
    """Print ``label rows tokens first [next three]`` in milliseconds for every shape."""
    for rows, tokens in shapes:
        cache = model.new_cache(rows, max(tokens), shared_rows=False)
        model.prefill((torch.arange(100) + 1000) % model.vocab_size, cache)
        for t in tokens:
            x = torch.full((rows, t), 500)
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                model.decode(x, cache, last_only=t <= 2)
                times.append(time.perf_counter() - t0)
                cache.truncate(0)
            ms = [round(s * 1000) for s in times]
            print(label, rows, t, f"first {ms[0]} ms, then {ms[1:]}", flush=True)
        cache.close()


def main(backend: str) -> None:
    if backend == "llamacpp":
        engine = Engine.load()
        first_and_next(engine.target.model, "target", LLAMACPP_SHAPES)
        first_and_next(engine.draft.model, "draft", LLAMACPP_SHAPES)
        return
    path = ensure_packaged_model(DEFAULT_DRAFT, cache_root())
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(path, dtype=dtype, backend="torch", sha256=DEFAULT_DRAFT.sha256)
        first_and_next(loaded.model, dtype, TORCH_SHAPES)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llamacpp")
