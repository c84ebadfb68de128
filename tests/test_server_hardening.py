"""The server against a hostile client: a corpus of bad or unusual requests.

Every case asserts its status and, for errors, OpenAI's error shape; after every case the
server must still be healthy and serve a normal request. Further tests cover the body-size
limit, API keys, non-streamed disconnects, a worker that dies, and stopping the process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from live_server import Server, free_port
from tiny_models import make_tiny_chat_pair, make_tiny_gguf_chat_engine

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.server import create_app

pytestmark = pytest.mark.slow  # the slow tier (pyproject.toml); CI runs it

MODEL = "tiny"
BIG = 2**70
USER = [{"role": "user", "content": "ab cd"}]


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return make_tiny_chat_pair(tmp_path_factory.mktemp("hardening"), max_position_embeddings=512)


@pytest.fixture(scope="module")
def engine(pair_dirs):
    return Engine(load_hf_dir(pair_dirs[0]), load_hf_dir(pair_dirs[1]))


@pytest.fixture(scope="module")
def server(engine):
    srv = Server(create_app(engine, GenerationConfig(max_new_tokens=8), model_name=MODEL))
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=["torch", "llamacpp"])
def corpus_server(request, server, tmp_path_factory):
    """The corpus runs against both backends (the llamacpp one: the same tiny chat pair as
    GGUF files)."""
    if request.param == "torch":
        yield server
        return
    pytest.importorskip("llama_cpp")
    root = tmp_path_factory.mktemp("hardening-llamacpp")
    engine = make_tiny_gguf_chat_engine(root, max_position_embeddings=512)
    srv = Server(create_app(engine, GenerationConfig(max_new_tokens=8), model_name=MODEL))
    yield srv
    srv.stop()


def completion(**fields) -> dict:
    return {"json": {"model": MODEL, "prompt": "ab cd", "max_tokens": 4, **fields}}


def chat(**fields) -> dict:
    return {"json": {"model": MODEL, "messages": USER, "max_tokens": 4, **fields}}


def raw(body: bytes) -> dict:
    return {"content": body, "headers": {"content-type": "application/json"}}


C, CC = "/v1/completions", "/v1/chat/completions"
DEEP_ARGUMENTS = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"  # json.loads: RecursionError


def assistant_call(arguments: str) -> dict:
    """An assistant message that called tool ``f`` with ``arguments`` (a JSON string)."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


