"""A/B of the llama.cpp context our backend creates against the one llama.cpp's tools create.

Ours (``LlamaCppSettings`` defaults): 32768 KV cells, 256 sequences, one unified cache. The
variant replaces settings given on the command line (e.g. the tools' 4096 cells and 1
sequence). Both engines are loaded in one process; ``ar`` and n-gram ``sd`` (K = 4) are run
on HumanEval rewrite prompts, the engines' order alternating; decode tokens/s (after the
first token), medians.

Usage:
  python benchmarks/studies/llamacpp_context_ab.py kv_cells=4096 max_sequences=1
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import smcspec.models.pair as pair
from smcspec import Engine, GenerationConfig
from smcspec.backends.llamacpp.settings import LlamaCppSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from ngram_drafts import prompts as rewrite_prompts  # noqa: E402

FIELDS = ("kv_cells", "max_sequences", "n_batch")


def main() -> None:
    variant = {k: int(v) for k, v in (a.split("=") for a in sys.argv[1:]) if k in FIELDS}
    print("variant", variant)

    def varied(**kw) -> LlamaCppSettings:
        return LlamaCppSettings(**{**kw, **variant})

    engines = {"ours": Engine.load(backend="llamacpp", threads=2)}
    pair.LlamaCppSettings = varied
    try:
        engines["variant"] = Engine.load(backend="llamacpp", threads=2)
    finally:
        pair.LlamaCppSettings = LlamaCppSettings
    for e in engines.values():
        e.generate("Hello", GenerationConfig(method="ar", max_new_tokens=4, seed=0))
    res: dict[tuple[str, str], list[float]] = {(n, m): [] for n in engines for m in ("ar", "ngram")}
    for rep, text in enumerate(rewrite_prompts(3) * 2):
        for name in list(engines) if rep % 2 == 0 else list(engines)[::-1]:
            for m in ("ar", "ngram"):
                cfg = GenerationConfig(
                    method="ar" if m == "ar" else "sd",
                    draft="ngram" if m == "ngram" else "model",
                    draft_tokens=4,
                    max_new_tokens=96,
                    temperature=0.7,
                    seed=rep,
                    ignore_eos=True,
                )
                first: list[float] = []
                t0 = time.perf_counter()
                r = engines[name].generate(
                    text, cfg, on_text=lambda _, f=first: f or f.append(time.perf_counter())
                )
                res[(name, m)].append((r.new_tokens - 1) / (r.seconds - (first[0] - t0)))
    for (name, m), v in res.items():
        print(name, m, f"median {statistics.median(v):.2f}", [round(x, 1) for x in v])


if __name__ == "__main__":
    main()
