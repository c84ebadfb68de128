"""``smcspec serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os

from smcspec.cli.engine_args import load_engine, note, tuned_config, tuned_note
from smcspec.cli.options import config_from_args, method_args
from smcspec.config import draft_named
from smcspec.errors import ConfigError


def run(args: argparse.Namespace) -> int:
    """Load the pair, choose the default setting once if asked, and serve until stopped;
    returns the server's exit code.

    Raises:
        SmcspecError: bad options (before the models load) or model files.
    """
    from dataclasses import replace

    from smcspec.server import ServerSettings, serve

    method = method_args(args)
    cfg = config_from_args(args, method)
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [1, 65535], got {args.port}")
    settings = ServerSettings(
        max_running=args.max_running,
        max_waiting=args.max_waiting,
        max_request_bytes=args.max_request_bytes,
        api_key=args.api_key if args.api_key is not None else os.environ.get("SMCSPEC_API_KEY"),
        public_metrics=args.public_metrics,
        shutdown_timeout_s=args.shutdown_timeout,
        prefill_chunk=args.prefill_chunk,
        prefill_step_s=args.prefill_step_seconds,
    ).validate()  # before the models load
    # with the draft model, a request may ask for any method; with --draft ngram, for ar and
    # sd with n-gram drafts only
    engine = load_engine(args, with_draft=not draft_named(args.draft).from_text)
    cfg, pick = tuned_config(engine, args, cfg, method)  # once, at startup
    if pick is not None:
        note(f"default setting {tuned_note(pick, method.choice, args.min_ess)}")
    name = args.served_model_name or engine.target.name
    return serve(engine, args.host, args.port, cfg, replace(settings, model_name=name))