# (id, method, path, httpx arguments, expected status, expected error param)
CASES = [
    # seeds: any JSON integer is mapped into the generator's range; non-integers are 400
    ("seed-2^70", "POST", C, completion(seed=BIG), 200, None),
    ("seed-minus-2^70", "POST", C, completion(seed=-BIG), 200, None),
    ("chat-seed-2^70-stream", "POST", CC, chat(seed=BIG, stream=True), 200, None),
    ("seed-float", "POST", C, completion(seed=1.5), 400, "seed"),
    ("seed-string", "POST", C, completion(seed="abc"), 400, "seed"),
    # text the tokenizer cannot encode
    ("prompt-lone-surrogate", "POST", C, raw(b'{"prompt": "ab \\ud800 cd"}'), 400, None),
    (
        "message-lone-surrogate",
        "POST",
        CC,
        raw(b'{"messages": [{"role": "user", "content": "a \\udfff"}]}'),
        400,
        None,
    ),
    ("body-invalid-utf8", "POST", C, raw(b'{"prompt": "ab \xff\xfe cd"}'), 400, None),
    ("body-not-json", "POST", CC, raw(b"{not json"), 400, None),
    ("body-empty", "POST", C, raw(b""), 400, None),
    ("body-json-array", "POST", C, raw(b"[]"), 400, None),
    ("body-json-null", "POST", C, raw(b"null"), 400, None),
    ("body-deeply-nested", "POST", C, raw(b"[" * 100_000 + b"]" * 100_000), 400, None),
    ("temperature-nan", "POST", C, raw(b'{"prompt": "ab", "temperature": NaN}'), 400, None),
    ("content-type-text", "POST", C, {"content": b'{"prompt": "ab"}'}, 400, None),
    # routing and methods
    ("get-completions", "GET", C, {}, 405, None),
    ("put-chat", "PUT", CC, {}, 405, None),
    ("delete-models", "DELETE", "/v1/models", {}, 405, None),
    ("unknown-route", "POST", "/v1/nope", completion(), 404, None),
    ("unknown-get", "GET", "/nope", {}, 404, None),
    # chat messages
    (
        "role-wizard",
        "POST",
        CC,
        chat(messages=[{"role": "wizard", "content": "hi"}]),
        400,
        "messages.0.role",
    ),  # fmt: skip
    (
        "role-tool-without-id",
        "POST",
        CC,
        chat(messages=[{"role": "tool", "content": "hi"}]),
        400,
        "messages.0",
    ),  # fmt: skip
    (
        "tool-message-without-its-call",
        "POST",
        CC,
        chat(messages=[*USER, {"role": "tool", "tool_call_id": "call_1", "content": "hi"}]),
        400,
        None,
    ),  # fmt: skip
    (
        "assistant-call-arguments-not-json",
        "POST",
        CC,
        chat(messages=[*USER, assistant_call("{oops")]),
        400,
        None,
    ),  # fmt: skip
    (
        "assistant-call-arguments-nested-too-deep",
        "POST",
        CC,
        chat(messages=[*USER, assistant_call(DEEP_ARGUMENTS)]),
        400,
        None,
    ),  # fmt: skip
    (
        "role-developer",
        "POST",
        CC,
        chat(messages=[{"role": "developer", "content": "hi"}, *USER]),
        200,
        None,
    ),  # fmt: skip
    (
        "content-text-parts",
        "POST",
        CC,
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}],
                }
            ]
        ),
        200,
        None,
    ),  # fmt: skip
    (
        "content-image-part",
        "POST",
        CC,
        chat(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        ),
        400,
        None,
    ),  # fmt: skip
    ("content-null", "POST", CC, chat(messages=[{"role": "user", "content": None}]), 400, None),
    ("content-missing", "POST", CC, chat(messages=[{"role": "user"}]), 400, None),
    ("messages-empty", "POST", CC, chat(messages=[]), 400, "messages"),
    ("messages-missing", "POST", CC, {"json": {"model": MODEL}}, 400, "messages"),
    # sampling parameters: implemented, or refused; never silently ignored
    ("top-p-0.9-smc", "POST", C, completion(top_p=0.9), 200, None),
    ("top-k-5-sd", "POST", C, completion(top_k=5, smc={"method": "sd"}), 200, None),
    ("min-p-0.1-ar", "POST", CC, chat(min_p=0.1, smc={"method": "ar"}), 200, None),
    ("top-p-zero", "POST", C, completion(top_p=0), 400, None),
    ("top-p-1.5", "POST", C, completion(top_p=1.5), 400, None),
    ("top-k-minus-5", "POST", C, completion(top_k=-5), 400, None),
    ("top-k-float", "POST", C, completion(top_k=2.5), 400, "top_k"),
    ("min-p-2", "POST", C, completion(min_p=2), 400, None),
    ("logprobs-chat", "POST", CC, chat(logprobs=True, top_logprobs=2), 200, None),
    ("logprobs-completion", "POST", C, completion(logprobs=3), 200, None),
    ("top-logprobs-21", "POST", CC, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top-logprobs-alone", "POST", CC, chat(top_logprobs=2), 400, "top_logprobs"),
    ("logprobs-completion-21", "POST", C, completion(logprobs=21), 400, "logprobs"),
    ("presence-penalty", "POST", C, completion(presence_penalty=0.5), 400, "presence_penalty"),
    ("frequency-penalty-zero", "POST", C, completion(frequency_penalty=0), 200, None),
    ("logit-bias", "POST", C, completion(logit_bias={"1": 5}), 400, "logit_bias"),
    (  # the tiny models' template does not render tools: a clear 400
        "tools-template-without-tools",
        "POST",
        CC,
        chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        None,
    ),  # fmt: skip
    (
        "tools-on-completions",
        "POST",
        C,
        completion(tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        "tools",
    ),  # fmt: skip
    ("tool-choice-required-no-tools", "POST", CC, chat(tool_choice="required"), 400, None),
    ("tool-choice-none-no-tools", "POST", CC, chat(tool_choice="none"), 200, None),
    (
        "tool-choice-unknown-function",
        "POST",
        CC,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        None,
    ),  # fmt: skip
    (
        "tool-bad-schema",
        "POST",
        CC,
        chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "str"}}}]
        ),
        400,
        None,
    ),  # fmt: skip
    (
        "tool-bad-name",
        "POST",
        CC,
        chat(tools=[{"type": "function", "function": {"name": "no spaces"}}]),
        400,
        None,
    ),  # fmt: skip
    ("echo", "POST", C, completion(echo=True), 200, None),
    ("echo-logprobs", "POST", C, completion(echo=True, logprobs=1, max_tokens=1), 200, None),
    ("prompt-mixed", "POST", C, completion(prompt=["ab", [1, 2]]), 400, "prompt"),
    ("prompt-token-lists", "POST", C, completion(prompt=[[1, 2], [3]], max_tokens=2), 200, None),
    ("best-of", "POST", C, completion(best_of=3), 400, "best_of"),
    ("suffix", "POST", C, completion(suffix="x"), 400, "suffix"),
    # numbers out of range or of the wrong type
    ("max-tokens-negative", "POST", C, completion(max_tokens=-1), 400, None),
    ("max-tokens-string", "POST", C, completion(max_tokens="ten"), 400, "max_tokens"),
    ("max-tokens-over-context", "POST", C, completion(max_tokens=10**9), 400, None),
    ("temperature-negative", "POST", C, completion(temperature=-1), 400, None),
    ("temperature-string", "POST", C, completion(temperature="hot"), 400, "temperature"),
    ("n-zero", "POST", C, completion(n=0), 400, "n"),
    ("n-99", "POST", C, completion(n=99), 400, "n"),
    ("stop-int", "POST", C, completion(stop=5), 400, None),
    ("stream-int", "POST", C, completion(stream=5), 400, "stream"),
    ("smc-list", "POST", C, completion(smc=[1]), 400, "smc"),
    ("smc-unknown-field", "POST", C, completion(smc={"foo": 1}), 400, "smc.foo"),
    ("smc-method-beam", "POST", C, completion(smc={"method": "beam"}), 400, "smc.method"),
    ("smc-particles-1e6", "POST", C, completion(smc={"particles": 10**6}), 400, None),
    ("smc-alpha-zero", "POST", C, completion(smc={"alpha": 0}), 400, None),
    ("smc-kappa-2", "POST", C, completion(smc={"ess_threshold": 2}), 400, None),
    ("model-unknown", "POST", C, completion(model="gpt-4"), 400, "model"),
    # prompts
    ("prompt-ids-out-of-vocab", "POST", C, completion(prompt=[999_999]), 400, None),
    ("prompt-ids-negative", "POST", C, completion(prompt=[-1]), 400, None),
    ("prompt-ids-empty", "POST", C, completion(prompt=[]), 400, None),
    ("prompt-one-token-list", "POST", C, completion(prompt=[[1, 2]], max_tokens=2), 200, None),
    ("prompt-nested", "POST", C, completion(prompt=[[[1, 2]]]), 400, "prompt"),
    ("prompt-over-context", "POST", C, completion(prompt=list(range(1, 90)) * 10), 400, None),
    ("prompt-missing", "POST", C, {"json": {"model": MODEL}}, 400, "prompt"),
    ("prompt-empty", "POST", C, completion(prompt=""), 400, "prompt"),
    # unusual but valid
    (
        "authorization-without-key",
        "POST",
        C,
        {**completion(), "headers": {"Authorization": "Bearer whatever"}},
        200,
        None,
    ),  # fmt: skip
    ("max-tokens-1-n-3", "POST", C, completion(max_tokens=1, n=3), 200, None),
    (
        "usage-without-stream",
        "POST",
        C,
        completion(stream_options={"include_usage": True}),
        200,
        None,
    ),  # fmt: skip
]


