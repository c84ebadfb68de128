"""The burst that used to break ``smcspec serve`` (issue 16), run against the real pair.

Starts ``smcspec serve`` (default pair, llamacpp backend) as a subprocess on a free
127.0.0.1 port and sends, all at once (loopback only, bounded count and time):

* six chat requests with ``"smc": {"particles": 64, "draft_tokens": 2}`` and ``max_tokens`` 6
  (65 sequence ids each on both models, of 256: at most three fit at a time);
* two more that the client abandons (a 0.5 s timeout, and a stream closed after one event);
* one that can never fit (256 particles).

Then it waits until ``/metrics`` shows nothing running or waiting and every pool full, and
sends one fresh 4-particle request. It records every status code, the time to recover
(from the burst's start until the pools are full again) and the pool gauges, and writes a
Markdown report.

Usage:
  python benchmarks/serve_burst.py --out docs/benchmarks/serve-burst-cpu.md
"""

from __future__ import annotations

import argparse
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serve_process import serve

from smcspec.tuning.cache import cpu_model

QUESTION = "Write a haiku about caches."


def _body(particles: int, max_tokens: int = 6, stream: bool = False) -> dict:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": max_tokens,
        "seed": 0,
        "stream": stream,
        "smc": {"method": "smc", "particles": particles, "draft_tokens": 2},
    }


def _metrics(base: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def _pools_full(m: dict[str, float]) -> bool:
    caps = {k[len("smcspec_pool_capacity") :]: v for k, v in m.items() if "pool_capacity" in k}
    return bool(caps) and all(m["smcspec_pool_free" + k] == v for k, v in caps.items())


def _send(base: str, kind: str) -> tuple[str, int | str, float]:
    url = base + "/v1/chat/completions"
    t0 = time.perf_counter()
    try:
        if kind == "burst":
            code: int | str = httpx.post(url, json=_body(64), timeout=900).status_code
        elif kind == "never-fits":
            code = httpx.post(url, json=_body(256), timeout=900).status_code
        elif kind == "disconnect":
            code = httpx.post(url, json=_body(64, 64), timeout=0.5).status_code
        else:  # stream-cancel
            with httpx.stream("POST", url, json=_body(64, 64, True), timeout=900) as r:
                for _ in r.iter_lines():
                    break
                code = r.status_code
    except httpx.TimeoutException:
        code = "client gone"
    return kind, code, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    options = ["--served-model-name", "default", "--method", "smc", "-N", "4", "-K", "4"]
    with serve(*options) as base:
        kinds = ["burst"] * 6 + ["disconnect", "stream-cancel", "never-fits"]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(kinds)) as pool:
            results = list(pool.map(lambda k: _send(base, k), kinds))
        recovered = None
        while time.perf_counter() - t0 < 900:
            m = _metrics(base)
            idle = m["smcspec_running_requests"] == 0 and m["smcspec_waiting_requests"] == 0
            if idle and _pools_full(m):
                recovered = time.perf_counter() - t0
                break
            time.sleep(0.2)
        health = httpx.get(base + "/health", timeout=10).status_code
        t1 = time.perf_counter()
        fresh = httpx.post(base + "/v1/chat/completions", json=_body(4), timeout=900)
        fresh_s = time.perf_counter() - t1
        pools = {k: v for k, v in _metrics(base).items() if k.startswith("smcspec_pool_")}
    lines = [
        f"# `smcspec serve` under the burst of issue 16 ({date.today()})",
        "",
        f"Machine: {cpu_model()}, {platform.machine()}, Python {platform.python_version()}; "
        "default pair on the llamacpp backend (256 sequence ids and 32768 KV cells per model).",
        "",
        "Command: `python benchmarks/serve_burst.py" + (f" --out {args.out}`" if args.out else "`"),
        "",
        "| request | status | seconds |",
        "|---|---|---:|",
        *[f"| {k} | {c} | {s:.1f} |" for k, c, s in results],
        "",
        f"- 500s: {sum(1 for _, c, _ in results if c == 500)}",
        "- pools full again, nothing running or waiting: "
        + (f"after {recovered:.1f} s from the burst" if recovered else "NOT within 900 s"),
        f"- `/health` afterwards: {health}",
        f"- a fresh 4-particle request afterwards: {fresh.status_code} in {fresh_s:.1f} s",
        "",
        "Pool gauges afterwards:",
        "",
        *[f"- `{k}` = {v:g}" for k, v in sorted(pools.items())],
        "",
    ]
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
