"""``smcspec bench``: tokens/s and time to first token on ShareGPT prompts, or (``--predict``)
the predicted table from measured forward costs."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from smcspec.cli.engine_args import load_engine, needs_model_draft, provenance, tune_for
from smcspec.cli.options import config_from_args, method_args
from smcspec.config import GenerationConfig
from smcspec.decoding.labels import chosen_label
from smcspec.decoding.registry import Choice, choice_or_none


def run(args: argparse.Namespace) -> int:
    """Run the throughput bench and write its reports, or print the predicted table
    (``--predict``); returns 0.

    Raises:
        SmcspecError: bad options (before the models load) or model files.
    """
    from smcspec.eval import throughput
    from smcspec.eval.sharegpt import load_sharegpt_prompts

    if args.export_pair_stats and not args.predict:
        from smcspec.errors import ConfigError

        raise ConfigError("--export-pair-stats goes with --predict")
    method = method_args(args)
    base = config_from_args(args, method, ignore_eos=not args.stop_at_eos)
    listed = _bench_choices(args)
    specs = _bench_specs(args, base, listed)  # option errors before the models load
    needs_draft = args.predict or needs_model_draft([s.config for s in specs])
    chosen_later = any(c is not None and c.loads_draft for _, c in listed)  # auto
    engine = load_engine(args, with_draft=needs_draft or chosen_later)
    if args.predict:
        from smcspec.tuning import format_table

        tuning = tune_for(engine, args, base, method)
        print(format_table(tuning), end="")
        if args.export_pair_stats:
            _export_pair_stats(args.export_pair_stats, engine, tuning)
        return 0
    prompts = load_sharegpt_prompts(
        args.prompts,
        engine.tokenizer,
        seed=args.prompt_seed,
        min_tokens=args.min_prompt_tokens,
        max_tokens=args.max_prompt_tokens,
        path=args.sharegpt,
    )
    tuning = tune_for(engine, args, base, method) if _bench_tunes(args, listed) else None
    specs = _bench_specs(args, base, listed, tuning)
    records = throughput.run_bench(engine, prompts, specs, seed=args.seed or 0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    rows = throughput.summarize_bench(records)
    roof = (
        []
        if args.no_roofline or engine.draft is None
        else throughput.roofline_rows(engine, specs, rows)
    )
    note = _bench_note(args, engine, len(prompts), base, tuning)
    report = throughput.write_bench_report(rows, roof, out, "Throughput on ShareGPT prompts", note)
    print(report.read_text())
    return 0


def _export_pair_stats(path: str, engine, tuning) -> None:
    """Write the pair's acceptance statistics the predictions used (``--export-pair-stats``)."""
    from smcspec.errors import ConfigError
    from smcspec.tuning.pair_stats import write_pair_stats

    if tuning.acceptance is None:
        raise ConfigError("--export-pair-stats needs a draft model: no acceptance was measured")
    acc_key = tuning.acceptance_key
    out = write_pair_stats(
        path, engine.target.path, engine.draft.path, tuning.key["machine"],
        {acc_key: tuning.acceptance},
    )  # fmt: skip
    print(f"\nThe pair's acceptance statistics at {acc_key}: {out}")


def _bench_note(args: argparse.Namespace, engine, prompts: int, base, tuning) -> str:
    """The report's note: provenance, models, prompts, budget, temperatures, the settings
    the tuner chose (``tuning``, or None), and the command that made it."""
    tuned = ""
    if tuning is not None:
        picks = ", ".join(f"{c.name} = {p.setting.name}" for c, p in tuning.picks.items())
        tuned = (
            f" Settings chosen from measured costs (--min-particles {args.min_particles}): {picks}."
        )
    return (
        f"{provenance(args, engine.target.backend)}. Target {engine.target.path.name}, draft "
        f"{engine.draft.path.name if engine.draft else '-'}. {prompts} ShareGPT V3 first "
        f"turns ({args.min_prompt_tokens}-{args.max_prompt_tokens} tokens, seed "
        f"{args.prompt_seed}), chat template; {base.max_new_tokens} new tokens"
        f"{_bench_eos_note(args.stop_at_eos)}; T_t {base.temperature}, T_d "
        f"{base.draft_temperature}; one request at a time, methods alternated.{tuned}\n\n"
        f"Command: `smcspec {shlex.join(args.argv)}`"
    )


def _bench_choices(args: argparse.Namespace) -> list[tuple[str, Choice | None]]:
    """``--methods`` resolved once: each listed name with its
    :class:`~smcspec.decoding.registry.Choice` (``ar``, ``sd``, ``smc``, ``auto``), or None
    where it names a setting (``smc-n8-k2``)."""
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    return [(name, choice_or_none(name)) for name in names]


def _bench_tunes(args: argparse.Namespace, listed: list[tuple[str, Choice | None]]) -> bool:
    """Whether bench needs the tuner: ``auto`` listed, or ``smc`` without -N/-K/--grid."""
    grid = args.grid is not None
    return any(
        c.wants_tuning(args.particles, args.draft_tokens, grid) for _, c in listed if c is not None
    )


def _bench_specs(
    args: argparse.Namespace,
    base: GenerationConfig,
    listed: list[tuple[str, Choice | None]],
    tuning=None,
) -> list:
    """The bench's methods: a choice whose method is chosen (``auto``) as
    ``auto-<chosen setting>`` (:func:`~smcspec.decoding.labels.chosen_label`), one of N and
    K alone (``smc``) without -N/-K/--grid as the chosen setting (skipped or defaulted while
    ``tuning`` is None, to check the options before the models load), the others by
    :func:`smcspec.eval.harness.method_specs`.

    Raises:
        ConfigError: an unknown method or a bad grid.
    """
    from smcspec.eval.harness import MethodSpec, method_specs

    specs = []
    tunes = _bench_tunes(args, listed)
    for name, wanted in listed:
        if wanted is None or not wanted.tuned:  # a setting's label, ar or sd
            specs += method_specs(name, base, args.grid)
            continue
        chosen = wanted.chooses_method or (tunes and args.grid is None)
        if chosen and tuning is not None:
            pick = tuning.pick(wanted)
            label = chosen_label(wanted, pick.setting.name)
            specs.append(MethodSpec(label, pick.setting.apply(base)))
        elif not wanted.chooses_method:  # smc with N and K, or before tuning: as given
            specs += method_specs(name, base, args.grid)
    for s in specs:
        s.config.validate()
    return specs


def _bench_eos_note(stop_at_eos: bool) -> str:
    """How the bench report's token budget reads: with EOS ignored every request runs to the
    budget, so a count of capped requests would say nothing."""
    if stop_at_eos:
        return " (stop at EOS; capped: requests that reached the budget without an end token)"
    return " (EOS ignored: every request decodes exactly that many, all hit the cap)"
