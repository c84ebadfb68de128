"""What the subcommands share once parsed: loading the pair, progress lines on stderr,
settings chosen from measured costs, and the provenance line of reports."""

from __future__ import annotations

import argparse
import os
import sys

from smcspec.config import DEFAULT_MIN_ESS, GenerationConfig, draft_named
from smcspec.decoding.registry import choice


def needs_model_draft(configs: list[GenerationConfig]) -> bool:
    """Whether any of ``configs`` drafts with the draft model (smc, or sd without
    ``--draft ngram``)."""
    from smcspec.decoding.registry import decoder_for

    return any(decoder_for(c).draft_model for c in configs)


def load_engine(args: argparse.Namespace, with_draft: bool = True):
    """Engine.load with the model options of ``args``; imported lazily so that
    `smcspec --help` and option errors are fast. Sets ``args.resolved_backend`` (the
    target's backend) for :func:`provenance`. ``--draft ngram`` names no file: the default
    draft model is loaded only if ``with_draft``."""
    from smcspec.engine import Engine

    engine = Engine.load(
        args.target,
        None if draft_named(args.draft).from_text else args.draft,  # --draft ngram: no file
        device=args.device,
        dtype=args.dtype,
        with_draft=with_draft,
        backend=args.backend,
        threads=args.threads,
        quantize_draft=args.quantize_draft,
        log=note,
        gpu_layers=args.gpu_layers,
        rpc=args.rpc,
        fair_share=not args.fixed_threads,
        fp8=args.fp8,
    )
    args.resolved_backend = engine.target.backend  # what --backend auto chose, for reports
    return engine


def note(line: str) -> None:
    """One line of progress on stderr (slow one-time work: measuring, quantizing)."""
    print(f"smcspec: {line}", file=sys.stderr, flush=True)


def wants_tuning(args: argparse.Namespace) -> bool:
    """Whether the setting is chosen from measured costs: ``--method auto``, or ``smc``
    without ``-N`` or ``-K`` (the one given is kept)."""
    return choice(args.method).wants_tuning(args.particles, args.draft_tokens)


def tune_for(engine, args: argparse.Namespace, cfg: GenerationConfig):
    """Measured costs (cached) -> predictions -> the chosen setting, for ``args``."""
    from smcspec.tuning import tune

    return tune(
        engine,
        cfg,
        min_particles=args.min_particles,
        particles=args.particles,
        draft_tokens=args.draft_tokens,
        log=note,
        remeasure=getattr(args, "remeasure", False),
        min_ess=getattr(args, "min_ess", DEFAULT_MIN_ESS),
        pair_stats=_pair_stats(args),
    )


def _pair_stats(args: argparse.Namespace):
    """The ``--pair-stats`` file, read once (:func:`config_from_args` reads it first, so that
    a bad file fails before the models load)."""
    if getattr(args, "pair_stats", None) is None:
        return None
    if getattr(args, "pair_stats_read", None) is None:
        from smcspec.tuning.pair_stats import read_pair_stats

        args.pair_stats_read = read_pair_stats(args.pair_stats)
    return args.pair_stats_read


def tuned_config(engine, args: argparse.Namespace, cfg: GenerationConfig):
    """``(cfg with the chosen setting, the Prediction)``, or ``(cfg, None)`` when ``args``
    names the setting itself (:func:`wants_tuning`)."""
    if not wants_tuning(args):
        return cfg, None
    tuning = tune_for(engine, args, cfg)
    best_smc = tuning.smc
    picks_any = not choice(args.method).particles_only  # auto: ar and sd as well
    if picks_any and best_smc is not None and best_smc.ess is not None:
        if best_smc.ess < tuning.min_ess:
            note(
                f"no SMC-SD setting keeps a predicted ESS of {tuning.min_ess:g} after a round "
                f"on this pair (best: {best_smc.setting.name}, {best_smc.ess:.2f}); auto "
                "chooses among ar and sd (--min-ess)"
            )
    pick = tuning.pick(args.method)
    return pick.setting.apply(cfg).validate(), pick


def tuned_note(pick, method: str, min_ess: float = DEFAULT_MIN_ESS) -> str:
    """One line on a setting the tuner chose (``pick``, a
    :class:`~smcspec.tuning.predict.Prediction`): its name, predicted tokens/s and, for smc,
    its predicted ESS after a round, and whether it falls short of ``min_ess``."""
    how = "--method auto" if choice(method).tuned == "always" else "smc without -N/-K"
    note_ = (
        f"{pick.setting.name} chosen by {how} from measured costs, predicted "
        f"{pick.tokens_per_second:.2f} tokens/s"
    )
    if pick.setting.ngram:
        note_ += " at its gate's threshold (where the text copies; ar's speed where it does not)"
    if pick.ess is not None:
        n = pick.setting.particles
        note_ += f", predicted ESS {pick.ess:.2f} of {n} after a round"
        if pick.ess < min_ess:
            note_ += f" (no smc setting meets --min-ess {min_ess:g}: the most faithful one)"
    return note_


def provenance(args: argparse.Namespace) -> str:
    """Today's date and :func:`machine_line`: ``"<YYYY-MM-DD>; <machine and software>"``."""
    from datetime import date

    return f"{date.today().isoformat()}; {machine_line(args)}"


def machine_line(args: argparse.Namespace) -> str:
    """The machine (CPU model and threads, or the GPU's name) and the software that computed:
    llama-cpp-python's version and threads where the llamacpp backend runs (as given, or as
    ``--backend auto`` chose it in :func:`load_engine`), else torch's version and dtype."""
    import torch

    from smcspec.tuning.cache import cpu_model

    backend = getattr(args, "resolved_backend", None) or getattr(args, "backend", None)
    if backend == "llamacpp":
        from importlib.metadata import version

        threads = args.threads or "physical-core"
        share = "" if getattr(args, "fixed_threads", False) else " (fewer while cores are busy)"
        return (
            f"{cpu_model()} CPU, {os.cpu_count()} cores, {threads} llama.cpp "
            f"threads{share}; llama-cpp-python {version('llama_cpp_python')}, weights as the GGUF "
            "files store them"
        )
    if args.device.startswith("cuda") and torch.cuda.is_available():
        machine = torch.cuda.get_device_name(torch.device(args.device))
    else:
        cores = f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
        machine = f"{cpu_model()} CPU, {cores}"
    fp8 = ", FP8 projections" if getattr(args, "fp8", False) else ""
    return f"{machine}; torch {torch.__version__}; {args.dtype}{fp8}"
