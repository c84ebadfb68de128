"""What a decoder does on the host between its fused rounds: device kernels and host reads.

On a GPU every torch operation a decoder runs between two captured rounds is an eager kernel
launch, and every host read (``bool(t)``, ``t.item()``, ``t.tolist()`` ...) waits for the
device and copies back; the sixth lending's cProfile put SMC-SD N=8 K=8's host work at about
3 ms a round at 8B/1B (``docs/benchmarks/gpu-h200-graphs/``). This script counts both for
each method with its rounds run fused (``rounds="eager"``: the code path of CUDA graphs, the
round itself uncaptured) on the tiny shapes of ``benchmarks/gpu_campaign.py``, on a CPU. The
counts are exact and the same on any machine (what they cost is the host's, per launch and
per read). A round in the middle of a request is the difference of a request of ``2 R`` and
one of ``R`` rounds (same seed: the prefill, the first and the last rounds cancel); the
whole request's totals are given beside it.

What runs inside a round (:func:`smcspec.backends.torch.graphs.run_round`) is not counted: a
CUDA graph replays it without the host. Kernels are the aten operations that are not views
(:data:`NOT_KERNELS` aside); reads are what :class:`~smcspec.backends.torch.graphs.HostReadGuard`
records (:data:`~smcspec.backends.torch.graphs.HOST_READS`, boolean indexing, and the aten
operations torch tags data-dependent, :func:`~smcspec.backends.torch.graphs.data_dependent`).

Usage:
  python benchmarks/round_host_work.py [--pair llama] [--n 8] [--k 8] [--rounds 8] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from profile_fused_round import engine_for  # noqa: E402

from smcspec import GenerationConfig  # noqa: E402
from smcspec.backends.torch import transformer  # noqa: E402
from smcspec.backends.torch.graphs import HostReadGuard  # noqa: E402


class HostWork(HostReadGuard):
    """Counts the host reads, by name and by place (none is inside a round: the rounds' own
    guard would raise)."""

    def __init__(self) -> None:
        super().__init__(strict=False)
        self.by_name: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()  # the innermost smcspec line of each

    def record(self, name: str) -> None:
        self.by_name[name] += 1
        self.sites[_site()] += 1


NOT_KERNELS = {"empty", "empty_like", "empty_strided", "_local_scalar_dense", "lift_fresh"}
"""aten operations that launch no device kernel (besides views, which ``is_view`` marks)."""


class Kernels(TorchDispatchMode):
    """Counts the aten operations that would launch a device kernel, outside rounds."""

    def __init__(self) -> None:
        super().__init__()
        self.in_round = 0  # inside a round: a graph replays it without the host
        self.ops: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()  # the innermost smcspec function of each

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.in_round and not func.is_view and name not in NOT_KERNELS:
            self.ops[name] += 1
            self.sites[_site(line=False)] += 1
        return func(*args, **(kwargs or {}))


def _site(line: bool = True) -> str:
    """``module.py:line function`` (``module.py function``) of the innermost frame in
    ``src/smcspec`` outside the read guard's own module."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        mine = "/benchmarks/" in path or path.endswith("/graphs.py")
        if "/smcspec/" in path and not mine:
            where = path.split("/smcspec/")[-1]
            at = f":{frame.f_lineno}" if line else ""
            return f"{where}{at} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def count(engine, prompt: list[int], cfg: GenerationConfig) -> tuple[Counter, ...]:
    """One request with fused rounds: (rounds by kind, kernels, kernels' places, reads,
    reads' places), outside rounds."""
    work, kernels = HostWork(), Kernels()
    rounds: Counter[str] = Counter()
    real = transformer.run_round

    def marked(*args, **kwargs):  # what a graph would replay: not the host's work
        rounds[args[2][0]] += 1  # the key's kind: prefill, ar, sd or smc
        kernels.in_round += 1
        try:
            return real(*args, **kwargs)
        finally:
            kernels.in_round -= 1

    transformer.run_round = marked
    try:
        with work, kernels:
            engine.generate(prompt, cfg)
    finally:
        transformer.run_round = real
    rounds.pop("prefill", None)
    return rounds, kernels.ops, kernels.sites, work.by_name, work.sites


def steady(engine, prompt: list[int], cfg: GenerationConfig, per_round: int, r: int) -> dict:
    """The counts of a request of ``r`` rounds and, per round, of the rounds between ``r`` and
    ``2 r`` (``per_round`` new tokens a round)."""
    engine.generate(prompt, replace(cfg, max_new_tokens=1 + per_round))  # warm-up
    short = count(engine, prompt, replace(cfg, max_new_tokens=1 + r * per_round))
    long = count(engine, prompt, replace(cfg, max_new_tokens=1 + 2 * r * per_round))
    extra = sum(long[0].values()) - sum(short[0].values())

    def per(i: int) -> float:
        return round((sum(long[i].values()) - sum(short[i].values())) / extra, 1)

    def diff(i: int) -> dict:
        d = Counter(long[i])
        d.subtract(short[i])
        return {k: round(v / extra, 2) for k, v in d.most_common() if v}

    return {
        "method": cfg.method,
        "particles": cfg.particles if cfg.method == "smc" else 1,
        "draft_tokens": cfg.draft_tokens if cfg.method != "ar" else 0,
        "request_rounds": sum(short[0].values()),
        "request_kernels": sum(short[1].values()),
        "request_reads": sum(short[3].values()),
        "kernels_per_round": per(1),
        "reads_per_round": per(3),
        "kernels_by_place": diff(2),
        "reads_by_place": diff(4),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="llama")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8, help="R: requests of R and 2R rounds")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    engine = engine_for(args.pair, tiny=True, device="cpu")
    for m in engine.models().values():
        m.rounds = "eager"
    prompt = [(1000 + 31 * j) % (engine.vocab - 1) for j in range(args.prompt)]
    base = dict(ignore_eos=True, temperature=0.7, seed=1)
    ar = GenerationConfig(method="ar", **base)
    sd = GenerationConfig(method="sd", draft_tokens=args.k, **base)
    smc = GenerationConfig(method="smc", particles=args.n, draft_tokens=args.k, **base)
    rows = [
        steady(engine, prompt, ar, 1, args.rounds),
        steady(engine, prompt, sd, args.k + 1, args.rounds),
        steady(engine, prompt, smc, args.k + 1, args.rounds),
    ]
    for r in rows:
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
