"""Our ``ar`` against llama.cpp: the forward itself, and what we add around it.

Two measurements on the default pair's target GGUF, same thread count:

* **One-token forward**, alternated: our llamacpp backend's ``decode`` of one token after a
  150-token prompt, against llama-cpp-python's ``Llama.eval`` of one token after the same
  prompt; ``--reps`` forwards each per round, ``--rounds`` rounds, median ms per system.
* **Time outside the forward** in ``Engine.generate(method="ar")``: the target's forwards are
  timed as they run (a wrapper around its ``decode_batch`` and ``prefill``); the rest of the
  wall time, per generated token, is sampling, Python and the decoder loop.

Usage:
  python benchmarks/ar_overhead.py --out docs/benchmarks/llamacpp-cpu/ar-overhead.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

from smcspec import Engine, GenerationConfig
from smcspec.models.default_pair import DEFAULT_TARGET, ensure_packaged_model
from smcspec.models.loading import cache_root
from smcspec.tuning.cache import cpu_model

PROMPT_IDS = list(range(1000, 1150))
PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain the difference between a list and a tuple in Python.",
    "Summarize the causes of the French Revolution in a paragraph.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
]


def forward_ab(engine: Engine, path: Path, threads: int, rounds: int, reps: int):
    """Median ms of one-token forwards: ours and llama-cpp-python's, alternated by round."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_threads=threads, n_ctx=4096, verbose=False)
    model = engine.target.model
    ours, theirs = [], []
    for r in range(rounds):
        cache = model.new_cache(1, reps + 1)
        model.prefill(torch.tensor(PROMPT_IDS), cache)
        llm.reset()
        llm.eval(PROMPT_IDS)
        for i in range(reps):
            tok = 2000 + r * reps + i
            t0 = time.perf_counter()
            model.decode(torch.tensor([[tok]]), cache, last_only=True)
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            llm.eval([tok])
            theirs.append(time.perf_counter() - t0)
    return statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3, ours, theirs


def outside_forward(engine: Engine, tokens: int) -> list[tuple[float, float, int]]:
    """Per prompt: (wall s, forward s, new tokens) of one ar generation."""
    model = engine.target.model
    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        return wrapper

    model.decode_batch, model.prefill = timed(model.decode_batch), timed(model.prefill)
    out = []
    for i, text in enumerate(PROMPTS):
        cfg = GenerationConfig(method="ar", max_new_tokens=tokens, ignore_eos=True, seed=i)
        spent[0] = 0.0
        r = engine.generate(text, cfg)
        out.append((r.seconds, spent[0], r.new_tokens))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    engine = Engine.load(with_draft=False)
    threads = engine.target.model.threads
    path = ensure_packaged_model(DEFAULT_TARGET, cache_root())
    engine.generate("Hello", GenerationConfig(method="ar", max_new_tokens=4))  # warm-up
    ours, theirs, o_all, t_all = forward_ab(engine, path, threads, args.rounds, args.reps)
    runs = outside_forward(engine, args.max_new_tokens)
    per_token = [(wall - fwd) / n * 1e3 for wall, fwd, n in runs]
    share = [(wall - fwd) / wall for wall, fwd, _ in runs]
    lines = [
        "# Our ar against llama.cpp: the forward, and the time around it",
        "",
        f"{date.today().isoformat()}; {cpu_model()}, {threads} threads; target {path.name}.",
        "",
        "Command: `python benchmarks/ar_overhead.py " + " ".join(sys.argv[1:]) + "`",
        "",
        f"One-token forward after a {len(PROMPT_IDS)}-token prompt, {args.rounds} rounds x "
        f"{args.reps} alternated:",
        "",
        "| system | median ms | min-max ms |",
        "|---|---:|---:|",
        f"| smcspec llamacpp backend `decode` | {ours:.1f} | "
        f"{min(o_all) * 1e3:.1f}-{max(o_all) * 1e3:.1f} |",
        f"| llama-cpp-python `Llama.eval` | {theirs:.1f} | "
        f"{min(t_all) * 1e3:.1f}-{max(t_all) * 1e3:.1f} |",
        "",
        f"`ar` generation, {args.max_new_tokens} tokens, {len(PROMPTS)} prompts: time outside "
        "the target's forwards (sampling, Python, the decoder loop):",
        "",
        "| prompt | wall s | forwards s | outside, ms a token | outside, share of wall |",
        "|---:|---:|---:|---:|---:|",
        *(
            f"| {i} | {w:.2f} | {f:.2f} | {pt:.2f} | {sh:.1%} |"
            for i, ((w, f, _), pt, sh) in enumerate(zip(runs, per_token, share, strict=True))
        ),
        "",
        f"Median outside the forward: {statistics.median(per_token):.2f} ms a token, "
        f"{statistics.median(share):.1%} of the wall time.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
