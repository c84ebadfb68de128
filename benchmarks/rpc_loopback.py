"""The cost of llama.cpp RPC on loopback: the default target's forwards locally and through
one and two ``smcspec rpc-server`` processes on this machine, and ``ar`` against ``smc``
through them.

Loopback shows the protocol's overhead (serialising, copying, one process waiting on
another), not a network: every byte stays in memory. To say what a real link adds, the
script also runs the one-server forwards through a TCP proxy that delays each request that
follows a reply by ``--delay-ms`` (one simulated round trip): the slope of the forward time
against that delay is the number of round trips a forward makes, measured, from which a 1 ms
or 10 ms link's cost per token follows for each method (forwards per token from the
decoders' own counts).

Forwards: median of 7 (after one warm-up) decode forwards of 1, 9 (1 x 9: sd/ar-like) and
36 (4 x 9: SMC-SD N=4 K=8) rows after a 100-token prompt. Generation: 3 GSM8K prompts,
96 tokens, T=0.7, ``ar`` and ``smc`` N=8 K=2 (the tuned default) with the draft local;
tokens/s over the request's wall time, prefill of the ~150-token prompt included.

Usage:
  python benchmarks/rpc_loopback.py --out docs/benchmarks/rpc-loopback
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

import torch
from serve_process import free_port
from shared_forward_cost import time_decode

from smcspec import Engine, GenerationConfig
from smcspec.eval.gsm8k import build_messages, load_gsm8k

SHAPES = ((1, 1), (1, 9), (4, 9))


def start_server(threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "smcspec", "rpc-server", "--port", str(port)]
    proc = subprocess.Popen(cmd + ["--threads", str(threads)], stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("rpc-server did not start")


class DelayProxy:
    """A loopback TCP proxy that waits ``delay_s`` before forwarding the first bytes a client
    sends after the server last answered: one simulated network round trip per exchange."""

    def __init__(self, target: str, delay_s: float) -> None:
        self.host, port = target.rsplit(":", 1)
        self.target_port, self.delay_s = int(port), delay_s
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()

    async def _start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _handle(self, creader, cwriter) -> None:
        sreader, swriter = await asyncio.open_connection(self.host, self.target_port)
        state = {"answered": True}

        async def up():
            while data := await creader.read(1 << 20):
                if state["answered"]:
                    state["answered"] = False
                    await asyncio.sleep(self.delay_s)
                swriter.write(data)
                await swriter.drain()
            swriter.close()

        async def down():
            while data := await sreader.read(1 << 20):
                state["answered"] = True
                cwriter.write(data)
                await cwriter.drain()
            cwriter.close()

        await asyncio.gather(up(), down())

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"


def forward_ms(model, rows: int, tokens: int, reps: int = 7) -> float:
    prompt = (torch.arange(100) + 1000) % model.vocab_size
    batch = (torch.arange(rows * tokens).reshape(rows, tokens) * 7 + 500) % model.vocab_size
    return time_decode(model, prompt, rows, batch, shared=False, reps=reps)


def load(rpc: list[str] | None, threads: int, with_draft: bool = False) -> Engine:
    return Engine.load(backend="llamacpp", threads=threads, with_draft=with_draft,
                       rpc=",".join(rpc) if rpc else None)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--delay-ms", type=float, default=25.0)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    servers = [start_server(args.threads) for _ in range(2)]
    eps = [ep for _, ep in servers]
    records = []
    try:
        proxy = DelayProxy(eps[0], args.delay_ms / 1e3)
        setups = {"local": None, "rpc x1": eps[:1], "rpc x2": eps,
                  f"rpc x1 +{args.delay_ms:g} ms": [proxy.endpoint]}  # fmt: skip
        for name, rpc in setups.items():
            engine = load(rpc, args.threads)
            for rows, toks in SHAPES:
                ms = forward_ms(engine.target.model, rows, toks)
                records.append({"kind": "forward", "setup": name, "rows": rows * toks, "ms": ms})
                print(f"{name:<16} {rows}x{toks} {ms:8.1f} ms", file=sys.stderr)
            engine.target.model.release()  # while its servers run (llama.cpp aborts otherwise)
        items = load_gsm8k()[: args.prompts]
        for name, rpc in (("local", None), ("rpc x1", eps[:1]), ("rpc x2", eps)):
            engine = load(rpc, args.threads, with_draft=True)
            for i, item in enumerate(items):
                for method in ("ar", "smc"):
                    cfg = GenerationConfig(
                        method=method, particles=8, draft_tokens=2, temperature=0.7,
                        draft_temperature=0.7, max_new_tokens=args.max_new_tokens, seed=i,
                    )  # fmt: skip
                    r = engine.generate(build_messages(item.question), cfg)
                    forwards = r.stats.get("rounds", r.new_tokens) if method == "smc" else (
                        r.new_tokens)  # fmt: skip
                    rec = {"kind": "generate", "setup": name, "method": method, "item": i,
                           "tokens_per_second": r.tokens_per_second, "new_tokens": r.new_tokens,
                           "target_forwards": forwards}  # fmt: skip
                    records.append(rec)
                    print(json.dumps(rec), file=sys.stderr)
            engine.target.model.release()
            engine.draft.model.release()
    finally:
        for proc, _ in servers:
            proc.terminate()
    (args.out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report = summary(records, args)
    (args.out / "README.md").write_text(report)
    print(report)
    return 0


def summary(records: list[dict], args: argparse.Namespace) -> str:
    fwd = {(r["setup"], r["rows"]): r["ms"] for r in records if r["kind"] == "forward"}
    setups = list(dict.fromkeys(r["setup"] for r in records if r["kind"] == "forward"))
    delayed = setups[-1]
    lines = [
        f"# llama.cpp RPC on loopback ({date.today()})",
        "",
        f"Default target (Qwen2.5-Coder 1.5B Q4_K_M), llamacpp backend, {args.threads} threads "
        "for the local process and for each `smcspec rpc-server` (all on this one machine; "
        "the servers compute one after the other, each holding half the layers with two).",
        "",
        f"Command: `python benchmarks/rpc_loopback.py {' '.join(sys.argv[1:])}`",
        "",
        "## One target forward (median of 7, ms)",
        "",
        "| rows | " + " | ".join(setups) + " | round trips per forward (measured) |",
        "|---:|" + "---:|" * (len(setups) + 1),
    ]
    trips = {}
    for rows in sorted({r for _, r in fwd}):
        trips[rows] = (fwd[(delayed, rows)] - fwd[("rpc x1", rows)]) / args.delay_ms
        cells = " | ".join(f"{fwd[(s, rows)]:.1f}" for s in setups)
        lines.append(f"| {rows} | {cells} | {trips[rows]:.1f} |")
    lines += [
        "",
        f"Round trips per forward = (forward through the proxy that delays each exchange by "
        f"{args.delay_ms:g} ms - forward through one server) / {args.delay_ms:g} ms.",
        "",
        "## Generation (median tokens/s over the prompts, prefill included; target forwards "
        "per token)",
        "",
        "| setup | ar tokens/s | smc N=8 K=2 tokens/s | ar forwards/token | smc forwards/token "
        "| +1 ms link, ar / smc (ms per token) | +10 ms link, ar / smc (ms per token) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    gen = [r for r in records if r["kind"] == "generate"]
    mean_trips = statistics.mean(trips.values())
    for setup in dict.fromkeys(r["setup"] for r in gen):
        row = {}
        for m in ("ar", "smc"):
            rs = [r for r in gen if r["setup"] == setup and r["method"] == m]
            tps = statistics.median(r["tokens_per_second"] for r in rs)
            fpt = sum(r["target_forwards"] for r in rs) / sum(r["new_tokens"] for r in rs)
            row[m] = (tps, fpt)
        added = {ms: tuple(row[m][1] * mean_trips * ms for m in ("ar", "smc")) for ms in (1, 10)}
        lines.append(
            f"| {setup} | {row['ar'][0]:.2f} | {row['smc'][0]:.2f} | {row['ar'][1]:.2f} | "
            f"{row['smc'][1]:.2f} | {added[1][0]:.1f} / {added[1][1]:.1f} | "
            f"{added[10][0]:.1f} / {added[10][1]:.1f} |"
        )
    lines += [
        "",
        "A link's cost per token = forwards per token x measured round trips per forward x the "
        "link's round-trip time (with two servers, per server, as llama.cpp runs them in turn). "
        "Loopback numbers show the protocol's overhead only: no bandwidth limit, no latency.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
