"""``smcspec serve`` as a child process on a free loopback port (for the serving benchmarks)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(*options: str, start_timeout_s: float = 900.0) -> Iterator[str]:
    """Run ``python -m smcspec serve --port P *options`` until the block ends.

    Yields the base URL (``http://127.0.0.1:P``) once ``/health`` answers 200 (loading the
    default pair can take minutes on a cold cache); the process is terminated on exit.

    Raises:
        RuntimeError: the server exited before it was healthy.
        TimeoutError: it was not healthy within ``start_timeout_s`` seconds.
    """
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "smcspec", "serve", "--port", str(port), *options]
    )
    try:
        deadline = time.time() + start_timeout_s
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode}")
            if time.time() > deadline:
                raise TimeoutError(f"the server was not healthy within {start_timeout_s:.0f} s")
            time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        server.wait(60)
