"""A target spread over llama.cpp RPC servers on loopback (``smcspec rpc-server``, ``--rpc``).

Two real ``smcspec rpc-server`` processes on 127.0.0.1 serve a tiny GGUF target; its logits
through them must equal the local ones, every method must run through them, exact SD must
still match the target's enumerated distribution, and a server killed mid-request must end
the client process (llama.cpp aborts) instead of hanging it; under ``smcspec serve`` its
requests first get errors and the process exits with 1. Needs a llama-cpp-python build
with RPC (``scripts/setup.sh`` builds one); under CI a build without it is an error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from enumerable import chisquare_p, total_variation
from live_server import free_port
from test_statistical_llamacpp import LENGTH, PROMPT, SD_CFG, V, _sample, exact_log_probs
from tiny_models import make_tiny_gguf

from smcspec import ConfigError
from smcspec.decoding import decode_sd

pytest.importorskip("llama_cpp")
from smcspec.backends.llamacpp import LlamaCppModel, LlamaCppSettings  # noqa: E402
from smcspec.backends.llamacpp.rpc import parse_endpoints, supports_rpc  # noqa: E402

pytestmark = pytest.mark.slow  # the slow tier (pyproject.toml); CI runs it

if not supports_rpc():
    if os.environ.get("CI"):
        raise RuntimeError("CI is set but the llama.cpp build has no RPC: setup.sh must build it")
    pytest.skip("this llama.cpp build has no RPC backend", allow_module_level=True)

QUIET = {**os.environ, "GGML_NO_BACKTRACE": "1"}  # ggml's abort would print a gdb backtrace
SETTINGS = LlamaCppSettings(threads=1, kv_cells=1024, kv_type="f32", max_sequences=64, n_batch=256)


def start_rpc_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "smcspec", "rpc-server", "--port", str(port), "--threads", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    endpoint = f"127.0.0.1:{port}"
    deadline = time.time() + 60
    import socket

    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode()) from None
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("rpc-server did not start")


@pytest.fixture(scope="module")
def servers():
    started = [start_rpc_server() for _ in range(2)]
    yield [ep for _, ep in started]
    for proc, _ in started:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def models(tmp_path_factory, servers):
    root = tmp_path_factory.mktemp("rpc")
    target_file = make_tiny_gguf(root, "qwen2", V, seed=1, num_hidden_layers=2)[0]
    draft_file = make_tiny_gguf(root, "qwen2", V, seed=2, num_hidden_layers=1)[0]
    local = LlamaCppModel(target_file, SETTINGS)
    remote = LlamaCppModel(
        target_file, LlamaCppSettings(**{**SETTINGS.__dict__, "gpu_layers": -1,
                                         "rpc_servers": tuple(servers)})
    )  # fmt: skip
    draft = LlamaCppModel(draft_file, SETTINGS)
    yield local, remote, draft, (target_file, draft_file)
    remote.release()  # before the servers stop: freeing it talks to them


def test_endpoints_are_parsed_and_checked():
    assert parse_endpoints("127.0.0.1:1,h:2") == ("127.0.0.1:1", "h:2")
    for bad in ("", "host", ":5", "h:0", "h:70000", "h:x"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            parse_endpoints(bad)


def test_an_unreachable_server_is_a_clear_error_not_an_abort(tmp_path):
    path = make_tiny_gguf(tmp_path, "qwen2", V, seed=1, num_hidden_layers=1)[0]
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match="cannot reach the RPC server"):
        LlamaCppModel(path, LlamaCppSettings(threads=1, gpu_layers=-1, rpc_servers=(dead,)))


def test_logits_through_two_servers_equal_local_logits(models):
    local, remote, _, _ = models
    assert remote.offload and "rpc=" in remote.offload and local.offload is None
    ids = torch.tensor([3, 1, 2, 0, 1])
    rows = torch.tensor([[1, 2, 3], [0, 0, 1], [3, 3, 3]])
    out = []
    for model in (local, remote):
        cache = model.new_cache(3, 8)
        first = model.prefill(ids, cache)
        out.append((first, model.decode(rows, cache)))
    # the same ggml CPU kernels on both sides; llamacpp tests bound logits by 5e-2
    assert torch.allclose(out[0][0], out[1][0], atol=5e-2)
    assert torch.allclose(out[0][1], out[1][1], atol=5e-2)
    assert float((out[0][1] - out[1][1]).abs().max()) < 5e-2


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_every_method_runs_through_rpc(models, method):
    from smcspec.config import GenerationConfig
    from smcspec.decoding import decode_ar, decode_smc

    _, remote, draft, _ = models
    cfg = GenerationConfig(method=method, max_new_tokens=12, particles=4, draft_tokens=3)
    decode = {"ar": decode_ar, "sd": decode_sd, "smc": decode_smc}[method]
    models_ = (remote,) if method == "ar" else (remote, draft)
    out = decode(*models_, PROMPT, cfg, frozenset(), V, torch.Generator().manual_seed(0))
    assert len(out.tokens) >= 12 and all(0 <= t < V for t in out.tokens)


def test_exact_sd_through_rpc_matches_the_local_target(models):
    local, remote, draft, _ = models
    exact = exact_log_probs(local)  # enumerated locally: the RPC target must sample it
    runs = 1000
    counts = _sample(decode_sd, remote, draft, SD_CFG, runs)
    assert sum(counts.values()) == runs and all(len(k) == LENGTH for k in counts)
    # chi-square over the 64 sequences, p-value bound 1e-3; TV at 1000 runs' noise (~0.1)
    assert chisquare_p(exact, counts, runs) > 1e-3
    assert total_variation(exact, counts, runs) < 0.15


def test_a_server_lost_mid_request_ends_the_client_instead_of_hanging(models, tmp_path):
    _, _, _, (target_file, _) = models
    proc, endpoint = start_rpc_server()
    client = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, torch
            from smcspec.backends.llamacpp import LlamaCppModel, LlamaCppSettings
            m = LlamaCppModel({str(target_file)!r}, LlamaCppSettings(
                threads=1, kv_cells=1024, gpu_layers=-1, rpc_servers=({endpoint!r},)))
            print("ready", flush=True)
            while True:
                c = m.new_cache(4, 64)
                m.prefill(torch.tensor([1, 2, 3]), c)
                for _ in range(60):
                    m.decode(torch.tensor([[1], [2], [3], [0]]), c)
                c.close()
        """)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=QUIET,
    )  # fmt: skip
    try:
        assert client.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # decoding through the server
        proc.send_signal(signal.SIGKILL)
        code = client.wait(timeout=60)  # a hang fails here
    finally:
        proc.kill()
        client.kill()
    # llama.cpp's RPC client aborts (GGML_ABORT: SIGABRT) when its server goes away
    assert code == -signal.SIGABRT, (code, client.stderr.read()[-2000:])


