"""Command line: ``smcspec generate "PROMPT"``, ``serve``, ``eval TASK`` and ``bench``.

Errors a user can cause print one line ``error: ...`` and exit with a non-zero code
(2: bad option or prompt, 3: model file problem, 4: numerical failure), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from smcspec.config import METHODS, GenerationConfig, check_min_particles
from smcspec.errors import ConfigError, SmcspecError
from smcspec.models.loading import BACKENDS
from smcspec.models.quantize import quantize_types
from smcspec.potentials import Constraint, Grammar, JsonSchema, Regex
from smcspec.sampling.resampling import RESAMPLERS

DEFAULT_PARTICLES = GenerationConfig.particles
DEFAULT_DRAFT_TOKENS = GenerationConfig.draft_tokens


def _load_engine(args: argparse.Namespace, with_draft: bool = True):
    """Engine.load with the model options of ``args``; imported lazily so that
    `smcspec --help` and option errors are fast."""
    from smcspec.engine import Engine

    return Engine.load(
        args.target,
        args.draft,
        device=args.device,
        dtype=args.dtype,
        with_draft=with_draft,
        backend=args.backend,
        threads=args.threads,
        quantize_draft=args.quantize_draft,
        log=_note,
    )


def _note(line: str) -> None:
    """One line of progress on stderr (slow one-time work: measuring, quantizing)."""
    print(f"smcspec: {line}", file=sys.stderr, flush=True)


def wants_tuning(args: argparse.Namespace) -> bool:
    """Whether the setting is chosen from measured costs: ``--method auto``, or ``smc``
    without ``-N`` or ``-K`` (the one given is kept)."""
    if args.method == "auto":
        return True
    return args.method == "smc" and (args.particles is None or args.draft_tokens is None)


def _tune(engine, args: argparse.Namespace, cfg: GenerationConfig):
    """Measured costs (cached) -> predictions -> the chosen setting, for ``args``."""
    return engine.tune(
        cfg,
        min_particles=args.min_particles,
        particles=args.particles,
        draft_tokens=args.draft_tokens,
        log=_note,
        remeasure=getattr(args, "remeasure", False),
    )


def _tuned(engine, args: argparse.Namespace, cfg: GenerationConfig):
    """``(cfg with the chosen setting, the Prediction)``, or ``(cfg, None)`` when ``args``
    names the setting itself (:func:`wants_tuning`)."""
    if not wants_tuning(args):
        return cfg, None
    pick = _tune(engine, args, cfg).pick(args.method)
    return pick.setting.apply(cfg).validate(), pick


def _tuned_note(pick, method: str) -> str:
    how = "--method auto" if method == "auto" else "smc without -N/-K"
    return (
        f"{pick.setting.name} chosen by {how} from measured costs, predicted "
        f"{pick.tokens_per_second:.2f} tokens/s"
    )


DEFAULT_MAX_NEW_TOKENS = 128
"""New tokens per answer of ``generate``, ``serve`` and ``bench`` unless ``-m`` is given."""

EVAL_MAX_NEW_TOKENS = {"gsm8k": 512, "humaneval": 1024}
"""Per-task new-token budgets of ``eval`` unless ``-m`` is given (at 128, GSM8K answers were
cut before their ``#### N`` line). GSM8K: 512, as in the SMC-SD reference engine's GSM8K script.
HumanEval: OpenAI's ``human-eval`` harness and the Codex paper fix no budget (Codex sampled
until a stop sequence such as ``"\\ndef"``); OpenAI's ``simple-evals``, which like us asks a
chat model for the whole function, samples with ``max_tokens=1024`` by default. The whole
reference function (prompt plus canonical solution) is up to 557 tokens with the default
pair's Qwen2.5 tokenizer (HumanEval/129; median 167), so 512 could cut a correct answer.
"""

_EVAL_M_HELP = (
    "max new tokens per answer (default: gsm8k 512, as in the SMC-SD reference GSM8K script; "
    "humaneval 1024, as in OpenAI's simple-evals, since human-eval and the Codex paper set no "
    "budget and the longest reference function is 557 tokens; fidelity does not use it)"
)

_BENCH_M_HELP = (
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
    return DEFAULT_MAX_NEW_TOKENS


def _model_options(max_new_tokens_help: str | None = None) -> argparse.ArgumentParser:
    """Model and decoding options shared by the subcommands; ``max_new_tokens_help`` is the
    subcommand's help for ``-m`` (its default is resolved after parsing, see
    :func:`resolve_max_new_tokens`)."""
    m_help = max_new_tokens_help or f"max new tokens (default: {DEFAULT_MAX_NEW_TOKENS})"
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("models")
    g.add_argument("--target", default=None, help="target model: GGUF file or HF directory")
    g.add_argument("--draft", default=None, help="draft model: GGUF file or HF directory")
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
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="torch backend weights and compute (llamacpp uses the file's types)",
    )
    g.add_argument(
        "--quantize-draft",
        metavar="TYPE",
        default=None,
        choices=quantize_types(),
        help="run the GGUF draft re-quantized to this llama.cpp type, made once and cached "
        f"({', '.join(quantize_types())}; llamacpp backend)",
    )
    d = p.add_argument_group("decoding")
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
        f"costs; eval: {DEFAULT_PARTICLES})",
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
    d.add_argument("--temperature", type=float, default=0.7, help="target temperature T_t")
    d.add_argument("--draft-temperature", type=float, default=0.7, help="draft temperature T_d")
    d.add_argument("--alpha", type=float, default=1.0, help="power exponent of the SMC target")
    d.add_argument(
        "--top-k", type=int, default=0, help="keep the k most likely tokens (0 or -1: off)"
    )
    d.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus: keep the most likely tokens up to this mass, in (0, 1] (1: off)",
    )
    d.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="keep tokens with p >= min_p * max p, in [0, 1] (0: off)",
    )
    d.add_argument(
        "--ess-threshold",
        type=float,
        default=0.5,
        help="kappa: resample when ESS < kappa*N (0 disables)",
    )
    d.add_argument("--resampler", choices=list(RESAMPLERS), default="systematic")
    d.add_argument("--seed", type=int, default=None)
    return p


def _tuning_options() -> argparse.ArgumentParser:
    """``--min-particles``, for the commands that choose settings from measured costs."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--min-particles",
        type=int,
        default=4,
        help="the fewest particles smc and auto may choose: the fidelity floor (default 4)",
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smcspec", description="LLM inference with SMC speculative decoding."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    common = [_model_options(), _tuning_options()]
    g = sub.add_parser("generate", parents=common, help="generate a completion for one prompt")
    g.add_argument("prompt", help="the prompt (a user message unless --no-chat)")
    g.add_argument("--no-chat", action="store_true", help="raw completion, no chat template")
    g.add_argument(
        "--particles-out",
        action="store_true",
        help="also report every particle and its weight (smc, with --json)",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object at the end")
    c = g.add_mutually_exclusive_group()
    c.add_argument("--json-schema", metavar="FILE", help="output must be JSON valid under it")
    c.add_argument("--regex", metavar="PATTERN", help="output must match this regular expression")
    c.add_argument("--grammar", metavar="FILE", help="output must follow this Lark grammar")
    s = sub.add_parser(
        "serve",
        parents=common,
        help="OpenAI-compatible HTTP server (decoding options are defaults)",
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients use (default: the target file's name)",
    )
    s.add_argument("--max-running", type=int, default=16, help="requests decoded together")
    s.add_argument(
        "--max-waiting", type=int, default=64, help="queued requests beyond this get HTTP 429"
    )
    s.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="request bodies over this get HTTP 413 before they are read (default 4 MiB)",
    )
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $SMCSPEC_API_KEY; without a key, bind only to loopback)",
    )
    s.add_argument(
        "--public-metrics",
        action="store_true",
        help="with an API key, leave /metrics open for Prometheus scrapers",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds in-flight requests get to finish after SIGTERM/SIGINT (default 5)",
    )
    e = sub.add_parser(
        "eval", parents=[_model_options(_EVAL_M_HELP)], help="task accuracy of several methods"
    )
    e.add_argument("task", choices=["gsm8k", "humaneval", "fidelity"])
    e.add_argument("--methods", default="ar,smc", help="comma list of ar, sd, smc")
    e.add_argument("--grid", default=None, help="sd/smc settings, e.g. 'N=2,4,8;K=2,4,8'")
    e.add_argument(
        "--data", default=None, help="GSM8K JSONL (default: the test split shipped in the package)"
    )
    e.add_argument("--limit", type=int, default=None, help="seeded random subset size")
    e.add_argument("--subset-seed", type=int, default=0)
    e.add_argument("--out", default="eval-out", help="directory for results.jsonl and reports")
    e.add_argument("--rescore", action="store_true", help="score stored outputs again only")
    e.add_argument(
        "--nll", action="store_true", help="also score each output's per-token NLL under the target"
    )
    e.add_argument(
        "--speed-from",
        default=None,
        help="runs.jsonl of a `smcspec bench` run: its median tokens/s per method on the plot",
    )
    e.add_argument("--runs", type=int, default=2000, help="fidelity: seeded runs per setting")
    e.add_argument("--fidelity-n", default="1,2,4,8,16", help="fidelity: particle counts")
    e.add_argument("--fidelity-k", default="1,2,4", help="fidelity: draft token counts")
    e.add_argument(
        "--potential-k",
        type=int,
        default=2,
        help="fidelity: K of the constrained and reward SMC-SD runs (default 2)",
    )
    e.add_argument(
        "--no-potentials",
        action="store_true",
        help="fidelity: skip the constraint and reward sections (masked AR, SMC-SD with them)",
    )
    b = sub.add_parser(
        "bench",
        parents=[_model_options(_BENCH_M_HELP), _tuning_options()],
        help="tokens/s and time to first token on ShareGPT prompts",
    )
    b.add_argument(
        "--methods",
        default="ar,sd,smc",
        help="comma list of ar, sd, smc, auto (auto, and smc without -N/-K/--grid: the "
        "setting chosen from measured costs)",
    )
    b.add_argument(
        "--predict",
        action="store_true",
        help="print the predicted tokens/s of every ar, sd and smc setting from this "
        "machine's measured forward costs, and the chosen ones; run nothing else",
    )
    b.add_argument(
        "--remeasure",
        action="store_true",
        help="measure the forward costs again, replacing the cached ones (measure on an "
        "otherwise idle machine)",
    )
    b.add_argument("--grid", default=None, help="sd/smc settings, e.g. 'N=2,4,8;K=4'")
    b.add_argument("--prompts", type=int, default=8, help="number of ShareGPT prompts")
    b.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompt sample")
    b.add_argument("--min-prompt-tokens", type=int, default=16)
    b.add_argument("--max-prompt-tokens", type=int, default=256)
    b.add_argument("--sharegpt", default=None, help="ShareGPT JSON (default: the package's)")
    b.add_argument(
        "--stop-at-eos", action="store_true", help="stop at EOS (default: always max tokens)"
    )
    b.add_argument("--no-roofline", action="store_true", help="skip the forward-cost roofline")
    b.add_argument("--out", default="bench-out", help="directory for runs.jsonl and reports")
    return parser


