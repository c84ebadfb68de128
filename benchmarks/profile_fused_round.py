"""Where an SMC-SD round's device time goes: the kernels of one fused round, by kind.

Builds a pair of ``benchmarks/gpu_campaign.py`` (random weights at real shapes), runs one
SMC-SD request with the fused rounds called uncaptured (``rounds="eager"``: the same kernels a
CUDA graph replays, but visible one by one to the profiler) under ``torch.profiler``, and
writes the kernels' device time grouped by name (``key_averages``, sorted by device time),
the number of kernels per round and the device time per round. Then one request with the
rounds captured (``graphs``) for the wall time beside it.

Usage (on a GPU; ``--tiny`` runs the same on a CPU with tiny shapes; ``--kernels SET``: a
kernel set of ``smcspec.backends.torch.kernels``, default the models' ``auto``):
  python benchmarks/profile_fused_round.py --pair llama --n 8 --k 8 --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from gpu_campaign import PAIRS, TINY, synthetic_tokenizer, torch_model  # noqa: E402

from smcspec import Engine, GenerationConfig  # noqa: E402
from smcspec.backends.base import LoadedModel  # noqa: E402


def engine_for(pair: str, tiny: bool, device: str) -> Engine:
    shapes = (TINY if tiny else PAIRS)[pair]
    tok = synthetic_tokenizer(shapes[0].vocab)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    models = [
        LoadedModel(
            model=torch_model(s, device, dtype, seed=i + 1),
            tokenizer=tok,
            path=Path("."),
            config=None,
            name=s.name,
            backend="torch",
            vocab_size=s.vocab,
            context_length=32768,
        )  # fmt: skip
        for i, s in enumerate(shapes)
    ]
    return Engine(*models)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="llama")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--new", type=int, default=64, help="new tokens of the profiled request")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--kernels", default="auto", help="the models' kernel set (KERNEL_MODES)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine = engine_for(args.pair, args.tiny, device)
    prompt = [(1000 + 31 * j) % (engine.vocab - 1) for j in range(args.prompt)]
    cfg = GenerationConfig(
        method="smc", particles=args.n, draft_tokens=args.k, max_new_tokens=args.new,
        ignore_eos=True, temperature=0.7, seed=1,
    )  # fmt: skip
    models = engine.models().values()

    def run(mode: str):
        for m in models:
            m.rounds = mode
            m.use_kernels(args.kernels)
        return engine.generate(prompt, cfg)

    run("eager")  # warm-up: caches, cuBLAS
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        result = run("eager")
    rounds = result.stats["rounds"]
    events = prof.key_averages()
    attr = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
    kernels = [e for e in events if getattr(e, attr, 0) > 0 and e.device_type.name == "CUDA"]
    total_us = sum(getattr(e, attr) for e in kernels)
    table = prof.key_averages().table(sort_by=attr if device == "cuda" else "cpu_time_total",
                                      row_limit=40, max_name_column_width=60)  # fmt: skip
    run("graphs")  # captures
    t0 = time.perf_counter()
    graphed = run("graphs")
    wall = time.perf_counter() - t0
    summary = {
        "pair": args.pair,
        "kernel_set": next(iter(models)).kernels.name,
        "n": args.n,
        "k": args.k,
        "new_tokens": result.new_tokens,
        "rounds": rounds,
        "kernels": sum(e.count for e in kernels),
        "kernels_per_round": sum(e.count for e in kernels) / max(rounds, 1),
        "device_ms_per_round": total_us / 1000 / max(rounds, 1),
        "graphs_wall_s": wall,
        "graphs_tokens_per_s": graphed.new_tokens / wall,
    }
    (out / "profile.json").write_text(json.dumps(summary, indent=1))
    (out / "kernels.txt").write_text(table)
    print(json.dumps(summary))
    print(table[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
