"""A backend that fails fatally: llama.cpp's abort hook and what the server then answers.

- :func:`smcspec.backends.llamacpp.faults.on_abort` is checked against ggml's real
  ``ggml_abort`` in child processes: the handler runs first with the short message, its own
  exit status wins, an exception in it still ends in SIGABRT, and leaving the block restores
  ggml's default (message on stderr, SIGABRT); the CLI prints it as one ``error:`` line.
- :meth:`BatchScheduler.abandon`, called from inside a forward as the hook does, gives the
  running stream an error event and ``[DONE]``, the queued request a 500 in the one error
  shape, later requests 503, and turns ``/health`` to 503.

The whole path through a real lost RPC server under ``smcspec serve`` is in test_rpc.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import Server
from tiny_models import make_tiny_chat_pair

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.errors import BackendFailure
from smcspec.server import create_app

QUIET = {**os.environ, "GGML_NO_BACKTRACE": "1"}
SCRIPT = """
import ctypes, os
from smcspec.backends.llamacpp.faults import on_abort
from smcspec.backends.llamacpp.rpc import ggml_library

lib = ggml_library()
def handler(message):
    print("handler:", message, flush=True)
    {action}
def fail():
    lib.ggml_abort(b"/a/dir/x.c", 12, b"boom %d", ctypes.c_int(7))
with on_abort(handler):
    {inside}
{after}
"""


def _run(action: str, inside: str, after: str = "pass") -> subprocess.CompletedProcess:
    pytest.importorskip("llama_cpp")
    code = SCRIPT.format(action=action, inside=inside, after=after)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=QUIET, timeout=120)  # fmt: skip


def test_the_abort_handler_runs_first_and_its_exit_status_wins():
    out = _run("os._exit(7)", "fail()")
    assert out.returncode == 7, out.stderr[-2000:]
    assert out.stdout.strip() == "handler: x.c:12: boom 7"


def test_a_failing_handler_still_ends_in_sigabrt_and_is_logged():
    out = _run("raise RuntimeError('broken handler')", "fail()")
    assert out.returncode == -signal.SIGABRT
    assert "handler: x.c:12: boom 7" in out.stdout
    assert "broken handler" in out.stderr and "x.c:12: boom 7" in out.stderr


def test_leaving_the_block_restores_ggmls_own_abort():
    out = _run("os._exit(7)", "pass", after="fail()")
    assert out.returncode == -signal.SIGABRT
    assert "handler" not in out.stdout
    assert "/a/dir/x.c:12: boom 7" in out.stderr  # ggml's default print


def test_the_cli_turns_an_abort_into_one_error_line():
    """generate, bench and eval run inside ``llamacpp_aborts_as_errors``: ggml's abort
    becomes ``error: ...`` and exit status 1, like every other CLI error."""
    pytest.importorskip("llama_cpp")
    code = (
        "import ctypes\n"
        "from smcspec.cli import llamacpp_aborts_as_errors\n"
        "from smcspec.backends.llamacpp.rpc import ggml_library\n"
        "with llamacpp_aborts_as_errors():\n"
        "    ggml_library().ggml_abort(b'/src/ggml-rpc.cpp', 9, b'Remote RPC server crashed')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=QUIET, timeout=120)  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]
    line = "error: the model's backend failed: ggml-rpc.cpp:9: Remote RPC server crashed"
    assert out.stderr.strip() == line


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    dirs = make_tiny_chat_pair(tmp_path_factory.mktemp("faults"), max_position_embeddings=4096)
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))


def _chat(**fields) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "ab cd"}]}
    return {**body, "max_tokens": 3000, "smc": {"method": "ar"}, "seed": 0, **fields}


def test_a_fatal_backend_failure_fails_every_request_and_turns_health_503(engine):
    defaults = GenerationConfig(max_new_tokens=16, ignore_eos=True)  # runs until the fault
    app = create_app(engine, defaults, model_name="tiny", max_running=1)
    scheduler = app.state.scheduler
    armed, failed = threading.Event(), threading.Event()
    decode_batch = engine.target.model.decode_batch

    def failing_forward(items):  # what llama.cpp's abort hook does, on the worker's thread
        time.sleep(0.005)  # the stream stays running while the test arms the fault
        if armed.is_set() and not failed.is_set():
            failed.set()
            scheduler.abandon(BackendFailure("the model's backend failed: x.c:1: lost"))
            scheduler.stopping.wait(30)  # the real hook exits the process here
            raise BackendFailure("stopped")
        return decode_batch(items)

    engine.target.model.decode_batch = failing_forward
    server = Server(app)
    try:
        with ThreadPoolExecutor(1) as pool:
            with httpx.stream("POST", server.url("/v1/chat/completions"),
                              json=_chat(stream=True), timeout=60) as stream:  # fmt: skip
                lines = stream.iter_lines()
                assert stream.status_code == 200
                assert next(lines).startswith("data: ")  # running
                queued = pool.submit(httpx.post, server.url("/v1/chat/completions"),
                                     json=_chat(), timeout=60)  # fmt: skip
                deadline = time.time() + 30
                while server.metrics()["smcspec_waiting_requests"] < 1:
                    assert time.time() < deadline, "the second request was never queued"
                    time.sleep(0.02)
                armed.set()
                events = [line[6:] for line in lines if line.startswith("data: ")]
            r = queued.result()
        assert failed.is_set()
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "backend failed" in error["message"]
        assert r.status_code == 500 and "backend failed" in r.json()["error"]["message"]
        assert httpx.get(server.url("/health")).status_code == 503
        later = httpx.post(server.url("/v1/chat/completions"), json=_chat(), timeout=30)
        assert later.status_code == 503
        assert later.json()["error"]["type"] == "service_unavailable_error"
    finally:
        server.stop()
        engine.target.model.decode_batch = decode_batch
