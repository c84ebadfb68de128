"""The kernels of the H200-profiled request, counted on a CPU: the count's calibration check,
and the prediction a GPU's profile of the same request is compared with.

The sixth lending's profile (``docs/benchmarks/gpu-h200-graphs/profile/``) counted 53,235 device
kernels (7,605 a round) in one request: Llama-3.1-8B / 3.2-1B with random weights, bfloat16,
SMC-SD N=8 K=8, a 128-token prompt, 64 new tokens in 7 rounds, the fused rounds run
uncaptured (``benchmarks/profile_fused_round.py``). This script runs the same request on a CPU
under ``torch.profiler`` and counts its kernels with the rule of ``benchmarks/kernel_count.py``
(GEMMs apart), for each kernel set of ``--sets``. A request's count is linear in each model's
depth (every layer runs the same operations), so it runs at (draft, target) depths (1, 1),
(2, 1) and (1, 2), with the real layer shapes and a 512-token vocabulary (which changes no
count), and extrapolates to (16, 32). Run on the code that lending ran, the count checks the
rule against the measurement; on today's code it predicts, per kernel set, the kernels a
round and (``kernel_count.calibration``) the device milliseconds a round a GPU's profile of
the request will show: its GEMMs at the calibration's bandwidth (the prefill's included),
its small kernels at their mean (``benchmarks/gpu_campaign.py`` profiles the request per
set and puts it beside this).

Usage:
  python benchmarks/request_kernels.py [--sets eager,compiled,flex,layer] [--json FILE]
  # the lending's code: git archive f10725e^ src benchmarks | tar -x -C /tmp/old
  PYTHONPATH=/tmp/old/src python benchmarks/request_kernels.py --campaign /tmp/old/benchmarks

``--campaign DIR``: the ``benchmarks/`` folder whose ``gpu_campaign.py`` builds the models
(the code under test's own); code without kernel sets counts its one set (``eager``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from kernel_count import calibration, total  # noqa: E402

DEPTHS = ((1, 1), (2, 1), (1, 2))


def engine_at(campaign, depth: tuple[int, int]):
    """The pair of ``campaign.PAIRS["llama"]`` at ``depth`` (draft layers, target layers),
    random weights, bfloat16, a 512-token vocabulary, rounds fused and uncaptured."""
    from smcspec import Engine
    from smcspec.backends.base import LoadedModel

    target, draft = campaign.PAIRS["llama"]
    shapes = (
        replace(target, layers=depth[1], vocab=512),
        replace(draft, layers=depth[0], vocab=512),
    )
    tok = campaign.synthetic_tokenizer(512)
    models = [
        LoadedModel(
            model=campaign.torch_model(s, "cpu", torch.bfloat16, seed=i + 1),
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
    engine = Engine(*models)
    for m in engine.models().values():
        m.rounds = "eager"
    return engine


def count(engine, kernels: str, n: int, k: int, new: int, prompt: int) -> dict:
    """``(gemm, small)`` kernels of one request on ``kernels``, after a warm-up (compiles)."""
    from smcspec import GenerationConfig

    for m in engine.models().values():
        if hasattr(m, "kernel_mode"):  # older code has one set: the written functions
            m.use_kernels(kernels)
    ids = [(1000 + 31 * j) % 511 for j in range(prompt)]
    cfg = GenerationConfig(method="smc", particles=n, draft_tokens=k, max_new_tokens=new,
                           ignore_eos=True, temperature=0.7, seed=1)  # fmt: skip
    engine.generate(ids, cfg)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = engine.generate(ids, cfg)
    gemm, small = total(e for e in prof.events() if e.cpu_parent is None)
    return {"rounds": result.stats["rounds"], "gemm": gemm, "small": small}


def extrapolate(rows: dict, draft: int, target: int) -> dict:
    """The count at ``draft`` and ``target`` layers from the counts at :data:`DEPTHS`
    (``base + draft * per_draft_layer + target * per_target_layer``)."""
    out = {}
    for kind in ("gemm", "small"):
        per_d = rows[(2, 1)][kind] - rows[(1, 1)][kind]
        per_t = rows[(1, 2)][kind] - rows[(1, 1)][kind]
        base = rows[(1, 1)][kind] - per_d - per_t
        out[kind] = base + draft * per_d + target * per_t
        out[f"{kind}_per_draft_layer"], out[f"{kind}_per_target_layer"] = per_d, per_t
    return out


def predict_request(full: dict, rounds: int, cal: dict, k: int) -> dict:
    """Device milliseconds a round of the request: its GEMMs (``rounds`` rounds of K draft
    forwards and one target forward, and the prefill of both models) at the calibration's
    bandwidth, its small kernels at their mean, over ``rounds``."""
    w = cal["weight_bytes"]
    read = rounds * (k * w["draft"] + w["target"]) + w["draft"] + w["target"]
    gemm_ms = 1000 * read / cal["gemm_bytes_per_s"]
    small_ms = full["small"] * cal["small_mean_us"] / 1000
    return {"device_ms_per_round": round((gemm_ms + small_ms) / rounds, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--campaign", default=str(HERE), help="benchmarks/ folder of the code")
    ap.add_argument("--sets", default="eager", help="kernel sets (today's code)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--json", help="write the rows here (one per set)")
    args = ap.parse_args(argv)
    sys.path.insert(0, args.campaign)
    import gpu_campaign

    inductor_config.cpp.enable_kernel_profile = True  # each C++ kernel a profiler event
    engines = {d: engine_at(gpu_campaign, d) for d in DEPTHS}
    draft, target = (s.layers for s in gpu_campaign.PAIRS["llama"][::-1])
    cal, out = calibration(), []
    for name in args.sets.split(","):
        request = (args.n, args.k, args.new, args.prompt)
        rows = {d: count(e, name, *request) for d, e in engines.items()}
        assert len({r["rounds"] for r in rows.values()}) == 1, rows
        rounds = rows[DEPTHS[0]]["rounds"]
        full = extrapolate(rows, draft, target)
        kernels = full["gemm"] + full["small"]
        out.append({
            "set": name,
            "campaign": args.campaign,
            "n": args.n, "k": args.k, "prompt": args.prompt, "new": args.new,
            "rows": [{"depth": d, **r} for d, r in rows.items()],
            "at_depth": {"draft_layers": draft, "target_layers": target, **full},
            "rounds": rounds,
            "kernels": kernels,
            "kernels_per_round": round(kernels / rounds, 1),
            "predicted_h200": predict_request(full, rounds, cal, args.k),
        })  # fmt: skip
        print(json.dumps(out[-1]), flush=True)
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in out))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
