"""Kernels a decoder layer launches on each kernel set, and the H200 round time they predict.

Runs an SMC-SD request (N particles, K drafts a round) and an ``ar`` request with their rounds
fused and uncaptured (``rounds="eager"``: the kernels a CUDA graph replays, one by one) under
``torch.profiler``, once per kernel set of :mod:`smcspec.backends.torch.kernels` (``eager``,
``compiled``, ``flex``, ``layer``), and counts from the profiler's events, exactly, the kernels
of one layer of a draft step over N rows and of the target's forward over N(K+1) rows, of
each forward outside its layers, and of a whole round, GEMMs (the weights' matrix products)
apart from the small kernels.

Counting: ``benchmarks/kernel_count.py`` (each aten operation one CUDA kernel, as eager CUDA
PyTorch launches them, each generated C++ kernel of a compiled region one, each extern call
one; GEMMs, the weights' ``mm``, apart from the small kernels; the attention's ``bmm`` are
small kernels, as in the calibration). Applied to the code the sixth lending profiled, it
counts that request's GEMMs exactly and its small kernels within 1.2% of the H200's
(``benchmarks/request_kernels.py``, ``docs/benchmarks/layer-kernels/``). Where a GPU's count
may differ: cuBLAS adds a split-K reduction kernel to some GEMMs (the calibration counts
them with the GEMMs, so they are no small kernel here either); Inductor fuses for Triton as
it does for C++ in most cases, but may split a large reduction in two or fuse differently;
a flex attention may be a decoding kernel and a reduction on CUDA (``flex_decoding``) where
it is one C++ kernel here; CUB-based operations (cumsum, sort) are several kernels on CUDA.

Shapes: ``--shapes real`` (default) builds the layers of Llama-3.2-1B (draft) and
Llama-3.1-8B (target) with random weights in bfloat16 (the GPU's dtype: casts count), two
layers each and a 512-token vocabulary (the vocabulary changes no count: one embedding
gather, one output GEMM); ``--shapes tiny`` the campaign's tiny Llama pair. Per-layer counts
do not depend on the layer or the size (every layer runs the same code; the compiled sets
compile a layer once for all layers and every suffix window), so a round's counts at 16/32
layers are the measured round's plus the missing layers' (:func:`at_depth`).

Prediction (:func:`predict`, the calibration in ``benchmarks/data/h200_calibration.json``):
round device time = the round's GEMM time + its small kernels x their mean time. The GEMM time
of a forward is its weight bytes over the effective bandwidth the calibration's GEMMs reached
(the GEMMs of these forwards, 1 to 72 rows, are bound by reading their weights; the same on
every kernel set); the small kernels' mean is the calibration's. It is a prediction: every
later GPU measurement is to be put beside it (``benchmarks/gpu_campaign.py`` does).

Usage:
  python benchmarks/layer_kernels.py [--shapes real|tiny] [--n 8] [--k 8]
      [--sets eager,compiled,flex,layer] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from gpu_campaign import PAIRS, TINY, torch_model  # noqa: E402
from kernel_count import (  # noqa: E402
    calibration,
    inside,
    inside_or_self,
    instrumented,
    predict,
    total,
)

from smcspec import GenerationConfig  # noqa: E402
from smcspec.backends.torch.transformer import Transformer  # noqa: E402
from smcspec.decoding import decode_ar, decode_smc  # noqa: E402


@dataclass
class Counts:
    """Kernels of one forward: per layer and outside its layers, ``(gemms, small)``."""

    layers: int
    layer: tuple[int, int]
    outside: tuple[int, int]

    def as_dict(self) -> dict:
        return {"layers": self.layers, "layer": self.layer, "outside": self.outside}


def forward_counts(forward) -> Counts:
    """Per-layer and outside counts of one ``FORWARD`` range; every layer must count the
    same (raises AssertionError otherwise: the counts would not extrapolate)."""
    layers = inside(forward, "LAYER")
    per = {total(layer.cpu_children) for layer in layers}
    assert len(per) == 1, f"layers of one forward differ: {per}"
    (layer,) = per
    gemm, small = total(forward.cpu_children)
    n = len(layers)
    return Counts(n, layer, (gemm - n * layer[0], small - n * layer[1]))


def pair(shapes: str) -> tuple[Transformer, Transformer]:
    """Target and draft (random weights, bfloat16, CPU): two layers of the real pair's shapes
    and a 512-token vocabulary, or the tiny pair."""
    if shapes == "tiny":
        used = TINY["llama"]
    else:
        used = tuple(replace(s, layers=2, vocab=512, tied=False) for s in PAIRS["llama"])
    target, draft = (torch_model(s, "cpu", torch.bfloat16, seed=i + 1) for i, s in enumerate(used))
    target.bench_label, draft.bench_label = "target", "draft"
    return target, draft


def requests(n: int, k: int, prompt: int) -> tuple[list[int], GenerationConfig, GenerationConfig]:
    """The prompt (``prompt`` token ids) and the two requests :func:`count_set` profiles:
    SMC-SD with ``n`` particles and ``k`` drafts, two rounds, and ``ar``, four tokens."""
    ids = [(1000 + 31 * j) % 511 for j in range(prompt)]
    smc = GenerationConfig(method="smc", particles=n, draft_tokens=k, temperature=0.7,
                           max_new_tokens=1 + 2 * (k + 1), ignore_eos=True)  # fmt: skip
    ar = GenerationConfig(method="ar", temperature=0.7, max_new_tokens=4, ignore_eos=True)
    return ids, smc, ar


def count_set(target, draft, name: str, n: int, k: int, prompt: int) -> dict:
    """One kernel set's counts: an SMC-SD request of two rounds and an ``ar`` request of
    three tokens, warmed up (compiled) first where the set compiles, then profiled; the
    counts of the last round of each (the first's draft step may feed two tokens)."""
    if not inductor_config.cpp.enable_kernel_profile:  # each C++ kernel a profiler event
        inductor_config.cpp.enable_kernel_profile = True
        torch._dynamo.reset()  # what was compiled before would name no kernel
    for m in (target, draft):
        m.use_kernels(name)
        m.rounds = "eager"
    ids, smc, ar = requests(n, k, prompt)

    def run() -> None:
        g = torch.Generator().manual_seed(1)
        decode_smc(target, draft, ids, smc, frozenset(), 512, g)
        decode_ar(target, ids, ar, frozenset(), 512, torch.Generator().manual_seed(1))

    t0 = time.perf_counter()
    with torch.inference_mode():
        if name != "eager":
            run()  # warm-up: compiles
        warm = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    roots = [e for e in prof.events() if e.cpu_parent is None]
    rounds = {kind: [e for r in roots for e in inside_or_self(r, f"ROUND:{kind}")]
              for kind in ("smc", "ar")}  # fmt: skip
    smc_round, ar_round = rounds["smc"][-1], rounds["ar"][-1]
    drafts = inside(smc_round, "FORWARD:draft")
    steps = [forward_counts(f) for f in drafts]
    (verify,) = [forward_counts(f) for f in inside(smc_round, "FORWARD:target")]
    (ar_forward,) = [forward_counts(f) for f in inside(ar_round, "FORWARD:target")]
    return {
        "set": name,
        "warm_up_s": round(warm, 1),
        "draft_step": steps[-1].as_dict(),  # one token a row (the first step may feed two)
        "draft_steps": [s.as_dict() for s in steps],
        "target_forward": verify.as_dict(),
        "smc_round": total([smc_round]),
        "ar_forward": ar_forward.as_dict(),
        "ar_round": total([ar_round]),
    }


def at_depth(row: dict, draft_layers: int, target_layers: int) -> dict:
    """A row's round counts with the draft and the target at ``draft_layers`` and
    ``target_layers`` layers: the measured round's plus the missing layers' (every layer
    counts the same). ``(gemms, small)`` per round and per forward."""

    def deeper(total, forwards: list[dict], layers: int) -> tuple[int, int]:
        g, s = total
        for f in forwards:
            extra = layers - f["layers"]
            g, s = g + extra * f["layer"][0], s + extra * f["layer"][1]
        return g, s

    def forward(f: dict, layers: int) -> tuple[int, int]:
        return deeper((f["layers"] * f["layer"][0] + f["outside"][0],
                       f["layers"] * f["layer"][1] + f["outside"][1]), [f], layers)  # fmt: skip

    smc = deeper(row["smc_round"], row["draft_steps"], draft_layers)
    smc = deeper(smc, [row["target_forward"]], target_layers)
    return {
        "smc_round": smc,
        "ar_round": deeper(row["ar_round"], [row["ar_forward"]], target_layers),
        "draft_step": forward(row["draft_step"], draft_layers),
        "target_forward": forward(row["target_forward"], target_layers),
        "ar_forward": forward(row["ar_forward"], target_layers),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", choices=("real", "tiny"), default="real")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--sets", default="eager,compiled,flex,layer")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    target, draft = pair(args.shapes)
    real = PAIRS["llama"]
    cal = calibration()
    rows = []
    for name in args.sets.split(","):
        with instrumented():
            row = count_set(target, draft, name, args.n, args.k, args.prompt)
        row |= {"shapes": args.shapes, "n": args.n, "k": args.k}
        row["at_depth"] = at_depth(row, real[1].layers, real[0].layers)
        row["predicted_h200"] = predict(row["at_depth"], cal, args.k)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
