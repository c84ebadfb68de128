"""The GPU campaign's kernel sets: a device profile of one request per set, and the report's
section that puts item 1's predictions (``docs/benchmarks/layer-kernels/``) beside what was
measured.

:func:`device_profile` runs the request the calibration profiled (SMC-SD N=8 K=8, a 128-token
prompt, 64 new tokens; ``benchmarks/request_kernels.py``; the rehearsal's is shorter) with
each kernel set, its rounds
uncaptured (``rounds="eager"``: the kernels a CUDA graph replays, one by one) under
``torch.profiler``, and writes a ``device-profile`` row: kernels and device milliseconds a
round (the request's over its rounds, the calibration's definition). On a CPU (the rehearsal)
it counts the kernels with ``benchmarks/kernel_count.py`` and has no device time.
:func:`prediction_lines` reads the committed predictions: per kernel set, tokens/s of ``ar``
and SMC-SD N=8 K=8 (``real.jsonl``, device time only: no prefill, no host work between
rounds) and kernels and device time a round of the profiled request (``request.jsonl``).
"""

from __future__ import annotations

import json
from pathlib import Path

from kernel_count import total
from torch.profiler import ProfilerActivity, profile

from smcspec import GenerationConfig

PREDICTIONS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "layer-kernels"
OFF = 0.2  # a measurement this far from its prediction is flagged (the issue asks why)


def device_profile(
    c, engine, base: dict, sets: list[str], n: int, k: int, prompt: int = 128, new: int = 64
) -> None:
    """A ``device-profile`` row per kernel set of ``sets`` (module notes): SMC-SD N, K, a
    ``prompt``-token prompt, ``new`` new tokens; ``c`` is the campaign (deadline, rows),
    ``engine`` the pair's."""
    ids = [(1000 + 31 * j) % (engine.vocab - 1) for j in range(prompt)]
    cfg = GenerationConfig(method="smc", particles=n, draft_tokens=k, max_new_tokens=new,
                           ignore_eos=True, temperature=0.7, seed=1)  # fmt: skip
    cuda = engine.target.model.device.type == "cuda"
    try:
        for name in sets:
            if c.left() < c.args.min_step_s:
                c.skip(f"torch/{base['pair']} device profile [{name}]: out of time")
                return
            _profile_one(c, engine, base, name, ids, cfg, cuda)
    finally:  # what runs next (a roofline, the FP8 group) runs the default kernels
        for m in engine.models().values():
            m.use_kernels("auto")


def _profile_one(c, engine, base: dict, name: str, ids: list[int], cfg, cuda: bool) -> None:
    """One set's ``device-profile`` row (:func:`device_profile`)."""
    for m in engine.models().values():
        m.rounds = "eager"
        m.use_kernels(name)
    if cuda or name != "eager":
        engine.generate(ids, cfg)  # warm-up: compiles, allocates, cuBLAS
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        result = engine.generate(ids, cfg)
    rounds = max(result.stats["rounds"], 1)
    if cuda:
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        events = [e for e in events if getattr(e, "device_time_total", 0) > 0]
        kernels = sum(e.count for e in events)
        device_ms = sum(e.device_time_total for e in events) / 1000
    else:
        kernels = sum(total(e for e in prof.events() if e.cpu_parent is None))
        device_ms = None
    c.row(kind="device-profile", set=name, kernels_run=engine.target.model.kernels.name,
          n=cfg.particles, k=cfg.draft_tokens, prompt=len(ids), new=cfg.max_new_tokens,
          rounds=rounds, kernels_per_round=round(kernels / rounds, 1),
          device_ms_per_round=None if device_ms is None else round(device_ms / rounds, 3),
          **base)  # fmt: skip


def load_predictions(folder: Path = PREDICTIONS) -> dict:
    """``{"tokens": {set: row of real.jsonl}, "request": {set: row of request.jsonl}}``
    (empty where a file is missing)."""
    out = {}
    for key, name in (("tokens", "real.jsonl"), ("request", "request.jsonl")):
        path = folder / name
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        out[key] = {r["set"]: r for r in rows}
    return out


def _ratio(measured: float | None, predicted: float | None) -> str:
    if not measured or not predicted:
        return "-"
    r = measured / predicted
    return f"{r:.2f}" + (" (off by more than 20%)" if abs(r - 1) > OFF else "")


def prediction_lines(rows: list[dict], tiny: bool, predictions: dict | None = None) -> list[str]:
    """The report's section on the kernel sets: each torch batch-1 ``ar`` and SMC-SD row of
    the ``llama`` pair (8B/1B, its own weights' dtype, rounds as graphs) at the predictions'
    N, K beside its predicted tokens/s, each ``device-profile`` row beside its predicted
    kernels and device time a round."""
    p = load_predictions() if predictions is None else predictions
    runs = [
        r
        for r in rows
        if r["kind"] == "run"
        and r["backend"] == "torch"
        and r["batch"] == 1
        and r["pair"] == "llama"
        and r.get("rounds", "auto") == "auto"
    ]  # the predictions' pair and path: 8B/1B in bf16, rounds as graphs
    profiles = [r for r in rows if r["kind"] == "device-profile"]
    if not p["tokens"] or not (runs or profiles):
        return []
    any_row = next(iter(p["tokens"].values()))
    n, k = any_row["n"], any_row["k"]
    lines = [
        "## Kernel sets: item 1's prediction beside the measurement",
        "",
        "PREDICTIONS from `docs/benchmarks/layer-kernels/` (kernels counted on a CPU, the "
        "sixth lending's profile as calibration: `benchmarks/kernel_count.py`), for Llama-3.1-8B"
        " / 3.2-1B on an H200; predicted tokens/s count the device's time only (no prefill, no "
        "host work), so a measurement under them is expected; off by more than 20% is flagged."
        + (" Tiny shapes here: the rows do not test the predictions." if tiny else ""),
        "",
        "| system | kernels | measured tokens/s | PREDICTED tokens/s | measured / predicted |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in runs:
        pred = p["tokens"].get(r.get("kernels") or "")
        if r["method"] == "ar":
            want = pred and pred["predicted_h200"]["ar_tokens_per_s"]
        elif r["method"] == "smc" and (r["n"], r["k"]) == (n, k):
            want = pred and pred["predicted_h200"]["smc_tokens_per_s"]
        else:
            continue
        lines.append(
            f"| {r['system']} ({r['pair']}) | {r.get('kernels') or '-'} | {r['tokens_per_s']:.1f}"
            f" | {want or '-'} | {_ratio(r['tokens_per_s'], want)} |"
        )
    lines += [
        "",
        "Device profile of one request (SMC-SD, prompt and new tokens as listed; predicted for "
        f"N={n} K={k}, a 128-token prompt and 64 new tokens), rounds uncaptured; a round's share"
        " of the request, the prefill and host work included, as the calibration counts:",
        "",
        "| kernels | request | kernels a round | PREDICTED | device ms a round | PREDICTED | "
        "measured / predicted |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in profiles:
        pred = p["request"].get(r["kernels_run"], {})
        ms, want_ms = (
            r["device_ms_per_round"],
            pred.get("predicted_h200", {}).get("device_ms_per_round"),
        )
        lines.append(
            f"| {r['kernels_run']} ({r['pair']}) | N={r['n']} K={r['k']}, {r['prompt']}+"
            f"{r['new']} | {r['kernels_per_round']} | "
            f"{pred.get('kernels_per_round', '-')} | {ms if ms is not None else '-'} | "
            f"{want_ms or '-'} | {_ratio(ms, want_ms)} |"
        )
    return [*lines, ""]