def assert_error_shape(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    return err


def assert_still_serving(server: Server) -> None:
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    ok = httpx.post(server.url(C), timeout=60, **completion(max_tokens=2))
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1


# errors whose message must say what is wrong in the client's terms (issue: a form body
# got "Input should be a valid dictionary", an image part "content.str: ... valid string")
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
CLEAR_MESSAGES = [
    ("form-body", C, {"content": b"prompt=ab&max_tokens=4",
                      "headers": {"content-type": "application/x-www-form-urlencoded"}},
     "Content-Type: application/json"),  # what `curl -d` sends
    ("text-plain-body", C, {"content": b'{"prompt": "ab"}',
                            "headers": {"content-type": "text/plain"}},
     "Content-Type: application/json"),
    ("json-array-body", C, raw(b"[1, 2]"), "must be a JSON object"),
    ("image-part", CC, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, IMAGE]}]),
     "image inputs ('image_url' content parts) are not supported by this model"),
    ("audio-part", CC, chat(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]),
     "audio inputs"),
    ("unknown-part", CC, chat(messages=[{"role": "user", "content": [{"type": "video"}]}]),
     "content parts must be {'type': 'text'"),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, path, kwargs, says", CLEAR_MESSAGES, ids=[c[0] for c in CLEAR_MESSAGES]
)
def test_errors_say_what_is_wrong_in_the_clients_terms(server, name, path, kwargs, says):
    r = httpx.post(server.url(path), timeout=30, **kwargs)
    assert r.status_code == 400
    message = assert_error_shape(r)["message"]
    assert says in message, message
    assert "valid dictionary" not in message and "valid string" not in message
    assert "Value error" not in message


