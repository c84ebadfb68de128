"""Command line: ``smcspec generate "PROMPT" [options]``.

Errors a user can cause print one line ``error: ...`` and exit with a non-zero code
(2: bad option or prompt, 3: model file problem, 4: numerical failure), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from smcspec.config import METHODS, GenerationConfig
from smcspec.errors import SmcspecError
from smcspec.sampling.resampling import RESAMPLERS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smcspec", description="LLM inference with SMC speculative decoding."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("prompt", help="the prompt (a user message unless --no-chat)")
    g.add_argument("--method", choices=METHODS, default="smc", help="decoder (default: smc)")
    g.add_argument("--particles", "-N", type=int, default=4, help="SMC particles N (default 4)")
    g.add_argument("--draft-tokens", "-K", type=int, default=4, help="draft tokens K per round")
    g.add_argument("--max-new-tokens", "-m", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.7, help="target temperature T_t")
    g.add_argument("--draft-temperature", type=float, default=0.7, help="draft temperature T_d")
    g.add_argument("--alpha", type=float, default=1.0, help="power exponent of the SMC target")
    g.add_argument(
        "--ess-threshold",
        type=float,
        default=0.5,
        help="kappa: resample when ESS < kappa*N (0 disables)",
    )
    g.add_argument("--resampler", choices=list(RESAMPLERS), default="systematic")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--target", default=None, help="target model: GGUF file or HF directory")
    g.add_argument("--draft", default=None, help="draft model: GGUF file or HF directory")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--no-chat", action="store_true", help="raw completion, no chat template")
    g.add_argument(
        "--particles-out",
        action="store_true",
        help="also report every particle and its weight (smc, with --json)",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object at the end")
    return parser


def _generate(args: argparse.Namespace) -> int:
    from smcspec.engine import Engine

    cfg = GenerationConfig(
        method=args.method,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        draft_temperature=args.draft_temperature,
        particles=args.particles,
        draft_tokens=args.draft_tokens,
        alpha=args.alpha,
        ess_threshold=args.ess_threshold,
        resampler=args.resampler,
        seed=args.seed,
        return_particles=args.particles_out,
    ).validate()  # fail on bad options before spending time loading models
    engine = Engine.load(
        args.target,
        args.draft,
        device=args.device,
        dtype=args.dtype,
        with_draft=args.method != "ar",
    )

    def stream(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = engine.generate(
        args.prompt, cfg, chat=not args.no_chat, on_text=None if args.json else stream
    )
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
        return 0
    s = result.stats
    line = (
        f"[{result.method}] {result.new_tokens} tokens in {result.seconds:.2f} s "
        f"({result.tokens_per_second:.2f} tokens/s), prompt {result.prompt_tokens} tokens"
    )
    if result.method == "smc":
        line += (
            f", N={s['particles']} K={s['draft_tokens']}, rounds {s['rounds']}, "
            f"resamples {s['resamples']}, mean ESS {s['mean_ess']:.2f}, min ESS {s['min_ess']:.2f}"
        )
    elif result.method == "sd":
        line += (
            f", K={s['draft_tokens']}, rounds {s['rounds']}, acceptance rate "
            f"{s['acceptance_rate']:.3f}, mean accepted length {s['mean_accepted_length']:.2f}"
        )
    print(f"\n{line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``smcspec`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
    except SmcspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
