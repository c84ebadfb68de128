"""Golden outputs for refactoring: what seeded requests return, and every command's --help.

  python scripts/golden_outputs.py --record docs/golden/outputs.json   # before a change
  python scripts/golden_outputs.py --check docs/golden/outputs.json    # after: exit 1 on a diff

Runs, on both backends (the tiny torch pair of ``tests/tiny_models.py`` and the same
architecture as GGUF files on llama.cpp, one thread), seeded requests of every kind a
refactor could disturb: ``ar``, ``sd`` and ``smc`` at T = 0.7 with a few seeds, greedy
(T = 0) on each method, smc with ``return_particles``, N=1, alpha != 1 and each resampler, a
regex constraint and a JSON-schema constraint on each method, a reward with and without a
twist, top-k/top-p/min-p truncation, ``finished_particles="keep"``, and ``shared_rows``
off. Each record keeps the token ids, the text, the finish reason and the decoder's stats
without timings; ``--check`` wants the tokens identical and every number within 1e-6
(relative) of the record. The byte-exact ``--help`` of every command (at 100 columns) is
recorded too.

Floating-point results depend on the CPU's kernels: record and check on the same machine
(the record names it). Not a test (CI machines differ); a tool for the redesign.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models: the test suite's tiny model builders
os.environ["COLUMNS"] = "100"

TIMING_KEYS = {"tokens_per_second", "tokens_per_s", "wall_s"}  # and every *seconds key


def cases():
    """(name, GenerationConfig) of every recorded request."""
    from smcspec import GenerationConfig
    from smcspec.potentials import JsonSchema, Regex, Reward

    base = GenerationConfig(max_new_tokens=24, temperature=0.7, seed=1)
    out = []
    for method in ("ar", "sd", "smc"):
        for seed in (1, 2, 3):
            out.append((f"{method}-seed{seed}", replace(base, method=method, seed=seed)))
        out.append((f"{method}-greedy", replace(base, method=method, temperature=0.0)))
        out.append(
            (f"{method}-regex", replace(base, method=method, constraint=Regex("[a-z ]{4,30}")))
        )
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        out.append((f"{method}-json", replace(base, method=method, constraint=JsonSchema(schema))))
        out.append(
            (f"{method}-truncated", replace(base, method=method, top_k=20, top_p=0.9, min_p=0.02))
        )
    smc = replace(base, method="smc", particles=4, draft_tokens=3)
    out += [
        ("smc-particles", replace(smc, return_particles=True)),
        ("smc-n1", replace(smc, particles=1)),
        ("smc-alpha", replace(smc, alpha=0.5)),
        ("smc-keep", replace(smc, finished_particles="keep")),
        ("smc-not-shared", replace(smc, shared_rows=False)),
        ("smc-long", replace(smc, max_new_tokens=64, particles=8, draft_tokens=4)),
        ("sd-p-min", replace(base, method="sd", draft_p_min=0.3)),
        ("sd-ngram", replace(base, method="sd", draft="ngram")),
    ]
    for r in ("systematic", "stratified", "multinomial", "residual"):
        out.append((f"smc-{r}", replace(smc, resampler=r, ess_threshold=0.9)))

    def length(texts):
        return [float(len(t)) / 10 for t in texts]

    out += [
        ("smc-reward", replace(smc, reward=Reward(length, beta=1.0))),
        ("smc-twist", replace(smc, reward=Reward(length, beta=0.5, prefix_fn=length))),
    ]
    return out


def clean(value):
    """Stats without timings, floats kept as floats (compared with a tolerance)."""
    if isinstance(value, dict):
        return {
            k: clean(v)
            for k, v in sorted(value.items())
            if k not in TIMING_KEYS and not k.endswith("seconds")
        }
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def run_backend(name: str, engine) -> dict:
    from smcspec.errors import SmcspecError

    out = {}
    for case, cfg in cases():
        try:
            r = engine.generate("ab cd ef", cfg)
        except SmcspecError as exc:  # a refused request is an outcome too
            out[case] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        rec = {
            "tokens": r.token_ids,
            "text": r.text,
            "finish_reason": r.finish_reason,
            "stats": clean(r.stats),
            "log_normalizer": r.log_normalizer,
        }
        if r.particles is not None:
            rec["particles"] = clean(r.particles)
        out[case] = rec
    return out


def helps() -> dict:
    from smcspec.cli import build_parser

    parser = build_parser()
    texts = {"smcspec": parser.format_help()}
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        texts[name] = p.format_help()
    return texts


def record_all() -> dict:
    import torch
    from tiny_models import make_tiny_chat_pair, make_tiny_gguf_chat_engine

    from smcspec import Engine
    from smcspec.backends.torch import load_hf_dir
    from smcspec.tuning.cache import cpu_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SMCSPEC_CACHE"] = str(Path(tmp) / "cache")
        dirs = make_tiny_chat_pair(Path(tmp) / "hf", max_position_embeddings=512)
        runs = {"torch": run_backend("torch", Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1])))}
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            runs["llamacpp"] = {"skipped": "llama_cpp is not installed"}
        else:
            gguf_dir = Path(tmp) / "gguf"
            gguf_dir.mkdir()
            engine = make_tiny_gguf_chat_engine(gguf_dir, max_position_embeddings=512)
            runs["llamacpp"] = run_backend("llamacpp", engine)
    return {
        "machine": f"{cpu_model()}, {platform.machine()}, torch {torch.__version__}",
        "runs": runs,
        "help": helps(),
    }


def compare(a, b, path: str, diffs: list[str]) -> None:
    if isinstance(a, float) or isinstance(b, float):
        if not (isinstance(a, int | float) and isinstance(b, int | float)):
            diffs.append(f"{path}: {a!r} != {b!r}")
        elif not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9):
            diffs.append(f"{path}: {a!r} != {b!r}")
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                diffs.append(f"{path}.{k}: only in the {'record' if k in a else 'new run'}")
            else:
                compare(a[k], b[k], f"{path}.{k}", diffs)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            compare(x, y, f"{path}[{i}]", diffs)
    elif a != b:
        diffs.append(f"{path}: {str(a)[:200]!r} != {str(b)[:200]!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", metavar="FILE")
    mode.add_argument("--check", metavar="FILE")
    a = ap.parse_args(argv)
    with contextlib.redirect_stderr(io.StringIO()):
        now = record_all()
    if a.record:
        Path(a.record).parent.mkdir(parents=True, exist_ok=True)
        Path(a.record).write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        n = sum(len(r) for r in now["runs"].values())
        print(f"recorded {n} requests and {len(now['help'])} help texts to {a.record}")
        return 0
    old = json.loads(Path(a.check).read_text())
    if old["machine"] != now["machine"]:
        print(f"note: recorded on {old['machine']}, checked on {now['machine']}")
    diffs: list[str] = []
    compare(old["runs"], now["runs"], "runs", diffs)
    compare(old["help"], now["help"], "help", diffs)
    for d in diffs[:50]:
        print(d)
    print(f"{len(diffs)} differences" if diffs else "identical within tolerance")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