def _eval(args: argparse.Namespace) -> int:
    from smcspec.eval import harness
    from smcspec.eval.results import ResultFile

    base = _config(args)  # eval decodes the settings it is given: N and K default to 4
    if args.task == "fidelity":
        return _fidelity(args)
    specs = harness.method_specs(args.methods, base, args.grid)
    if args.task == "gsm8k":
        from smcspec.eval.gsm8k import load_gsm8k

        items = load_gsm8k(_gsm8k_data(args), args.limit, args.subset_seed)
    else:
        from smcspec.eval.humaneval import load_humaneval

        items = load_humaneval(args.limit, args.subset_seed)
    out = Path(args.out)
    results = ResultFile(out / "results.jsonl")
    if args.rescore:
        records = harness.rescore(args.task, results.records(), items)
    else:
        engine = _load_engine(args, with_draft=any(s.config.method != "ar" for s in specs))
        records = harness.run_task(
            engine, args.task, items, specs, results, seed=args.seed or 0, score_nll=args.nll
        )
    rows = harness.summarize(records)
    answered = len({r["item"] for r in records})
    note = (
        f"{answered} of {len(items)} items answered (subset seed {args.subset_seed}), "
        f"methods {args.methods}"
        f"{', grid ' + args.grid if args.grid else ''}; "
        f"{harness.budget_note(records, base.max_new_tokens)}, "
        f"T_t {base.temperature}, T_d {base.draft_temperature}; {_provenance(args)}.\n\n"
        f"Command: `smcspec {shlex.join(args.argv)}`"
    )
    if args.rescore:
        note += " (Outputs generated by this command without --rescore.)"
    speeds = None
    if args.speed_from:
        from smcspec.eval.bench import load_bench_speeds

        speeds = load_bench_speeds(args.speed_from)
        note += f" Speeds on the plot: median tokens/s of the bench run `{args.speed_from}`."
    report = harness.write_report(rows, out, f"{args.task} accuracy", note, speeds)
    print(report.read_text())
    return 0


