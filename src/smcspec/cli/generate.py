"""``smcspec generate PROMPT``: one completion, streamed, with its statistics."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from smcspec.cli.engine_args import load_engine, needs_model_draft, tuned_config, tuned_note
from smcspec.cli.options import (
    config_from_args,
    constraint_from_args,
    method_args,
    steering_from_args,
)
from smcspec.decoding.registry import Choice, decoder_for

if TYPE_CHECKING:
    from smcspec.engine import GenerationResult


def run(args: argparse.Namespace) -> int:
    """Decode ``args.prompt`` once (streamed, or one JSON object with ``--json``); returns 0.

    Raises:
        SmcspecError: bad options, prompt or constraint, model files, numerical failure.
    """
    method = method_args(args)
    cfg = config_from_args(
        args,
        method,
        return_particles=args.particles_out,
        constraint=constraint_from_args(args),
        **steering_from_args(args),
    )
    engine = load_engine(args, with_draft=needs_model_draft([cfg]))
    engine.encode(args.prompt, chat=not args.no_chat)  # a bad prompt fails before tuning
    cfg, pick = tuned_config(engine, args, cfg, method)

    def stream(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = engine.generate(
        args.prompt,
        cfg,
        chat=not args.no_chat,
        on_text=None if args.json else stream,
        fit_context=not getattr(args, "max_new_tokens_given", True),  # a default cap gives way
    )
    if args.json:
        print(json.dumps(_json_record(result, pick, args, method.choice), ensure_ascii=False))
    else:
        print(f"\n{_stats_line(result, pick, args, method.choice, decoder_for(cfg).particles)}")
    return 0


def _json_record(result: GenerationResult, pick, args: argparse.Namespace, method: Choice) -> dict:
    """``--json``'s object: the result, whether the budget cut it, and the tuner's pick for
    ``method`` (a :class:`~smcspec.tuning.predict.Prediction`, or None when the options named
    the setting)."""
    out = result.to_dict() | {"hit_cap": result.finish_reason == "length"}
    if pick is not None:
        out["tuned"] = {
            "setting": pick.setting.name,
            "chosen_by": method.name,
            "min_particles": args.min_particles,
            "predicted_tokens_per_second": round(pick.tokens_per_second, 3),
            "min_ess_floor": args.min_ess,
            "predicted_ess": None if pick.ess is None else round(pick.ess, 3),
        }
    return out


def _stats_line(
    result: GenerationResult, pick, args: argparse.Namespace, method: Choice, particles: bool
) -> str:
    """The line printed after a streamed completion: tokens, seconds, tokens/s, the decoder's
    statistics (SMC-SD's resampling and ESS, SD's acceptance rate), the tuner's pick for
    ``method``, the cap (``particles``: the decoder weighed particles, so a vote asked for
    had them)."""
    label = result.method
    if result.ran_as is not None:
        label += f", greedy: run as {result.ran_as}"
    line = (
        f"[{label}] {result.new_tokens} tokens in {result.seconds:.2f} s "
        f"({result.tokens_per_second:.2f} tokens/s), prompt {result.prompt_tokens} tokens"
    )
    line += result.decode_stats.describe()
    if result.vote is not None:
        v = result.vote
        line += (
            f"; vote: {v['answer']!r} with {v['share']:.0%} of the weight ({v['answers']} answers)"
        )
    elif particles and args.aggregate == "vote":
        line += "; vote: no particle has an answer"
    if pick is not None:
        line += f"; {tuned_note(pick, method, args.min_ess)}"
    if result.finish_reason == "length":
        line += f"; cut by the cap of {result.new_tokens} new tokens, not by the model (-m)"
    return line