def test_serve_with_a_lost_rpc_server_fails_its_requests_then_exits_for_its_supervisor(tmp_path):
    """``smcspec serve --rpc``: when the server is lost mid-request, llama.cpp aborts; the
    abort hook (:mod:`smcspec.server.backend_faults`) first gives the running stream an
    error event and ``[DONE]`` (test_backend_faults.py checks the other shapes: 500, 503,
    ``/health``), then the process exits with status 1 (not a signal), for a supervisor to
    restart it. Nothing hangs."""
    import httpx

    target_file, draft_file = (  # 96 tokens: the end token is rare, the stream runs on
        make_tiny_gguf(tmp_path, "qwen2", 96, seed=s, num_hidden_layers=1)[0] for s in (1, 2)
    )
    proc, endpoint = start_rpc_server()
    port = free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "smcspec", "serve", "--target", str(target_file),
         "--draft", str(draft_file), "--backend", "llamacpp", "--rpc", endpoint,
         "--threads", "1", "--method", "smc", "-N", "4", "-K", "2", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**QUIET, "SMCSPEC_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert serve.poll() is None, serve.stderr.read()[-2000:]
                time.sleep(0.2)
        body = {"prompt": "ab", "max_tokens": 200, "seed": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 3:
                    proc.send_signal(signal.SIGKILL)
        code = serve.wait(timeout=60)  # a hang fails here
    finally:
        proc.kill()
        serve.kill()
    err = serve.stderr.read()[-3000:]
    assert events[-1] == "[DONE]", (events[-3:], err)
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "backend failed" in error["message"], error
    assert "RPC" in error["message"]  # ggml's own reason reaches the client
    assert code == 1, (code, err)
    assert "failed fatally" in err


def test_a_real_rpc_server_passes_the_handshake():
    """A fresh server: llama.cpp's serves one client at a time, and the module's servers are
    held by the ``models`` fixture's target."""
    from smcspec.backends.llamacpp.rpc import RPC_PROTO_VERSION, check_reachable

    proc, endpoint = start_rpc_server()
    try:
        assert check_reachable(endpoint)[:2] == RPC_PROTO_VERSION[:2]
        assert check_reachable(endpoint)[:2] == RPC_PROTO_VERSION[:2]  # it serves the next
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("peer", ["refused", "http", "silent", "version"])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_bad_rpc_address_is_one_error_line_and_exit_1_within_10_s(tmp_path, command, peer):
    """Each wrong peer (nothing listening, a real HTTP server, a listener that never answers,
    an RPC server of another protocol version) ends ``smcspec generate/serve --rpc`` with one
    ``error:`` line and status 1 within 10 s: no SIGABRT, no hang."""
    from live_server import Server as HttpServer
    from test_rpc_handshake import listener, rpc_answer, silent

    from smcspec.backends.llamacpp.rpc import RPC_PROTO_VERSION

    target_file, draft_file = (
        make_tiny_gguf(tmp_path, "qwen2", 96, seed=s, num_hidden_layers=1)[0] for s in (1, 2)
    )
    http = HttpServer(_health_app()) if peer == "http" else None
    answer = silent if peer == "silent" else rpc_answer((RPC_PROTO_VERSION[0] + 1, 0, 0))
    with listener(answer) as fake:
        endpoint = {"refused": f"127.0.0.1:{free_port()}", "silent": fake, "version": fake,
                    "http": f"127.0.0.1:{http.port if http else 0}"}[peer]  # fmt: skip
        args = [sys.executable, "-m", "smcspec", command, "--target", str(target_file),
                "--draft", str(draft_file), "--backend", "llamacpp", "--rpc", endpoint,
                "--threads", "1"]  # fmt: skip
        serve = ["--port", str(free_port())]
        args += serve if command == "serve" else ["ab", "--max-new-tokens", "4"]
        start = time.monotonic()
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=30, env=QUIET)
        finally:
            if http is not None:
                http.stop()
    took = time.monotonic() - start
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert len(lines) == 1 and endpoint in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "backtrace" not in done.stderr.lower()
    assert took < 10, took