def _gsm8k_data(args: argparse.Namespace) -> Path:
    """The GSM8K JSONL file to read: ``--data``, else the test split shipped in the package.

    Raises:
        ConfigError: if that file does not exist.
    """
    from smcspec.eval.gsm8k import packaged_test_path

    try:
        data = Path(args.data) if args.data else packaged_test_path()
    except FileNotFoundError as exc:
        raise ConfigError(f"{exc} (pass --data)") from exc
    if not data.is_file():
        raise ConfigError(f"GSM8K file not found: {data} (pass --data)")
    return data


def _provenance(args: argparse.Namespace) -> str:
    """Date, machine (CPU model and threads, or the GPU's name), torch version and dtype."""
    import platform
    from datetime import date

    import torch

    if args.device.startswith("cuda") and torch.cuda.is_available():
        machine = torch.cuda.get_device_name(torch.device(args.device))
    else:
        cpu = platform.processor() or platform.machine()
        info = Path("/proc/cpuinfo")
        if info.is_file():
            names = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines()
                     if ln.startswith("model name")]  # fmt: skip
            cpu = names[0] if names else cpu
        machine = f"{cpu} CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{date.today().isoformat()}; {machine}; torch {torch.__version__}; {args.dtype}"


def _bench(args: argparse.Namespace) -> int:
    from smcspec.eval import bench
    from smcspec.eval.sharegpt import load_sharegpt_prompts

    base = _config(args, ignore_eos=not args.stop_at_eos)
    specs = _bench_specs(args, base)  # option errors before the models load
    needs_draft = args.predict or any(s.config.method != "ar" for s in specs)
    engine = _load_engine(args, with_draft=needs_draft or "auto" in _bench_methods(args))
    if args.predict:
        from smcspec.tuning import format_table

        print(format_table(_tune(engine, args, base)), end="")
        return 0
    prompts = load_sharegpt_prompts(
        args.prompts,
        engine.tokenizer,
        seed=args.prompt_seed,
        min_tokens=args.min_prompt_tokens,
        max_tokens=args.max_prompt_tokens,
        path=args.sharegpt,
    )
    tuning = _tune(engine, args, base) if _bench_tunes(args) else None
    specs = _bench_specs(args, base, tuning)
    records = bench.run_bench(engine, prompts, specs, seed=args.seed or 0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    rows = bench.summarize_bench(records)
    roof = (
        [] if args.no_roofline or engine.draft is None else bench.roofline_rows(engine, specs, rows)
    )
    tuned = (
        ""
        if tuning is None
        else f" Settings chosen from measured costs (--min-particles {args.min_particles}): "
        f"auto = {tuning.auto.setting.name}"
        + (f", smc = {tuning.smc.setting.name}" if tuning.smc else "")
        + "."
    )
    note = (
        f"{_provenance(args)}. Target {engine.target.path.name}, draft "
        f"{engine.draft.path.name if engine.draft else '-'}. {len(prompts)} ShareGPT V3 first "
        f"turns ({args.min_prompt_tokens}-{args.max_prompt_tokens} tokens, seed "
        f"{args.prompt_seed}), chat template; {base.max_new_tokens} new tokens"
        f"{_bench_eos_note(args.stop_at_eos)}; T_t {base.temperature}, T_d "
        f"{base.draft_temperature}; one request at a time, methods alternated.{tuned}\n\n"
        f"Command: `smcspec {shlex.join(args.argv)}`"
    )
    report = bench.write_bench_report(rows, roof, out, "Throughput on ShareGPT prompts", note)
    print(report.read_text())
    return 0


def _bench_methods(args: argparse.Namespace) -> list[str]:
    return [m.strip() for m in args.methods.split(",") if m.strip()]


def _bench_tunes(args: argparse.Namespace) -> bool:
    """Whether bench needs the tuner: ``auto`` listed, or ``smc`` without -N/-K/--grid."""
    methods = _bench_methods(args)
    unset = args.particles is None or args.draft_tokens is None
    return "auto" in methods or ("smc" in methods and unset and args.grid is None)


def _bench_specs(args: argparse.Namespace, base: GenerationConfig, tuning=None) -> list:
    """The bench's methods: ``auto`` as ``auto-<chosen setting>``, ``smc`` without
    -N/-K/--grid as the chosen smc setting (both skipped/defaulted while ``tuning`` is None,
    to check the options before the models load), the others by
    :func:`smcspec.eval.harness.method_specs`.

    Raises:
        ConfigError: an unknown method or a bad grid.
    """
    from smcspec.eval.harness import MethodSpec, method_specs

    specs = []
    tunes = _bench_tunes(args)
    for name in _bench_methods(args):
        if name == "auto":
            if tuning is not None:
                pick = tuning.auto
                specs.append(MethodSpec(f"auto-{pick.setting.name}", pick.setting.apply(base)))
        elif name == "smc" and tunes and args.grid is None and tuning is not None:
            specs.append(MethodSpec(tuning.smc.setting.name, tuning.smc.setting.apply(base)))
        else:
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


def _fidelity(args: argparse.Namespace) -> int:
    import time

    from smcspec.eval import fidelity as fid
    from smcspec.eval.automaton import NextTokenAutomaton

    ns = [int(v) for v in args.fidelity_n.split(",")]
    ks = [int(v) for v in args.fidelity_k.split(",")]
    prompt, length = [1, 2, 0], 3
    with fid.one_thread():
        start = time.perf_counter()
        target, draft = fid.tiny_transformer(seed=1), fid.tiny_transformer(seed=2)
        rows, draft_tv = fid.fidelity_grid(target, draft, prompt, length, ns, ks, args.runs)
        seconds = f"wall time {time.perf_counter() - start:.0f} s"
        potentials, summary = None, ""
        if not args.no_potentials:
            start = time.perf_counter()
            near = fid.tiny_transformer(seed=2, scale=0.1, base=target)
            dfa = NextTokenAutomaton(fid.CONSTRAINT_TABLE, target.cfg.vocab_size)
            reward = fid.letter_count_reward(1, _FIDELITY_BETA, target.cfg.vocab_size)
            potentials = fid.potential_fidelity(
                target, near, prompt, length, ns, args.potential_k, args.runs, dfa, reward
            )
            summary = fid.potential_summary(potentials)
            seconds += f" (+ {time.perf_counter() - start:.0f} s with potentials)"
        note = (
            f"Tiny random 1-layer models (vocab 4, target seed 1, draft seed 2), prompt "
            f"[1, 2, 0], distribution of the first {length} generated tokens (64 sequences), "
            f"T = 1, {args.runs} seeded runs per setting; KL uses eps = 1e-6 smoothing. "
            f"{_provenance(args)}; {seconds}.\n\nCommand: `smcspec {shlex.join(args.argv)}`"
        )
    md = fid.write_fidelity_report(rows, draft_tv, args.out, note, potentials, _POTENTIALS_NOTE)
    print(md.read_text())
    if summary:
        print(summary)
    return 0


_FIDELITY_BETA = 0.7
_POTENTIALS_NOTE = (
    "Same target and prompt; the draft is a perturbed copy of the target (its weights plus "
    "Gaussian noise of std 0.1, seed 2), as a real draft is close to its target. Constraint: "
    "a token automaton (after 0 only 1; after 1 only 2 or 3; after 3 only 0; anything first "
    f'and after 2). Reward: R(x) = number of token 1 ("b") in x, beta = {_FIDELITY_BETA}. '
    "Exact targets by enumeration: the conditional p(x | x in A), the locally-masked "
    "distribution prod_t norm(p(. | x_<t) m_t) and p(x) exp(beta R(x)) / Z "
    "(`docs/constraints.md`). Run i of each SMC-SD setting and of masked AR's larger sample "
    "is seeded i; masked AR's smaller sample is seeded from `runs` on (independent)."
)


def _config(args: argparse.Namespace, **extra) -> GenerationConfig:
    """The GenerationConfig of ``args``, validated before any model loads. An unset N or K is
    the default one (4) here; ``auto`` validates as ``smc``. For ``auto``, and ``smc`` without
    -N/-K, :func:`_tuned` later replaces them with the chosen setting."""
    if getattr(args, "min_particles", None) is not None:
        check_min_particles(args.min_particles)
    return GenerationConfig(
        method="smc" if args.method == "auto" else args.method,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        draft_temperature=args.draft_temperature,
        particles=DEFAULT_PARTICLES if args.particles is None else args.particles,
        draft_tokens=DEFAULT_DRAFT_TOKENS if args.draft_tokens is None else args.draft_tokens,
        alpha=args.alpha,
        ess_threshold=args.ess_threshold,
        resampler=args.resampler,
        seed=args.seed,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        **extra,
    ).validate()  # fail on bad options before spending time loading models


def _serve(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from smcspec.server import ServerSettings, serve

    cfg = _config(args)
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [1, 65535], got {args.port}")
    settings = ServerSettings(
        max_running=args.max_running,
        max_waiting=args.max_waiting,
        max_request_bytes=args.max_request_bytes,
        api_key=args.api_key if args.api_key is not None else os.environ.get("SMCSPEC_API_KEY"),
        public_metrics=args.public_metrics,
        shutdown_timeout_s=args.shutdown_timeout,
    ).validate()  # before the models load
    engine = _load_engine(args)  # with the draft: a request may ask for any method
    cfg, pick = _tuned(engine, args, cfg)  # once, at startup
    if pick is not None:
        _note(f"default setting {_tuned_note(pick, args.method)}")
    name = args.served_model_name or engine.target.name
    return serve(engine, args.host, args.port, cfg, replace(settings, model_name=name))


def _constraint(args: argparse.Namespace) -> Constraint | None:
    """The constraint of ``--json-schema`` / ``--regex`` / ``--grammar`` (None without one).

    Raises :class:`ConfigError` for an unreadable file; the pattern, schema or grammar itself
    is checked when it is compiled against the tokenizer (also a ConfigError, exit 2).
    """
    if args.regex is not None:
        return Regex(args.regex)
    for path, kind in ((args.json_schema, "JSON schema"), (args.grammar, "grammar")):
        if path is None:
            continue
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read {kind} file {path}: {exc}") from exc
        return JsonSchema(text) if kind == "JSON schema" else Grammar(text)
    return None


def _generate(args: argparse.Namespace) -> int:
    cfg = _config(args, return_particles=args.particles_out, constraint=_constraint(args))
    engine = _load_engine(args, with_draft=args.method != "ar")
    engine.encode(args.prompt, chat=not args.no_chat)  # a bad prompt fails before tuning
    cfg, pick = _tuned(engine, args, cfg)

    def stream(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = engine.generate(
        args.prompt, cfg, chat=not args.no_chat, on_text=None if args.json else stream
    )
    if args.json:
        out = result.to_dict()
        if pick is not None:
            out["tuned"] = {
                "setting": pick.setting.name,
                "chosen_by": args.method,
                "min_particles": args.min_particles,
                "predicted_tokens_per_second": round(pick.tokens_per_second, 3),
            }
        print(json.dumps(out, ensure_ascii=False))
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
        if "log_normalizer" in s:  # a constraint or reward was set
            line += f", log Z {s['log_normalizer']:.3f}, dead particles {s['dead_particles']}"
    elif result.method == "sd":
        line += (
            f", K={s['draft_tokens']}, rounds {s['rounds']}, acceptance rate "
            f"{s['acceptance_rate']:.3f}, mean accepted length {s['mean_accepted_length']:.2f}"
        )
    if pick is not None:
        line += f"; {_tuned_note(pick, args.method)}"
    print(f"\n{line}")
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse a command line, with the per-command defaults resolved (``-m``)."""
    args = build_parser().parse_args(argv)
    args.argv = list(argv)
    args.max_new_tokens = resolve_max_new_tokens(args)
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``smcspec`` command; returns the exit code."""
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "eval":
            return _eval(args)
        if args.command == "bench":
            return _bench(args)
    except SmcspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
