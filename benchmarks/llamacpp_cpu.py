"""smcspec on the llamacpp backend against llama.cpp's own autoregressive decoding.

Systems, alternated prompt by prompt in one process (the order rotates every prompt), all on
the same GGUF files and the same thread count:
  llama.cpp-ar   llama-cpp-python's ``Llama.create_chat_completion`` on the target (the anchor)
  ar, sd, smc    smcspec's decoders on the llamacpp backend (``--grid`` expands sd/smc)
  *-qdraft       the same with the draft re-quantized once (``--quantize-draft TYPE``)
  torch-*        smcspec's torch backend in bfloat16 (``--torch N,K``: SMC-SD at that setting)
                 or float32 (``--torch-fp32 N,K``; 4,4 was the default before this backend)

Every system gets the same chat-templated prompt (ShareGPT first turns and GSM8K questions)
and decodes ``--max-new-tokens`` tokens with EOS suppressed, so every run does the same
work. Reported: median tokens/s (new tokens / wall time including prefill), its ratio to
llama.cpp AR, and beside every speculative setting the roofline prediction of its speed-up
over our AR from measured forward costs (``smcspec.tuning.predict``; SMC-SD: K+1 tokens a
round; SD: (1 - a^(K+1)) / (1 - a) tokens a round with Leviathan et al.'s per-token alpha,
found from the runs' accepted/drafted/rounds counts: the acceptance rate accepted/drafted is
smaller than alpha, since a round stops at its first rejection).

Usage:
  python benchmarks/llamacpp_cpu.py --prompts 2 --methods ar,sd,smc \
      --grid "N=2,4,8;K=4,8" --sd-k 2,4 --quantize-draft Q4_0 --torch 2,4 \
      --out docs/benchmarks/llamacpp-cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import torch

from smcspec import Engine, GenerationConfig
from smcspec.eval.gsm8k import load_gsm8k
from smcspec.eval.harness import MethodSpec, method_specs
from smcspec.eval.roofline import forward_seconds
from smcspec.eval.sharegpt import load_sharegpt_prompts
from smcspec.models import load_model
from smcspec.models.default_pair import DEFAULT_DRAFT, DEFAULT_TARGET, ensure_packaged_model
from smcspec.models.loading import cache_root
from smcspec.tuning import ForwardCosts, Setting, alpha_from_counts, predict
from smcspec.tuning.cache import cpu_model


def _anchor(target_gguf: Path, threads: int, stop_ids: set[int]):
    """llama-cpp-python's high-level ``Llama`` on the target; returns generate(text, m, seed)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(target_gguf), n_threads=threads, n_ctx=4096, verbose=False)
    bias = {i: -1e4 for i in stop_ids}  # EOS suppressed, as for our systems

    def generate(text: str, max_tokens: int, seed: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        out = llm.create_chat_completion(
            messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
            temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=seed, logit_bias=bias,
        )  # fmt: skip
        return out["usage"]["completion_tokens"], time.perf_counter() - t0

    return generate


def _sd_prediction(engine: Engine, k: int, stats: list[dict]) -> tuple[float, float]:
    """Roofline speed-up of SD over AR, and alpha: tokens a round over the cost of a round
    (K draft forwards, the first of 2 tokens after a fully accepted round; one target
    forward of K+1 tokens), alpha from the pooled counts of ``stats``."""
    alpha = alpha_from_counts(
        *(sum(s[key] for s in stats) for key in ("accepted", "drafted", "rounds"))
    )
    tm, dm = engine.target.model, engine.draft.model
    costs = ForwardCosts(
        target={(1, 1): forward_seconds(tm, 1, 1), (1, k + 1): forward_seconds(tm, 1, k + 1)},
        draft={(1, 1): forward_seconds(dm, 1, 1), (1, 2): forward_seconds(dm, 1, 2)},
        alpha=alpha,
    )
    sd = predict(Setting("sd", 1, k), costs)
    return sd.tokens_per_second * costs.target[(1, 1)], alpha


def _smc_prediction(engine: Engine, n: int, k: int) -> float:
    t1 = forward_seconds(engine.target.model, 1, 1)
    round_s = (
        (k - 1) * forward_seconds(engine.draft.model, n, 1)
        + forward_seconds(engine.draft.model, n, 2)
        + forward_seconds(engine.target.model, n, k + 1)
    )
    return (k + 1) * t1 / round_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=2, help="ShareGPT prompts, and as many GSM8K")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="ar,sd,smc")
    p.add_argument("--grid", default="N=2,4,8;K=4,8", help="smc settings")
    p.add_argument("--sd-k", default="2,4", help="sd draft lengths")
    p.add_argument("--quantize-draft", default=None, help="e.g. Q4_0: also run with it")
    p.add_argument("--torch", default=None, help="N,K: also SMC-SD on the torch backend, bf16")
    p.add_argument(
        "--torch-fp32",
        default=None,
        help="N,K: also SMC-SD on the torch backend in float32 (4,4: the default before the "
        "llamacpp backend)",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-llamacpp")
    args = p.parse_args(argv)

    base = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=args.seed)
    specs = [s for s in method_specs(args.methods, base, args.grid) if s.config.method != "sd"]
    if "sd" in args.methods.split(","):
        specs += [
            MethodSpec(f"sd-k{k}", replace(base, method="sd", draft_tokens=int(k)))
            for k in args.sd_k.split(",")
        ]
    engine = Engine.load(threads=args.threads)
    threads = engine.target.model.threads
    systems: dict[str, object] = {"llama.cpp-ar": None}
    runners = {s.name: (engine, s.config) for s in specs}
    if args.quantize_draft:
        from smcspec.models.quantize import quantize_gguf

        src = ensure_packaged_model(DEFAULT_DRAFT, cache_root())
        dst = cache_root() / "quantized" / f"{src.stem}-{args.quantize_draft}.gguf"
        t0 = time.perf_counter()
        quantize_gguf(src, dst, args.quantize_draft, threads)
        print(f"quantized draft {dst} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        qengine = Engine(engine.target, load_model(dst, llamacpp=engine.target.model.settings))
        for s in specs:
            if s.name in ("sd-k4", "smc-n4-k4"):
                runners[f"{s.name}-qdraft-{args.quantize_draft}"] = (qengine, s.config)
    for setting, dtype, tag in (
        (args.torch, "bfloat16", "bf16"),
        (args.torch_fp32, "float32", "fp32"),
    ):
        if setting:
            n, k = (int(v) for v in setting.split(","))
            tengine = Engine.load(backend="torch", dtype=dtype)
            cfg = replace(base, method="smc", particles=n, draft_tokens=k)
            runners[f"torch-{tag}-smc-n{n}-k{k}"] = (tengine, cfg)
    systems.update(runners)
    target_gguf = ensure_packaged_model(DEFAULT_TARGET, cache_root())
    anchor = _anchor(target_gguf, threads, set(engine.stop_ids))

    prompts = load_sharegpt_prompts(args.prompts, engine.tokenizer, seed=args.seed)
    prompts += [item.question for item in load_gsm8k(None, args.prompts, args.seed)]
    for eng, cfg in runners.values():  # warm-up: first calls allocate and pick kernels
        eng.generate("Hello", replace(cfg, max_new_tokens=4))
    anchor("Hello", 4, 0)
    names = list(systems)
    records = []
    for i, text in enumerate(prompts):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            if name == "llama.cpp-ar":
                tokens, seconds = anchor(text, args.max_new_tokens, args.seed + i)
                stats = {}
            else:
                eng, cfg = runners[name]
                r = eng.generate(text, replace(cfg, seed=args.seed + i))
                tokens, seconds, stats = r.new_tokens, r.seconds, r.stats
            records.append({"prompt": i, "system": name, "new_tokens": tokens,
                            "seconds": round(seconds, 4),
                            "tokens_per_second": round(tokens / seconds, 3),
                            "stats": {k: v for k, v in stats.items() if k != "seed"}})  # fmt: skip
            print(f"prompt {i} {name}: {tokens / seconds:.2f} tokens/s", file=sys.stderr)

    def median(name: str, key: str = "tokens_per_second") -> float:
        return statistics.median(r[key] for r in records if r["system"] == name)

    anchor_tps, ar_tps = median("llama.cpp-ar"), median("ar") if "ar" in systems else None
    lines = [
        "| system | median tokens/s | min-max | vs llama.cpp AR | vs our ar "
        "| predicted vs our ar |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        tps = [r["tokens_per_second"] for r in records if r["system"] == name]
        pred = ""
        if name in runners and not name.startswith("torch"):
            eng, cfg = runners[name]
            if cfg.method == "smc":
                pred = f"{_smc_prediction(eng, cfg.particles, cfg.draft_tokens):.2f}x"
            elif cfg.method == "sd":
                stats = [r["stats"] for r in records if r["system"] == name]
                speedup, alpha = _sd_prediction(eng, cfg.draft_tokens, stats)
                pred = f"{speedup:.2f}x (alpha={alpha:.2f})"
        vs_ar = f"{statistics.median(tps) / ar_tps:.2f}x" if ar_tps else ""
        lines.append(
            f"| {name} | {statistics.median(tps):.2f} | {min(tps):.2f}-{max(tps):.2f} | "
            f"{statistics.median(tps) / anchor_tps:.2f}x | {vs_ar} | {pred} |"
        )
    cpu = cpu_model()
    costs = {
        "target 1x1": forward_seconds(engine.target.model, 1, 1),
        "draft 1x1": forward_seconds(engine.draft.model, 1, 1),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    summary = "\n".join(
        [
            "# smcspec (llamacpp backend) vs llama.cpp AR on the CPU",
            "",
            f"{date.today().isoformat()}; {cpu} CPU, {threads} threads for every system; "
            f"torch {torch.__version__}; target {target_gguf.name}, draft "
            f"{engine.draft.path.name}. {len(prompts)} prompts ({args.prompts} ShareGPT first "
            f"turns, {args.prompts} GSM8K questions, chat template), {args.max_new_tokens} new "
            "tokens with EOS suppressed, T 0.7, systems alternated prompt by prompt. Forward "
            f"costs: target 1x1 {costs['target 1x1'] * 1e3:.0f} ms, draft 1x1 "
            f"{costs['draft 1x1'] * 1e3:.0f} ms "
            f"(c = {costs['draft 1x1'] / costs['target 1x1']:.2f}).",
            "",
            f"Command: `python benchmarks/llamacpp_cpu.py {' '.join(argv or sys.argv[1:])}`",
            "",
            *lines,
            "",
        ]
    )
    (out / "summary.md").write_text(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
