"""``smcspec rpc-server``: lend this machine's compute to another's target (llama.cpp RPC)."""

from __future__ import annotations

import argparse

from smcspec.cli.engine_args import note
from smcspec.errors import ConfigError


def run(args: argparse.Namespace) -> int:
    """Serve until stopped (SIGINT/SIGTERM). Raises ConfigError for a bad port, host or
    threads, or a llama.cpp build without RPC; RpcServerError (exit 1) when it cannot
    listen (the port in use, an address not this machine's)."""
    from smcspec.backends.llamacpp import physical_cores
    from smcspec.backends.llamacpp.rpc import listen_address, serve_rpc, supports_rpc
    from smcspec.server.app import is_loopback

    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [1, 65535], got {args.port}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    if not supports_rpc():
        raise ConfigError(
            "this llama-cpp-python build has no RPC backend; rebuild it with "
            "`bash scripts/setup.sh` (its builds turn GGML_RPC on)"
        )
    listen_address(args.host, args.port)  # a port in use or a bad host: one error line
    if not is_loopback(args.host):
        note(
            f"warning: serving RPC on {args.host}: the protocol has no authentication, anyone "
            "who can reach the port can run computations and read tensors; trusted networks only"
        )
    threads = args.threads or physical_cores()
    note(f"RPC server on {args.host}:{args.port} ({threads} threads)")
    serve_rpc(args.host, args.port, threads, args.cache_dir)  # returns only by raising
    return 0