def test_the_corpus_has_at_least_40_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("name, method, path, kwargs, status, param", CASES,
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_bad_or_unusual_request(corpus_server, name, method, path, kwargs, status, param):
    server = corpus_server
    r = httpx.request(method, server.url(path), timeout=60, **kwargs)
    assert r.status_code == status, r.text
    if status >= 400:
        err = assert_error_shape(r)
        if param is not None:
            assert err["param"] == param, err
    elif "stream" in kwargs.get("json", {}):
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"]
    assert_still_serving(server)


def _raw_http(port: int, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """Send ``head`` and ``body`` on a plain socket; the status and JSON body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        header, rest = data.split(b"\r\n\r\n", 1)
        lines = header.decode().split("\r\n")
        fields = dict(line.split(": ", 1) for line in lines[1:])
        length = int(fields.get("content-length", 0))
        while len(rest) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
    return int(lines[0].split()[1]), json.loads(rest[:length])


def test_a_50_mb_body_gets_413_before_it_is_sent(server):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 50000000\r\n\r\n"
    )
    t0 = time.perf_counter()
    status, body = _raw_http(server.port, head, b'{"prompt": "')  # the rest is never sent
    assert status == 413 and "larger than the limit" in body["error"]["message"]
    assert time.perf_counter() - t0 < 5
    assert_still_serving(server)


def test_a_chunked_body_over_the_limit_gets_413(engine):
    srv = Server(create_app(engine, model_name=MODEL, max_request_bytes=2048))
    try:
        payload = json.dumps({"model": MODEL, "prompt": "ab " * 2000}).encode()
        chunks = b"".join(
            b"%x\r\n%s\r\n" % (len(payload[i : i + 1000]), payload[i : i + 1000])
            for i in range(0, len(payload), 1000)
        )
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        status, body = _raw_http(srv.port, head, chunks + b"0\r\n\r\n")
        assert status == 413 and body["error"]["type"] == "invalid_request_error"
        small = httpx.post(srv.url(C), timeout=60, **completion(max_tokens=2))
        assert small.status_code == 200
    finally:
        srv.stop()


def test_api_key(engine):
    key = "sk-test-123"
    srv = Server(create_app(engine, model_name=MODEL, api_key=key), api_key=key)
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            r = httpx.post(srv.url(C), headers=headers, timeout=30, **completion())
            assert r.status_code == 401
            assert assert_error_shape(r)["code"] == "invalid_api_key"
        assert httpx.get(srv.url("/v1/models")).status_code == 401
        assert httpx.get(srv.url("/metrics")).status_code == 401
        assert httpx.get(srv.url("/health")).status_code == 200  # open for probes
        for bad in (f"Bearer {key.upper()}", f"Basic {key}", f"Bearer{key}", f"{key} Bearer"):
            r = httpx.post(srv.url(C), headers={"Authorization": bad}, timeout=30, **completion())
            assert r.status_code == 401, bad
        # the scheme name is case-insensitive (RFC 7235 section 2.1); the key is not
        for scheme in ("bearer", "BEARER", "Bearer", "bEaReR"):
            headers = {"Authorization": f"{scheme} {key}"}
            r = httpx.post(srv.url(C), headers=headers, timeout=30, **completion(max_tokens=2))
            assert r.status_code == 200, scheme
        r = srv.client().completions.create(model=MODEL, prompt="ab", max_tokens=2)
        assert r.usage.completion_tokens >= 1
        assert srv.metrics()["smcspec_generation_tokens_total"] >= 1
    finally:
        srv.stop()
    srv = Server(create_app(engine, model_name=MODEL, api_key=key, public_metrics=True))
    try:
        assert httpx.get(srv.url("/metrics")).status_code == 200
        assert httpx.get(srv.url("/v1/models")).status_code == 401
    finally:
        srv.stop()


def _slowed(engine, monkeypatch, seconds: float) -> None:
    """Every forward of every request takes ``seconds`` longer (a slow model), so a request
    of many rounds is still decoding when its client gives up."""
    real = engine.program

    def slow(job):
        program = real(job)
        try:
            step = next(program)
            while True:
                time.sleep(seconds)
                step = program.send((yield step))
        except StopIteration as done:
            return done.value
        finally:
            program.close()

    monkeypatch.setattr(engine, "program", slow)


def test_a_non_streamed_request_whose_client_leaves_is_cancelled(server, engine, monkeypatch):
    before = server.metrics()
    _slowed(engine, monkeypatch, 0.1)  # 16 particles x 400 tokens: many 0.5 s rounds
    body = completion(max_tokens=400, smc={"particles": 16, "draft_tokens": 4})
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s and hangs up
        httpx.post(server.url(C), timeout=httpx.Timeout(30, read=1.0), **body)
    monkeypatch.undo()
    deadline = time.time() + 10
    key = 'smcspec_requests_total{"method": "smc", "outcome": "cancelled"}'
    while time.time() < deadline:
        m = server.metrics()
        if m["smcspec_running_requests"] == 0 and m.get(key, 0) > before.get(key, 0):
            break
        time.sleep(0.05)
    assert m["smcspec_running_requests"] == 0
    assert m.get(key, 0) == before.get(key, 0) + 1
    success = 'smcspec_requests_total{"method": "smc", "outcome": "success"}'
    assert m.get(success, 0) == before.get(success, 0)  # not counted as a success
    assert_still_serving(server)


def test_a_dead_worker_makes_health_503_and_calls_on_fatal(engine):
    app = create_app(engine, model_name=MODEL)
    scheduler = app.state.scheduler
    died = threading.Event()
    scheduler.on_fatal = lambda exc: died.set()

    def broken_step():
        raise AssertionError("a scheduler bug")

    scheduler.step = broken_step
    srv = Server(app)
    try:
        r = httpx.post(srv.url(C), timeout=30, **completion())
        assert r.status_code == 500 and "worker failed" in assert_error_shape(r)["message"]
        assert died.wait(5)
        assert httpx.get(srv.url("/health")).status_code == 503
        r = httpx.post(srv.url(C), timeout=30, **completion())
        assert r.status_code == 503 and assert_error_shape(r)["type"] == "service_unavailable_error"
    finally:
        srv.stop()


# ------------------------------------------------------------------ the server process
def _serve(pair_dirs, *extra: str, script: str | None = None) -> tuple[subprocess.Popen, int]:
    """``smcspec serve`` of the tiny pair in a child process, once ``/health`` answers.

    smc with N and K given (the setting these tests' requests ask for), so that the child
    starts without measuring the pair's costs: the small tuning grid is this process's
    (tests/conftest.py), the child's tuner would measure the full one. Serve's start-up
    choice is tested in test_tuning.py."""
    port = free_port()
    args = ["serve", "--target", str(pair_dirs[0]), "--draft", str(pair_dirs[1]),
            "--port", str(port), "-N", "16", "-K", "4", *extra]  # fmt: skip
    code = script or "import sys; from smcspec.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read().decode()
    proc.kill()
    raise RuntimeError("server process did not start")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_stream_stops_the_process_within_10_s(pair_dirs, sig):
    proc, port = _serve(pair_dirs, "--shutdown-timeout", "2")
    got_token = threading.Event()

    def stream() -> None:
        body = {"model": None, "prompt": "ab", "max_tokens": 400, "stream": True,
                "smc": {"particles": 16, "draft_tokens": 4}}  # fmt: skip
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}{C}", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if '"text"' in line:
                        got_token.set()
        except httpx.HTTPError:
            pass

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    try:
        assert got_token.wait(60)
        t0 = time.perf_counter()
        proc.send_signal(sig)
        code = proc.wait(timeout=10)
        assert time.perf_counter() - t0 < 10
        # uvicorn shuts down, then re-raises the signal: killed by it (SIGTERM), or the
        # CLI's KeyboardInterrupt exit (SIGINT)
        assert code in (0, -sig, 128 + sig), proc.stderr.read().decode()[-2000:]
        client.join(10)
        assert not client.is_alive()  # the stream ended too
    finally:
        proc.kill()


def test_a_dead_worker_makes_the_process_exit_non_zero(pair_dirs):
    script = (
        "import sys\n"
        "from smcspec.scheduler import BatchScheduler\n"
        "def broken(self):\n"
        "    raise AssertionError('a scheduler bug')\n"
        "BatchScheduler.step = broken\n"
        "from smcspec.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    proc, port = _serve(pair_dirs, script=script)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}{C}", json={"prompt": "ab"}, timeout=30)
        assert r.status_code == 500
        t0 = time.perf_counter()
        code = proc.wait(timeout=10)
        assert code == 1 and time.perf_counter() - t0 < 10
        assert "worker died" in proc.stderr.read().decode()
    finally:
        proc.kill()


def test_a_short_request_in_flight_finishes_during_the_shutdown_grace(pair_dirs):
    """SIGTERM while a short stream is running: with --shutdown-timeout 30 it still gets every
    token and its [DONE], and only then does the process exit."""
    proc, port = _serve(pair_dirs, "--shutdown-timeout", "30")
    got_token, lines = threading.Event(), []

    def stream() -> None:
        body = {"model": None, "prompt": "ab", "max_tokens": 150, "stream": True, "seed": 3,
                "stream_options": {"include_usage": True},
                "smc": {"particles": 16, "draft_tokens": 4}}  # fmt: skip
        with httpx.stream("POST", f"http://127.0.0.1:{port}{C}", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append((time.perf_counter(), line))
                if '"text"' in line:
                    got_token.set()

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    try:
        assert got_token.wait(60)
        signalled = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        client.join(30)
        assert not client.is_alive()
        done_at, last = lines[-1]
        assert last == "data: [DONE]", lines[-3:]
        assert done_at > signalled  # it was still running when the signal came
        text = [x for _, x in lines]
        usage = [json.loads(x[6:]) for x in text if x.startswith("data: {") and '"usage"' in x]
        assert usage and usage[-1]["usage"]["completion_tokens"] >= 1
        assert all("error" not in x for x in text)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
    finally:
        proc.kill()
