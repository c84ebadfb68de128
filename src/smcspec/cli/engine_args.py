"""What the subcommands share once parsed: loading the pair, progress lines on stderr,
settings chosen from measured costs, and the provenance line of reports."""

from __future__ import annotations

import argparse
import os
import sys

from smcspec.cli.options import MethodArgs
from smcspec.config import DEFAULT_MIN_ESS, GenerationConfig, draft_named
from smcspec.decoding.registry import Choice


def needs_model_draft(configs: list[GenerationConfig]) -> bool:
    """Whether any of ``configs`` drafts with the draft model (smc, or sd without
    ``--draft ngram``)."""
    from smcspec.decoding.registry import decoder_for

    return any(decoder_for(c).draft_model for c in configs)


def load_engine(args: argparse.Namespace, with_draft: bool = True):
    """Engine.load with the model options of ``args``; imported lazily so that
    `smcspec --help` and option errors are fast. ``--draft ngram`` names no file: the default
    draft model is loaded only if ``with_draft``. What ``--backend auto`` chose is the
    engine's ``target.backend`` (for :func:`provenance`)."""
    from smcspec.engine import Engine

    return Engine.load(
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


def note(line: str) -> None:
    """One line of progress on stderr (slow one-time work: measuring, quantizing)."""
    print(f"smcspec: {line}", file=sys.stderr, flush=True)


def tune_for(engine, args: argparse.Namespace, cfg: GenerationConfig, method: MethodArgs):
    """Measured costs (cached) -> predictions -> the chosen setting, for ``args`` (the pair's
    acceptance from ``method.pair_stats`` where given, measured on ``method.calibration``'s
    prompts where given)."""
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
        pair_stats=method.pair_stats,
        calibration=method.calibration,
    )


def tuned_config(engine, args: argparse.Namespace, cfg: GenerationConfig, method: MethodArgs):
    """``(cfg with the chosen setting, the Prediction)``, or ``(cfg, None)`` when ``args``
    names the setting itself: ``--method auto``, or ``smc`` without ``-N`` or ``-K`` (the
    one given is kept), is chosen from measured costs."""
    if not method.choice.wants_tuning(args.particles, args.draft_tokens):
        return cfg, None
    tuning = tune_for(engine, args, cfg, method)
    short = tuning.short_of_floor()
    if method.choice.chooses_method and short is not None:  # auto: ar and sd as well
        note(
            f"no SMC-SD setting keeps a predicted ESS of {tuning.min_ess:g} after a round "
            f"on this pair (best: {short.setting.name}, {short.ess:.2f}); auto "
            "chooses among ar and sd (--min-ess)"
        )
    pick = tuning.pick(method.choice)
    return pick.setting.apply(cfg).validate(), pick


def tuned_note(pick, method: Choice, min_ess: float = DEFAULT_MIN_ESS) -> str:
    """One line on a setting the tuner chose for ``method`` (``pick``, a
    :class:`~smcspec.tuning.predict.Prediction`): its name, predicted tokens/s and, for smc,
    its predicted ESS after a round, and whether it falls short of ``min_ess``."""
    note_ = (
        f"{pick.setting.name} chosen by {method.chosen_by} from measured costs, predicted "
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


def provenance(args: argparse.Namespace, backend: str | None = None) -> str:
    """Today's date and :func:`machine_line`: ``"<YYYY-MM-DD>; <machine and software>"``."""
    from datetime import date

    return f"{date.today().isoformat()}; {machine_line(args, backend)}"


def machine_line(args: argparse.Namespace, backend: str | None = None) -> str:
    """The machine (CPU model and threads, or the GPU's name) and the software that computed:
    llama-cpp-python's version and threads where the llamacpp backend runs, else torch's
    version and dtype. ``backend``: the one that ran (a loaded engine's
    ``target.backend``: what ``--backend auto`` chose), else ``--backend`` as given."""
    import torch

    from smcspec.tuning.cache import cpu_model

    backend = backend or getattr(args, "backend", None)
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
