"""Our sd against llama.cpp's own speculative tools, on the same GGUF files (issue 40).

Systems, alternated prompt by prompt in one run (the order rotates):

* smcspec ``ar``, ``sd`` K=4 with the draft model, ``sd --draft ngram`` K=4 ungated (also gated:
  ``-p0.5``, ``-p0.8`` set ``--draft-p-min``, ``-conf`` adds ``--draft-schedule
  confidence``; ``-default`` is every n-gram default, what ``--method auto`` runs where it
  takes n-gram sd; ``-probe`` drafts nothing, the n-gram loop's own cost; llamacpp backend,
  in this process), each also
  as ``-chain``: with llama.cpp's default sampler
  filters (top-k 40, top-p 0.95, min-p 0.05), which the llama.cpp tools apply;
* ``llama-speculative`` (draft model, ``--spec-draft-n-max 4``) and ``llama-lookup``
  (n-gram lookup decoding, ``--spec-draft-n-max 4``), built from the llama.cpp that
  llama-cpp-python vendors by ``benchmarks/build_llamacpp_tools.sh``, one process per
  prompt.

Same text for everyone: the prompt is rendered with the target's chat template here and given
to both as raw text (special tokens parsed); same threads, temperature, seed, token count
(end of stream ignored). Compared: decode tokens/s, which leaves out prompt processing and
model loading (llama.cpp's ``decoded N tokens in X seconds``; ours: the tokens after the
first over the time after the first token).

Workloads (``--workloads``, both by default): ``rewrite`` (input-grounded: HumanEval canonical
solutions to rewrite, as ``benchmarks/ngram_drafts.py``) and ``chat`` (ShareGPT first turns).
The report gives each system's median tokens/s and, paired per prompt, its ratios to ``ar``.
The llama.cpp tools are built only when one of them is among ``--systems``.

Usage:
  python benchmarks/llamacpp_speculative.py --prompts 4 --max-new-tokens 96 \
      --out docs/benchmarks/llamacpp-speculative/README.md
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from smcspec import Engine, GenerationConfig
from smcspec.tuning.cache import cpu_model

sys.path.insert(0, str(Path(__file__).parent))
from ngram_drafts import prompts as rewrite_prompts  # noqa: E402

OURS = {
    "ar": GenerationConfig(method="ar"),
    "sd-k4": GenerationConfig(method="sd", draft_tokens=4),
    "sd-ngram-k4": GenerationConfig(method="sd", draft="ngram", draft_tokens=4, draft_p_min=0),
    # gated n-gram drafts: only while the target backs the proposals (draft_p_min)
    "sd-ngram-k4-p0.5": GenerationConfig(
        method="sd", draft="ngram", draft_tokens=4, draft_p_min=0.5, draft_schedule="fixed"
    ),
    "sd-ngram-k4-p0.8": GenerationConfig(
        method="sd", draft="ngram", draft_tokens=4, draft_p_min=0.8, draft_schedule="fixed"
    ),
    # the gate also sets the round's length (draft_schedule="confidence")
    "sd-ngram-k4-p0.8-conf": GenerationConfig(
        method="sd", draft="ngram", draft_tokens=4, draft_p_min=0.8, draft_schedule="confidence"
    ),
    "sd-ngram-k4-p0.7-conf": GenerationConfig(
        method="sd", draft="ngram", draft_tokens=4, draft_p_min=0.7, draft_schedule="confidence"
    ),
    # what ``--method auto`` runs where it takes n-gram sd (smcspec.tuning.predict.choose)
    "sd-ngram-k4-default": GenerationConfig(method="sd", draft="ngram", draft_tokens=4),
    # p_min 1: the proposals are probed but (after the first sight of each position) never
    # drafted, so the rounds are one-row steps: what the n-gram loop costs over ``ar``'s
    "sd-ngram-k4-probe": GenerationConfig(
        method="sd", draft="ngram", draft_tokens=4, draft_p_min=1.0, draft_schedule="confidence"
    ),
}
# llama.cpp's tools sample through their default chain (common/common.h: top-k 40, top-p 0.95,
# min-p 0.05, then the temperature); ``-chain`` runs ours with the same filters (applied after
# the temperature here, so top-p and min-p cut a little differently)
CHAIN = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}
OURS |= {f"{n}-chain": GenerationConfig(**{**cfg.__dict__, **CHAIN}) for n, cfg in OURS.items()}
THEIRS = ("llama-speculative-k4", "llama-lookup-k4")
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
ACCEPT = re.compile(r"accept\s+=\s+([\d.]+)%")


def build_tools() -> Path:
    script = Path(__file__).parent / "build_llamacpp_tools.sh"
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def run_tool(bin_dir: Path, name: str, engine: Engine, text: str, args, seed: int) -> dict:
    """One llama.cpp tool run: decode tokens/s and acceptance from its log."""
    tool = "llama-speculative" if name.startswith("llama-speculative") else "llama-lookup"
    cmd = [str(bin_dir / tool), "-m", engine.target.path, "-t", str(args.threads),
           "--temp", str(args.temperature), "-s", str(seed), "-n", str(args.max_new_tokens),
           "-c", "4096", "--ignore-eos", "--spec-draft-n-max", "4", "-p", text]  # fmt: skip
    if tool == "llama-speculative":
        cmd += ["-md", engine.draft.path, "-td", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    m = DECODED.search(log)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"{tool} failed ({out.returncode}): {log[-2000:]}")
    acc = ACCEPT.search(log)
    return {"decode": int(m[1]) / float(m[2]), "acc": float(acc[1]) / 100 if acc else None}


def run_ours(engine: Engine, name: str, text: str, args, seed: int) -> dict:
    run = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": seed}
    cfg = GenerationConfig(**{**OURS[name].__dict__, **run, "ignore_eos": True})
    first: list[float] = []
    t0 = time.perf_counter()
    r = engine.generate(
        text, cfg, chat=False, on_text=lambda _: first or first.append(time.perf_counter())
    )
    ttft = (first[0] if first else time.perf_counter()) - t0
    return {"decode": (r.new_tokens - 1) / max(r.seconds - ttft, 1e-9),
            "acc": r.stats.get("acceptance_rate")}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per workload")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--systems", default=None, help="comma list (default: all)")
    ap.add_argument(
        "--ngram-min", type=int, default=None, help="shortest n-gram our sd-ngram matches"
    )
    ap.add_argument("--workloads", default="rewrite,chat", help="comma list")
    args = ap.parse_args()
    names = [*OURS, *THEIRS]
    if args.systems:
        names = [n for n in names if n in args.systems.split(",")]
    bin_dir = build_tools() if set(names) & set(THEIRS) else None
    engine = Engine.load(backend="llamacpp", threads=args.threads)
    from smcspec.eval.sharegpt import load_sharegpt_prompts

    loaders = {
        "rewrite": lambda: rewrite_prompts(args.prompts, "rewrite"),
        "chat": lambda: load_sharegpt_prompts(args.prompts, engine.tokenizer, seed=args.seed),
    }
    work = {w: loaders[w]() for w in args.workloads.split(",")}
    if args.ngram_min is not None:  # an experiment: the decoder builds its index from here
        import functools

        import smcspec.decoding.sd.ngram as ngram

        ngram.NgramIndex = functools.partial(ngram.NgramIndex, n_min=args.ngram_min)
    engine.generate("Hello", GenerationConfig(method="ar", max_new_tokens=4, seed=0))  # warm-up
    rows = {w: {n: [] for n in names} for w in work}
    for w, texts in work.items():
        for i, prompt in enumerate(texts):
            messages = [{"role": "user", "content": prompt}]
            text = engine.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                seed = args.seed + i
                if name in OURS:
                    row = run_ours(engine, name, text, args, seed)
                else:
                    row = run_tool(bin_dir, name, engine, text, args, seed)
                rows[w][name].append(row)
                print(f"{w} {i} {name}: {row}", file=sys.stderr, flush=True)
    report = _report(args, rows)
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)
    return 0


def _report(args, rows) -> str:
    cmd = "python benchmarks/llamacpp_speculative.py " + " ".join(sys.argv[1:])
    lines = [
        "# Our sd against llama.cpp's llama-speculative and llama-lookup",
        "",
        f"{date.today().isoformat()}, {cpu_model()}, {os.cpu_count()} cores, default pair "
        f"(GGUF), {args.threads} threads, T = {args.temperature}, {args.max_new_tokens} tokens "
        f"{_ngram_note(args)}"
        "(end of stream ignored), K = 4, same chat-templated text for every system, systems "
        "alternated per prompt. Decode tokens/s: prompt processing and loading left out.",
        "",
        f"Command: `{cmd}`",
        "",
    ]
    for w, by in rows.items():
        by = {n: rs for n, rs in by.items() if rs}
        ar, spec, lookup = (_median(by, n) for n in ("ar", "llama-speculative-k4", THEIRS[1]))
        lines += [
            f"## {w} ({len(by['ar'])} prompts)",
            "",
            "| system | median decode tokens/s | x ar | x llama-speculative | x llama-lookup "
            "| median acceptance |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for n, rs in by.items():
            d = statistics.median(r["decode"] for r in rs)
            accs = [r["acc"] for r in rs if r["acc"] is not None]
            acc = f"{statistics.median(accs):.2f}" if accs else "-"
            lines.append(
                f"| {n} | {d:.2f} | {d / ar:.2f} | {d / spec:.2f} | {d / lookup:.2f} | {acc} |"
            )
        lines += ["", *_paired(by), ""]
    return "\n".join(lines) + "\n"


def _paired(by: dict) -> list[str]:
    """Per-prompt ratios to ``ar`` (same prompt, same seed, same run)."""
    if "ar" not in by or len(by) < 2:
        return []
    lines = [
        "Paired per prompt, tokens/s over `ar`'s on the same prompt:",
        "",
        "| system | median ratio | lowest | highest | prompts at or above `ar` |",
        "|---|---:|---:|---:|---:|",
    ]
    for n, rs in by.items():
        if n == "ar":
            continue
        ratios = [r["decode"] / a["decode"] for r, a in zip(rs, by["ar"], strict=True)]
        lines.append(
            f"| {n} | {statistics.median(ratios):.3f} | {min(ratios):.2f} | {max(ratios):.2f} "
            f"| {sum(x >= 1 for x in ratios)} of {len(ratios)} |"
        )
    return lines


def _median(by: dict, name: str) -> float:
    rs = by.get(name) or [{"decode": float("nan")}]
    return statistics.median(r["decode"] for r in rs)


def _ngram_note(args) -> str:
    return "" if args.ngram_min is None else f"(our n-gram drafts from {args.ngram_min}-grams up) "


if __name__ == "__main__":
    raise SystemExit(main())
