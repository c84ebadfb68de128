"""Probe the llamacpp backend on a GPU at the campaign's real shapes: which systems run, which
abort, and where one SMC-SD round's time goes.

One process loads the pair (GGUF files written once into ``--workdir`` and reused), then runs
the systems named on the command line one after another, printing one line per run
(``ok``/``fail``, tokens, seconds, tokens/s) and flushing, so a process that dies in a CUDA
kernel still shows what ran before it. ``--profile`` runs each system once more under
cProfile and prints the functions with the largest own and cumulative time: the host-side
cost of a round (logits copied out of llama.cpp, sampling, weighting, resampling) beside the
forwards. ``--write-only`` writes the GGUF files and exits (while something else runs).

  python benchmarks/gpu_probe.py --workdir W --systems smc-n4-k4
  python benchmarks/gpu_probe.py --workdir W --systems ar,smc-n8-k8 --profile --max-new-tokens 64
  python benchmarks/gpu_probe.py --workdir W --systems ar,smc-n8-k8 --logits-devices cpu,cuda \
      --reps 3

``--logits-devices cpu,cuda`` loads the pair once per device named (where the decoders sample:
``LlamaCppSettings.logits_device``) and alternates them run by run, so that each system's
figures on both are taken side by side; each line names the device (``@cpu``, ``@cuda``).

Systems are named as in the campaign's report: ``ar``, ``smc-nN-kK``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import gpu_campaign as campaign

from smcspec import Engine


def parse_system(label: str) -> campaign.System:
    """``ar`` or ``smc-nN-kK`` as a :class:`gpu_campaign.System`; ValueError otherwise."""
    if label == "ar":
        return campaign.System("ar")
    parts = label.split("-")
    if len(parts) == 3 and parts[0] == "smc" and parts[1][0] == "n" and parts[2][0] == "k":
        return campaign.System("smc", int(parts[1][1:]), int(parts[2][1:]))
    raise ValueError(f"unknown system {label!r}: ar or smc-nN-kK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check)")
    ap.add_argument("--pair", default="llama")
    ap.add_argument("--systems", default="ar")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--logits-devices", default="", help="e.g. cpu,cuda (default: --device)")
    ap.add_argument("--reps", type=int, default=1, help="runs of each system on each device")
    ap.add_argument("--write-only", action="store_true")
    a = ap.parse_args(argv)
    shapes = (campaign.TINY if a.tiny else campaign.PAIRS)[a.pair]
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    gpu = a.device == "cuda"
    if a.write_only:
        for i, s in enumerate(shapes):
            t0 = time.perf_counter()
            campaign.write_gguf(s, workdir / f"{s.name}.gguf", half=gpu, seed=i + 1)
            print(f"wrote {s.name} in {time.perf_counter() - t0:.1f} s", flush=True)
        return 0
    systems = [parse_system(x) for x in a.systems.split(",")]
    devices = [d for d in a.logits_devices.split(",") if d] or [a.device]
    base = ["--device", a.device, "--out", str(workdir), "--workdir", str(workdir)]
    base += ["--max-new-tokens", str(a.max_new_tokens), "--prompt-tokens", str(a.prompt_tokens)]
    pairs = {}
    for dev in devices:
        args = campaign.parse_args([*base, "--logits-device", dev])
        t0 = time.perf_counter()
        target, draft, _ = campaign.load_pair("llamacpp", shapes, args, workdir, False, reuse=True)
        print(f"loaded in {time.perf_counter() - t0:.1f} s (logits on {dev})", flush=True)
        pairs[dev] = ({"pair": Engine(target, draft)}, args)
    failed = 0
    for s in systems:
        for rep in range(a.reps):
            for dev, (engines, args) in pairs.items():
                label = f"{s.label}@{dev}" if len(pairs) > 1 else s.label
                print(f"run {label}", flush=True)
                try:
                    r = campaign.run_system(engines, s, args, 1 + rep)
                except Exception as exc:  # a Python-level failure: say so and go on
                    failed += 1
                    print(f"fail {label}: {exc!r}", flush=True)
                    continue
                print(
                    f"ok {label}: {r['tokens']} tokens in {r['seconds']:.3f} s, "
                    f"{r['tokens'] / r['seconds']:.1f} tokens/s {r.get('stats', {})}",
                    flush=True,
                )
        if a.profile:
            for dev, (engines, args) in pairs.items():
                label = f"{s.label}@{dev}" if len(pairs) > 1 else s.label
                prof = cProfile.Profile()
                prof.enable()
                r = campaign.run_system(engines, s, args, 1 + a.reps)
                prof.disable()
                print(f"profile {label}: {r['tokens']} tokens in {r['seconds']:.3f} s", flush=True)
                for key in ("tottime", "cumulative"):
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats(key).print_stats(25)
                    print(out.getvalue(), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
