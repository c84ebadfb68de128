"""llama.cpp's own ``llama-speculative`` beside our systems in the GPU campaign (issue 64, item 6).

``scripts/build_llamacpp_libs.sh --tools`` builds it from the carried llama.cpp, for the card
found, in the same build folder as the libraries our llamacpp backend loads (the same
version, the same kernels). :func:`measure` runs it on the campaign's own GGUF files (random
weights at the real shapes, every layer of both models offloaded), ``--spec-draft-n-max K``
with ``--spec-draft-p-min 0`` so that every round drafts K tokens, the campaign's prompt
length, new tokens (end of stream ignored), temperature 0.7 and seed, one process per run.

With random weights its acceptance means nothing, so each row reports what does not depend on
it: the cost of one round (decode seconds / rounds, rounds = drafted tokens / K), and beside it
a **prediction**: its tokens/s at the acceptance ``alpha`` of a real pair
(``--pair-stats``; Leviathan et al. 2023, eq. 1: ``(1 - alpha^(K+1)) / (1 - alpha)`` tokens a
round) = those tokens / the measured round cost. A round that accepts more writes a few more
KV cells: the cost per round is taken as independent of acceptance.
"""

from __future__ import annotations

import re
import statistics
import subprocess
from pathlib import Path

DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
# lines carry llama.cpp's log prefix ("0.00.037.739 I n_drafted = 64")
COUNTS = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s+=\s+(\d+)")


def command(binary: Path, target: Path, draft: Path, k: int, args, seed: int) -> list[str]:
    """The ``llama-speculative`` command line of one run (prompt: ``args.prompt_tokens``
    words of the synthetic vocabulary, which llama.cpp's tokenizer maps to one token each)."""
    gpu = "99" if args.device == "cuda" else "0"
    prompt = " ".join(["ab"] * args.prompt_tokens)
    return [
        str(binary), "-m", str(target), "-md", str(draft), "-ngl", gpu, "-ngld", gpu,
        "-t", str(args.threads), "-td", str(args.threads), "-c", "4096",
        "--spec-draft-n-max", str(k), "--spec-draft-p-min", "0", "-n", str(args.max_new_tokens),
        "--temp", "0.7", "-s", str(seed), "--ignore-eos", "-p", prompt,
    ]  # fmt: skip


def parse(log: str, k: int) -> dict:
    """Tokens, seconds and counts from one run's log.

    Raises:
        ValueError: the log has no ``decoded ... tokens in ... seconds`` line or no counts.
    """
    dec, enc = DECODED.search(log), ENCODED.search(log)
    counts = {name: int(v) for name, v in COUNTS.findall(log)}
    if dec is None or "n_drafted" not in counts:
        raise ValueError("no timings in llama-speculative's log")
    rounds = max(counts["n_drafted"] / k, 1.0)
    decode_s = float(dec[2])
    return {
        "tokens": int(dec[1]),
        "decode_s": decode_s,
        "prompt_s": float(enc[2]) if enc else 0.0,
        "drafted": counts["n_drafted"],
        "accepted": counts.get("n_accept", 0),
        "rounds": rounds,
        "round_s": decode_s / rounds,
    }


def tokens_per_round(alpha: float, k: int) -> float:
    """Expected tokens of one sd round at per-token acceptance ``alpha`` (Leviathan et al.
    2023, eq. 1)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def measure(c, binary: Path, target: Path, draft: Path, base: dict, alpha: float | None) -> None:
    """``--reps`` runs of ``llama-speculative`` per K of ``--speculative-k``; one
    ``llama-speculative`` row per K (medians), or an ``error`` row with the log's tail."""
    args = c.args
    for k in args.speculative_k:
        runs = []
        for rep in range(args.reps):
            if c.left() < args.min_step_s:
                c.skip(f"llama-speculative K={k}: out of time after {rep} runs")
                break
            try:
                runs.append(_run(c, command(binary, target, draft, k, args, seed=rep + 1), k))
            except (subprocess.TimeoutExpired, OSError, ValueError) as exc:
                c.row(kind="error", system=f"llama-speculative-k{k}", error=str(exc)[-1500:],
                      **base)  # fmt: skip
                return
        if not runs:
            continue
        round_s = statistics.median(r["round_s"] for r in runs)
        row = {
            "k": k,
            "reps": len(runs),
            "decode_tokens_per_s": statistics.median(r["tokens"] / r["decode_s"] for r in runs),
            "tokens_per_s": statistics.median(
                r["tokens"] / (r["decode_s"] + r["prompt_s"]) for r in runs
            ),
            "acceptance_random_weights": sum(r["accepted"] for r in runs)
            / max(1, sum(r["drafted"] for r in runs)),
            "round_s": round_s,
            "command": " ".join(command(binary, target, draft, k, args, seed=1)[:-2]),
        }
        if alpha is not None:
            row["alpha"] = alpha
            row["predicted_tokens_per_s"] = tokens_per_round(alpha, k) / round_s
        c.row(kind="llama-speculative", **row, **base)


def _run(c, cmd: list[str], k: int, attempts: int = 2) -> dict:
    """One run, parsed; run again once when its log lacks the timings (seen once in about 50
    runs of the CPU rehearsal: exit status 0, the log cut after the models loaded; llama.cpp
    writes its log from a worker thread).

    Raises:
        ValueError: no timings after ``attempts`` runs (the message ends with the log's tail).
        subprocess.TimeoutExpired, OSError: the binary hung or could not start.
    """
    for attempt in range(attempts):
        out = subprocess.run(
            cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
            timeout=max(30, min(300, c.left())),
        )  # fmt: skip
        log = out.stdout + out.stderr
        try:
            return parse(log, k)
        except ValueError:
            if attempt == attempts - 1:
                raise ValueError(f"no timings (exit {out.returncode}): {log[-1500:]}") from None
    raise AssertionError("unreachable")


def report_lines(rows: list[dict], ar: dict[tuple, float]) -> list[str]:
    """The report's section: one line per ``llama-speculative`` row, beside our ``ar`` of the
    same pair (``ar``: (phase, backend, pair) -> tokens/s at batch 1)."""
    spec = [r for r in rows if r["kind"] == "llama-speculative"]
    if not spec:
        return []
    lines = [
        "## llama.cpp's own llama-speculative (same GGUF files, same build)",
        "",
        "Every round drafts K tokens (`--spec-draft-p-min 0`). Random weights: its acceptance "
        "here means nothing; the round cost does not depend on it. `predicted` is a "
        "**prediction**: tokens a round at the real pair's alpha (Leviathan et al., eq. 1) over "
        "the measured round cost. tokens/s counts prompt processing, as ours does (not model "
        "loading); decode tokens/s does not.",
        "",
        "| pair | K | round ms | tokens/s | decode tokens/s | its acceptance (random) | "
        "predicted tokens/s at alpha | x our ar | runs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in spec:
        ours = ar.get((r["phase"], r["backend"], r["pair"]))
        pred = r.get("predicted_tokens_per_s")
        pred_txt = f"{pred:.1f} (alpha {r['alpha']:.3f})" if pred else "-"
        ratio = f"{pred / ours:.2f} predicted" if pred and ours else "-"
        lines.append(
            f"| {r['pair']} | {r['k']} | {1000 * r['round_s']:.2f} | {r['tokens_per_s']:.1f} | "
            f"{r['decode_tokens_per_s']:.1f} | {r['acceptance_random_weights']:.2f} | "
            f"{pred_txt} | {ratio} | {r['reps']} |"
        )
    return [*lines, "", f"Command (seed 1): `{spec[0]['command']} -p <prompt>`", ""]
