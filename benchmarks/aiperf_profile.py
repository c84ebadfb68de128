"""aiperf's ``profile`` against ``smcspec serve`` (the default pair), one server per method.

For each method a server is started (``--method M``, N 4 and K 4 for smc and K 4 for sd),
then aiperf profiles its streaming chat endpoint at each concurrency in fixed-length mode
(``--extra-inputs ignore_eos:true`` and ``min_tokens``, ``--use-server-token-count``),
on synthetic prompts of its own (``--synthetic-input-tokens-mean``). Reported per method and
concurrency: aiperf's time to first token and inter-token latency (median and p90, ms), its
output tokens/s, and the server's own longest gap between streamed tokens
(``smcspec_max_token_gap_seconds``, from ``/metrics``: the mean over the run's requests).

aiperf runs from its own venv (it pins older prometheus-client and huggingface-hub than
smcspec's; ``tests/client_venvs.py`` makes one): pass its executable with ``--aiperf``.

Usage:
  python benchmarks/aiperf_profile.py --aiperf ~/.cache/smcspec/client-venvs/aiperf-*/bin/aiperf \\
      --methods ar,sd,smc --concurrency 1,4 --requests 8 --tokens 64 --threads 2 \\
      --out docs/benchmarks/aiperf-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import date
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from serve_process import serve  # noqa: E402

from smcspec.models.default_pair import DEFAULT_TARGET, ensure_packaged_model  # noqa: E402
from smcspec.models.gguf_convert import tokenizer_dir  # noqa: E402
from smcspec.models.loading import cache_root  # noqa: E402

MODEL = "default"
METHOD_OPTIONS = {
    "ar": ["--method", "ar"],
    "sd": ["--method", "sd", "--draft-tokens", "4"],
    "smc": ["--method", "smc", "--particles", "4", "--draft-tokens", "4"],
}


def gap_totals(base: str) -> dict[str, tuple[float, float]]:
    """``{method: (sum, count)}`` of the server's ``smcspec_max_token_gap_seconds``."""
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for s in fam.samples:
            if s.name.startswith("smcspec_max_token_gap_seconds_"):
                entry = out.setdefault(s.labels["method"], [0.0, 0.0])
                if s.name.endswith("_sum"):
                    entry[0] = s.value
                elif s.name.endswith("_count"):
                    entry[1] = s.value
    return {m: (v[0], v[1]) for m, v in out.items()}


def profile(aiperf: str, base: str, tok: Path, out: Path, args, concurrency: int) -> dict:
    """One aiperf run; its summary JSON."""
    cmd = [aiperf, "profile", "--model", MODEL, "--url", base, "--endpoint-type", "chat",
           "--streaming", "--tokenizer", str(tok), "--concurrency", str(concurrency),
           "--request-count", str(args.requests), "--synthetic-input-tokens-mean",
           str(args.input_tokens), "--output-tokens-mean", str(args.tokens),
           "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
           "--extra-inputs", f"min_tokens:{args.tokens}", "--use-server-token-count",
           "--random-seed", "0", "--output-artifact-dir", str(out),
           "--ui-type", "none"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if "OFFLINE" not in k}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # a closed port: the hub is never reached
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    return json.loads((out / "profile_export_aiperf.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aiperf", required=True, help="aiperf's executable (its own venv)")
    ap.add_argument("--methods", default="ar,sd,smc")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--input-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_dir(ensure_packaged_model(DEFAULT_TARGET, cache_root()), cache_root())
    rows = []
    for method in args.methods.split(","):
        opts = [*METHOD_OPTIONS[method], "--threads", str(args.threads),
                "--served-model-name", MODEL]  # fmt: skip
        with serve(*opts) as base:
            for c in (int(x) for x in args.concurrency.split(",")):
                before = gap_totals(base).get(method, (0.0, 0.0))
                s = profile(args.aiperf, base, tok, out / f"{method}-c{c}", args, c)
                after = gap_totals(base).get(method, (0.0, 0.0))
                n = after[1] - before[1]
                rows.append({
                    "method": method, "concurrency": c, "requests": s["request_count"]["avg"],
                    "ttft_p50_ms": s["time_to_first_token"]["p50"],
                    "ttft_p90_ms": s["time_to_first_token"]["p90"],
                    "itl_p50_ms": s["inter_token_latency"]["p50"],
                    "itl_p90_ms": s["inter_token_latency"]["p90"],
                    "output_tokens_per_s": s["output_token_throughput"]["avg"],
                    "server_mean_max_gap_s": (after[0] - before[0]) / n if n else None,
                    "errors": s.get("error_summary") or [],
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_report(out, rows, args)
    return 0


def write_report(out: Path, rows: list[dict], args) -> None:
    lines = [
        "# aiperf against `smcspec serve` (default pair)",
        "",
        f"{date.today()}; {platform.processor() or platform.machine()}, {os.cpu_count()} "
        f"cores, {args.threads} llama.cpp threads. aiperf 0.13.0, streaming chat, "
        f"{args.requests} requests per concurrency, synthetic prompts of "
        f"{args.input_tokens} tokens, {args.tokens} output tokens in fixed-length mode.",
        "",
        "Command: `python benchmarks/aiperf_profile.py --aiperf AIPERF --methods "
        f"{args.methods} --concurrency {args.concurrency} --requests {args.requests} "
        f"--tokens {args.tokens} --threads {args.threads} --out {out}`",
        "",
        "| method | concurrency | requests | TTFT p50 (ms) | TTFT p90 (ms) | ITL p50 (ms) "
        "| ITL p90 (ms) | output tokens/s | server: mean longest gap (s) | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gap = r["server_mean_max_gap_s"]
        lines.append(
            f"| {r['method']} | {r['concurrency']} | {r['requests']:.0f} | "
            f"{r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | {r['itl_p50_ms']:.0f} | "
            f"{r['itl_p90_ms']:.0f} | {r['output_tokens_per_s']:.2f} | "
            f"{'-' if gap is None else f'{gap:.2f}'} | {len(r['errors'])} |"
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
