"""The RPC handshake that runs before llama.cpp touches an ``--rpc`` address.

llama.cpp's client aborts the process on a peer that is not an RPC server and waits forever
on one that never answers; :func:`check_reachable` does the HELLO exchange itself, with a
timeout. Each kind of wrong peer is a real socket on loopback: a refused port, an HTTP
server, a silent listener, a server of another protocol version; a fake server of the right
version passes. (The real ``smcspec rpc-server`` and the CLI's exit are in ``test_rpc.py``.)
"""

from __future__ import annotations

import http.server
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from live_server import free_port

from smcspec.backends.llamacpp.rpc import (
    RPC_CMD_HELLO,
    RPC_CONN_CAPS_SIZE,
    RPC_PROTO_VERSION,
    check_reachable,
)
from smcspec.errors import ConfigError, RpcServerError


@contextmanager
def listener(answer) -> Iterator[str]:
    """A TCP server on loopback whose one thread calls ``answer(conn)`` for each client."""
    sock = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def loop() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            with conn:
                answer(conn)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        sock.close()


def _read_hello(conn: socket.socket) -> bytes:
    data = b""
    conn.settimeout(5)
    while len(data) < 9 + RPC_CONN_CAPS_SIZE:
        chunk = conn.recv(64)
        if not chunk:
            break
        data += chunk
    return data


def rpc_answer(version: tuple[int, int, int]):
    """A peer that reads HELLO and answers as an RPC server of ``version`` would."""

    def answer(conn: socket.socket) -> None:
        hello = _read_hello(conn)
        assert hello[0] == RPC_CMD_HELLO
        assert struct.unpack("<Q", hello[1:9])[0] == RPC_CONN_CAPS_SIZE
        body = bytes([*version, 0]) + bytes(RPC_CONN_CAPS_SIZE)
        conn.sendall(struct.pack("<Q", len(body)) + body)

    return answer


def silent(conn: socket.socket) -> None:
    """Accepts, reads what comes, never answers (until the client hangs up)."""
    conn.settimeout(10)
    try:
        while conn.recv(64):
            pass
    except OSError:
        pass


def test_a_refused_port_is_an_rpc_server_error():
    with pytest.raises(RpcServerError, match="cannot reach the RPC server"):
        check_reachable(f"127.0.0.1:{free_port()}")


def test_an_http_server_is_an_error_within_the_bound():
    """The standard library's HTTP server waits for the end of a request line that HELLO
    never sends: it reads as a silent listener (uvicorn's answers 400 at once: next test)."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        start = time.monotonic()
        with pytest.raises(RpcServerError, match="did not answer"):
            check_reachable(f"127.0.0.1:{httpd.server_address[1]}", timeout_s=1.0)
        assert time.monotonic() - start < 3
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_http_server_that_answers_is_named_as_not_an_rpc_server():
    def http_400(conn: socket.socket) -> None:
        _read_hello(conn)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")

    with listener(http_400) as endpoint:
        with pytest.raises(RpcServerError, match="did not answer as a llama.cpp RPC server"):
            check_reachable(endpoint)


def test_a_silent_listener_times_out_within_the_bound():
    with listener(silent) as endpoint:
        start = time.monotonic()
        with pytest.raises(RpcServerError, match="did not answer the handshake within 1 s"):
            check_reachable(endpoint, timeout_s=1.0)
        assert 0.9 < time.monotonic() - start < 3


def test_a_peer_that_closes_at_once_is_not_an_rpc_server():
    with listener(lambda conn: None) as endpoint:
        with pytest.raises(RpcServerError, match="did not answer as a llama.cpp RPC server"):
            check_reachable(endpoint, timeout_s=2.0)


@pytest.mark.parametrize(
    "version", [(RPC_PROTO_VERSION[0] - 1, 0, 0), (RPC_PROTO_VERSION[0] + 1, 0, 0),
                (RPC_PROTO_VERSION[0], RPC_PROTO_VERSION[1] + 1, 0)],
)  # fmt: skip
def test_another_protocol_version_is_named(version):
    with listener(rpc_answer(version)) as endpoint:
        with pytest.raises(RpcServerError, match="speaks protocol " + ".".join(map(str, version))):
            check_reachable(endpoint)


def test_a_server_of_this_protocol_passes_and_gives_its_version():
    version = (RPC_PROTO_VERSION[0], RPC_PROTO_VERSION[1], RPC_PROTO_VERSION[2] + 3)
    with listener(rpc_answer(version)) as endpoint:
        assert check_reachable(endpoint) == version


def test_rpc_server_errors_exit_with_1_and_are_config_errors():
    assert RpcServerError.exit_code == 1 and issubclass(RpcServerError, ConfigError)
