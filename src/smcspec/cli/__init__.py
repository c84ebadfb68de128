"""Command line: ``smcspec generate "PROMPT"``, ``serve``, ``eval TASK``, ``bench`` and
``rpc-server``.

Errors a user can cause print one line ``error: ...`` and exit with a non-zero code
(2: bad option or prompt, 3: model file problem, 4: numerical failure), never a traceback.

One module per command (``generate``, ``serve``, ``bench``, ``evaluate``, ``rpc_server``),
the parser (``parser``), the shared options (``options``) and what the commands share once
parsed (``common``).
"""

from __future__ import annotations

import sys

from smcspec.cli import bench, evaluate, generate, rpc_server, serve
from smcspec.cli.parser import build_parser, parse_args
from smcspec.errors import SmcspecError

__all__ = ["build_parser", "main", "parse_args"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``smcspec`` command; returns the exit code."""
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        if args.command == "generate":
            return generate.run(args)
        if args.command == "serve":
            return serve.run(args)
        if args.command == "eval":
            return evaluate.run(args)
        if args.command == "bench":
            return bench.run(args)
        if args.command == "rpc-server":
            return rpc_server.run(args)
    except SmcspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0
