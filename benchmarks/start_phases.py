"""Where a start of the default pair on the llamacpp backend goes, phase by phase.

Runs one child process per start, all on one empty ``SMCSPEC_CACHE`` (a temporary directory,
removed at the end): the first finds nothing but the installed model packages, the later ones
find everything cached. Each child times, in order, what ``smcspec generate`` does before its
first forward:

  imports     torch, transformers and smcspec
  model files assembling (first start) and verifying the two GGUF files
  tokenizer   the target's tokenizer files written from the GGUF metadata (first start), and
              loaded (the draft of a llamacpp pair has none)
  models      the two llama.cpp models and their contexts, and the vocabulary check
  tuning      the forward-cost measurement (first start) or reading its cache

Usage:
  python benchmarks/start_phases.py --starts 3 --out docs/benchmarks/llamacpp-cpu/start
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

PHASES = ("imports", "model files", "tokenizer", "models", "tuning")


def child() -> None:
    """One start, its phases timed; prints one JSON object."""
    times: dict[str, float] = {}
    t = time.perf_counter()
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from smcspec import Engine
    from smcspec.backends.llamacpp import LlamaCppSettings
    from smcspec.models.default_pair import DEFAULT_DRAFT, DEFAULT_TARGET, ensure_packaged_model
    from smcspec.models.loading import cache_root, gguf_tokenizer, load_model
    from smcspec.tuning import tune

    times["imports"] = time.perf_counter() - t
    t = time.perf_counter()
    paths = [ensure_packaged_model(s, cache_root()) for s in (DEFAULT_TARGET, DEFAULT_DRAFT)]
    times["model files"] = time.perf_counter() - t
    t = time.perf_counter()
    tok = gguf_tokenizer(paths[0], DEFAULT_TARGET.sha256)
    times["tokenizer"] = time.perf_counter() - t
    t = time.perf_counter()
    settings = LlamaCppSettings()
    target = load_model(paths[0], sha256=DEFAULT_TARGET.sha256, llamacpp=settings, tokenizer=False)
    target.tokenizer = tok
    draft = load_model(paths[1], sha256=DEFAULT_DRAFT.sha256, llamacpp=settings, tokenizer=False)
    engine = Engine(target, draft)
    times["models"] = time.perf_counter() - t
    t = time.perf_counter()
    tune(engine)
    times["tuning"] = time.perf_counter() - t
    print(json.dumps({k: round(v, 2) for k, v in times.items()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=3, help="the first start, then later ones")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child()
    from smcspec.tuning.cache import cpu_model

    cache = Path(tempfile.mkdtemp(prefix="smcspec-phases-"))
    rows = []
    try:
        for i in range(args.starts):
            env = dict(os.environ, SMCSPEC_CACHE=str(cache))
            proc = subprocess.run(
                [sys.executable, __file__, "--child"], env=env, capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise SystemExit(f"start {i} failed:\n{proc.stderr[-3000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row["start"] = "first" if i == 0 else f"later {i}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    lines = [
        "# Where a start goes (default pair, llamacpp backend)",
        "",
        f"{date.today().isoformat()}; {cpu_model()}, {os.cpu_count()} CPUs; seconds per phase, "
        "each start a fresh process on one SMCSPEC_CACHE that starts empty.",
        "",
        "Command: `python benchmarks/start_phases.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "| start | " + " | ".join(PHASES) + " | total |",
        "|---|" + "---:|" * (len(PHASES) + 1),
    ]
    for r in rows:
        total = sum(r[p] for p in PHASES)
        cells = " | ".join(f"{r[p]:.2f}" for p in PHASES)
        lines.append(f"| {r['start']} | {cells} | {total:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "phases.md").write_text(text)


if __name__ == "__main__":
    main()