def _health_app():
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "ok"}

    return app


@pytest.mark.parametrize("case", ["port-in-use", "foreign-address", "not-an-ipv4-host"])
def test_an_rpc_server_that_cannot_listen_is_one_error_line_and_a_failure(case):
    """``smcspec rpc-server`` on a port another process holds, on an address not this
    machine's, or on a host that is no IPv4 address: one ``error:`` line naming the host and
    a non-zero status (1: the machine; 2: the option), within 30 s. On cb48c1a llama.cpp
    printed "Failed to create server socket" and the command returned 0 (broken variant:
    ``serve_rpc`` without ``listen_address`` and returning normally)."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    host, port, code = {
        "port-in-use": ("127.0.0.1", holder.getsockname()[1], 1),
        "foreign-address": ("192.0.2.1", free_port(), 1),  # TEST-NET-1: never assigned
        "not-an-ipv4-host": ("no-such-host.invalid", free_port(), 2),
    }[case]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "smcspec", "rpc-server", "--host", host, "--port", str(port),
             "--threads", "1"], capture_output=True, text=True, timeout=30, env=QUIET,
        )  # fmt: skip
    finally:
        holder.close()
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert done.returncode == code, (done.returncode, done.stderr[-2000:])
    assert len(lines) == 1 and host in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_an_rpc_server_loop_that_returns_is_an_error(monkeypatch):
    """llama.cpp's server loop returns only when it could not listen or accept (the port
    taken between the check and its own bind): that is an RpcServerError, not a normal
    end (it returned, and the command exited 0)."""
    import socket

    from smcspec.backends.llamacpp import rpc
    from smcspec.errors import RpcServerError

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        monkeypatch.setattr(rpc, "listen_address", lambda host, port: "127.0.0.1")
        with pytest.raises(RpcServerError, match="stopped"):
            rpc.serve_rpc("127.0.0.1", port, 1)


def test_an_rpc_server_on_localhost_serves():
    """``--host localhost``: llama.cpp takes dotted IPv4 addresses only, so the name is
    resolved first (on cb48c1a: "Invalid host address: localhost", exit 0)."""
    from smcspec.backends.llamacpp.rpc import RPC_PROTO_VERSION, check_reachable

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "smcspec", "rpc-server", "--host", "localhost", "--port",
         str(port), "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            try:
                assert check_reachable(f"127.0.0.1:{port}")[0] == RPC_PROTO_VERSION[0]
                break
            except Exception:
                time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert check_reachable(f"127.0.0.1:{port}")[0] == RPC_PROTO_VERSION[0]
    finally:
        proc.kill()
        proc.wait(timeout=10)
