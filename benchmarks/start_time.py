"""First-start and later-start times of ``smcspec generate`` on the default pair.

Each backend gets its own empty ``SMCSPEC_CACHE`` (a temporary directory, removed at the
end), then ``smcspec generate PROMPT --json`` runs ``--runs`` times in fresh processes:

* the first run starts from nothing but the installed model packages: it assembles the GGUF
  files and checks their SHA-256, writes the tokenizer files, and then does what the backend
  needs (llamacpp: measures the pair's forward costs once to choose N and K; torch:
  dequantizes the pair to float32 safetensors once);
* every later run finds all of it in the cache.

Reported per run: wall time of the whole process, the generation's own seconds (from the
``--json`` output: prefill and decoding), and the difference, which is the start (imports,
cache work, loading, tuning). The cache's size after the first run is given too.

Usage:
  python benchmarks/start_time.py --runs 2 --out docs/benchmarks/llamacpp-cpu/start
  python benchmarks/start_time.py --systems llamacpp   # only the new default
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

from smcspec.tuning.cache import cpu_model

PROMPT = "Write a Python function that checks whether a number is prime."

# system name -> the options after `smcspec generate PROMPT --json`
SYSTEMS = {
    "llamacpp": [],  # today's defaults: llamacpp backend, N and K chosen from measured costs
    "torch-fp32": ["--backend", "torch", "-N", "4", "-K", "4"],  # the default before it
}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_once(options: list[str], cache: Path, max_new_tokens: int, seed: int) -> dict:
    """One ``smcspec generate`` process with ``SMCSPEC_CACHE=cache``; its timings."""
    cmd = [sys.executable, "-m", "smcspec", "generate", PROMPT, "--json"]
    cmd += ["-m", str(max_new_tokens), "--seed", str(seed), *options]
    env = dict(os.environ, SMCSPEC_CACHE=str(cache))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "wall_seconds": round(wall, 2),
        "generate_seconds": round(out["seconds"], 2),
        "start_seconds": round(wall - out["seconds"], 2),
        "new_tokens": out["new_tokens"],
        "tokens_per_second": round(out["tokens_per_second"], 2),
        "setting": (out.get("tuned") or {}).get("setting"),
        "method": out["method"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of SYSTEMS' names")
    ap.add_argument("--runs", type=int, default=2, help="runs per system: the first, then later")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for name in args.systems.split(","):
        cache = Path(tempfile.mkdtemp(prefix=f"smcspec-start-{name}-"))
        try:
            for i in range(args.runs):
                r = run_once(SYSTEMS[name], cache, args.max_new_tokens, args.seed)
                r.update(system=name, run="first" if i == 0 else f"later {i}")
                if i == 0:
                    r["cache_gb"] = round(_dir_bytes(cache) / 1e9, 2)
                rows.append(r)
                print(json.dumps(r), flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    lines = [
        "# First-start and later-start times of `smcspec generate`",
        "",
        f"{date.today().isoformat()}; {cpu_model()}, "
        f"{os.cpu_count()} CPUs; default pair, prompt {PROMPT!r}, "
        f"{args.max_new_tokens} new tokens, each system with its own empty SMCSPEC_CACHE.",
        "",
        "Command: `python benchmarks/start_time.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "| system | run | wall s | start s | generation s | tokens/s | setting | cache after |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        cache_gb = f"{r['cache_gb']} GB" if "cache_gb" in r else ""
        lines.append(
            f"| {r['system']} | {r['run']} | {r['wall_seconds']} | {r['start_seconds']} | "
            f"{r['generate_seconds']} | {r['tokens_per_second']} | "
            f"{r['setting'] or r['method']} | {cache_gb} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.md").write_text(text)
        with open(args.out / "runs.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
