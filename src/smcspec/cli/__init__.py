"""Command line: ``smcspec generate "PROMPT"``, ``serve``, ``eval TASK``, ``bench``,
``distill`` and ``rpc-server``.

Errors a user can cause print one line ``error: ...`` and exit with a non-zero code
(2: bad option or prompt, 3: model file problem, 4: numerical failure), never a traceback;
so does a fatal llama.cpp error (a lost RPC server, a GPU error: exit 1), which would
otherwise abort the process with ggml's message and a backtrace.

One module per command (``generate``, ``serve``, ``bench``, ``evaluate``, ``rpc_server``),
the parser (``parser``), the shared options (``options``) and what the commands share once
parsed (``engine_args``: loading the pair, progress lines, the tuner's settings, the
provenance line).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from smcspec.cli import bench, distill, evaluate, generate, rpc_server, serve
from smcspec.cli.parser import build_parser, parse_args
from smcspec.errors import BackendFailure, ConfigError, SmcspecError

__all__ = ["build_parser", "main", "parse_args"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``smcspec`` command; returns the exit code."""
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        if args.command == "serve":  # fails its requests first (server/backend_faults.py)
            return serve.run(args)
        if args.command == "rpc-server":
            return rpc_server.run(args)
        with llamacpp_aborts_as_errors():
            if args.command == "generate":
                return generate.run(args)
            if args.command == "eval":
                return evaluate.run(args)
            if args.command == "bench":
                return bench.run(args)
            if args.command == "distill":
                return distill.run(args)
    except SmcspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


@contextmanager
def llamacpp_aborts_as_errors() -> Iterator[None]:
    """While inside, a fatal llama.cpp error prints ``error: the model's backend failed:
    FILE:LINE: REASON`` and exits with :class:`BackendFailure`'s code, instead of ggml's
    abort (SIGABRT, a backtrace). Results already written stay (``eval`` appends each
    answer as it is scored). Without a usable llama-cpp-python, does nothing."""
    if importlib.util.find_spec("llama_cpp") is None:
        yield
        return
    from smcspec.backends.llamacpp.faults import on_abort

    def handler(message: str) -> None:
        print(f"error: the model's backend failed: {message}", file=sys.stderr, flush=True)
        os._exit(BackendFailure.exit_code)

    with ExitStack() as stack:
        try:
            stack.enter_context(on_abort(handler))
        except (ConfigError, OSError):  # a broken install: llama.cpp is not what runs then
            pass
        yield
