"""The ``smcspec`` argument parser: one subparser per command."""

from __future__ import annotations

import argparse

from smcspec.cli.distill import add_parser as add_distill_parser
from smcspec.cli.options import (
    BENCH_M_HELP,
    EVAL_M_HELP,
    model_options,
    resolve_max_new_tokens,
    tuning_options,
)


def build_parser() -> argparse.ArgumentParser:
    """The whole ``smcspec`` parser: one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="smcspec", description="LLM inference with SMC speculative decoding."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    common = [model_options(), tuning_options()]
    _generate(sub, common)
    _rpc_server(sub)
    _serve(sub, common)
    _eval(sub)
    _bench(sub)
    add_distill_parser(sub)
    return parser


def _generate(sub, common: list[argparse.ArgumentParser]) -> None:
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
    r = g.add_argument_group("steering particles (smc)")
    t = r.add_mutually_exclusive_group()
    t.add_argument(
        "--reward",
        choices=["examples", "arithmetic"],
        help="examples: reward code by the share of the prompt's own examples it passes "
        "(doctest lines or 'f(1) == 2'), run in a sandbox; arithmetic: weigh a worked answer "
        "down by exp(-beta) for each false equation (165 \\times 12 = 2040), checked as each "
        "line ends",
    )
    t.add_argument(
        "--tests",
        metavar="FILE",
        help="reward code by the share of these examples it passes (assert statements or "
        "doctest lines), run in a sandbox",
    )
    r.add_argument(
        "--reward-beta", type=float, default=5.0, help="beta of exp(beta * R) (default 5)"
    )
    r.add_argument(
        "--sandbox",
        choices=["auto", "bwrap", "rlimit"],
        default="auto",
        help="where rewarded code runs: bubblewrap, or resource limits only (default auto: "
        "bubblewrap where it works)",
    )
    r.add_argument(
        "--aggregate",
        choices=["none", "vote"],
        default="none",
        help="vote: also report the weighted vote over the particles' answers",
    )
    r.add_argument(
        "--answer-regex",
        metavar="PATTERN",
        help="a particle's answer for the vote: the last match (its first group if any); "
        "default the last number, or with --reward examples / --tests the code's behaviour on "
        "the examples",
    )


def _rpc_server(sub) -> None:
    r = sub.add_parser(
        "rpc-server",
        help="lend this machine to another's target (llama.cpp RPC; trusted networks only)",
    )
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=50052)
    r.add_argument("--threads", type=int, default=None, help="default: physical cores")
    r.add_argument(
        "--cache-dir", default=None, help="cache tensors sent by clients here (llama.cpp -c)"
    )


def _serve(sub, common: list[argparse.ArgumentParser]) -> None:
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
    s.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prompts are prefilled in chunks of this many tokens, cut at the same places "
        "whatever the timing, one or more a scheduler step between other requests' forwards "
        "(default: 128 with the target on a CPU, 512 on a GPU)",
    )
    s.add_argument(
        "--prefill-step-seconds",
        type=float,
        default=1.0,
        help="seconds of prefill a scheduler step aims at: a step runs another prompt chunk "
        "while its prefill is expected to stay within this (default 1; the first always runs)",
    )


def _eval(sub) -> None:
    e = sub.add_parser(
        "eval", parents=[model_options(EVAL_M_HELP)], help="task accuracy of several methods"
    )
    e.add_argument("task", choices=["gsm8k", "humaneval", "fidelity"])
    e.add_argument("--methods", default="ar,smc", help="comma list of ar, sd, smc")
    e.add_argument("--grid", default=None, help="sd/smc settings, e.g. 'N=2,4,8;K=2,4,8'")
    e.add_argument(
        "--data", default=None, help="GSM8K JSONL (default: the test split shipped in the package)"
    )
    e.add_argument("--limit", type=int, default=None, help="seeded random subset size")
    e.add_argument(
        "--first",
        type=int,
        default=None,
        help="the first N items in file order (a run extended later keeps its earlier items)",
    )
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
        "--reward-beta",
        type=float,
        default=0.7,
        help="fidelity: beta of the reward R(x) = number of token 1 (default 0.7)",
    )
    e.add_argument(
        "--no-potentials",
        action="store_true",
        help="fidelity: skip the constraint and reward sections (masked AR, SMC-SD with them)",
    )


def _bench(sub) -> None:
    b = sub.add_parser(
        "bench",
        parents=[model_options(BENCH_M_HELP), tuning_options()],
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
    b.add_argument(
        "--export-pair-stats",
        default=None,
        metavar="FILE",
        help="with --predict: write the pair's acceptance statistics (alpha, log-weight "
        "quantiles, agreement profiles at these sampling settings) to FILE, for --pair-stats "
        "on a machine without the weights",
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


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse a command line, with the per-command defaults resolved (``-m``)."""
    args = build_parser().parse_args(argv)
    args.argv = list(argv)
    if args.command in ("rpc-server", "distill"):  # no decoding options
        return args
    args.max_new_tokens_given = args.max_new_tokens is not None  # else a default cap
    args.max_new_tokens = resolve_max_new_tokens(args)
    return args
