"""Shared pools under load: what a request takes is reserved on admission and always given
back (success, error, cancel, disconnect), on both backends; a request that can never fit is
a 400, one that does not fit now waits; a leaked pool turns ``/health`` to 503.

The pools are made small (one SMC-SD request of 8 particles at a time) so that a burst of
such requests is more than they hold. Loopback only, every loop bounded.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import Server
from tiny_models import make_tiny_chat_pair, make_tiny_gguf_chat_engine

from smcspec import Engine, GenerationConfig
from smcspec.backends.pool import pool_needs
from smcspec.backends.torch import load_hf_dir
from smcspec.scheduler import PoolLeakError
from smcspec.server import create_app

MODEL = "tiny"
SMC8 = {"method": "smc", "particles": 8, "draft_tokens": 2}


def _engine(backend: str, root) -> Engine:
    if backend == "llamacpp":
        pytest.importorskip("llama_cpp")
        from smcspec.backends.llamacpp import LlamaCppSettings

        # 16 sequences: one request of 8 particles (8 + a spare) at a time; 16 is never enough
        settings = LlamaCppSettings(threads=1, kv_cells=8192, max_sequences=16, n_batch=512)
        return make_tiny_gguf_chat_engine(root, llamacpp=settings, max_position_embeddings=4096)
    dirs = make_tiny_chat_pair(root, max_position_embeddings=4096)
    engine = Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))
    # KV bytes for one request of 8 particles and 48 tokens (and a bit), on both models
    job = engine.prepare("ab cd ef", GenerationConfig(max_new_tokens=48, **SMC8), chat=True)
    needs = pool_needs(engine.models(), engine.cache_needs(job))
    for role, model in engine.models().items():
        model.kv_budget_bytes = int(needs[role]["kv_bytes"] * 1.5)
    return engine


@pytest.fixture(scope="module", params=["torch", "llamacpp"])
def engine(request, tmp_path_factory):
    return _engine(request.param, tmp_path_factory.mktemp(f"pools-{request.param}"))


def _chat(**fields) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ab cd ef"}]}
    return {**body, "max_tokens": 12, **fields}


def _pools_full(server: Server) -> bool:
    m = server.metrics()
    caps = {
        k.replace("smcspec_pool_capacity", ""): v
        for k, v in m.items()
        if k.startswith("smcspec_pool_capacity")
    }
    assert caps, "no pool metrics"
    return all(m["smcspec_pool_free" + k] == v for k, v in caps.items())


def _settled(server: Server, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = server.metrics()
        if m["smcspec_running_requests"] == 0 and m["smcspec_waiting_requests"] == 0:
            if _pools_full(server):
                return
        time.sleep(0.1)
    raise AssertionError(f"the server did not settle: {server.metrics()}")


def _send(server: Server, kind: str) -> int | str:
    url = server.url("/v1/chat/completions")
    if kind == "ok":
        return httpx.post(url, json=_chat(smc=SMC8), timeout=120).status_code
    if kind == "ar":
        return httpx.post(url, json=_chat(smc={"method": "ar"}), timeout=120).status_code
    if kind == "never-fits":
        big = {**SMC8, "particles": 64}
        return httpx.post(url, json=_chat(smc=big, max_tokens=4000), timeout=120).status_code
    if kind == "disconnect":  # the client gives up while the request waits or decodes
        try:
            return httpx.post(url, json=_chat(smc=SMC8, max_tokens=48), timeout=0.3).status_code
        except httpx.TimeoutException:
            return "gone"
    if kind == "stream-cancel":  # reads one event, then closes the stream
        body = _chat(smc=SMC8, max_tokens=48, stream=True)
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            for _ in r.iter_lines():
                break
            return r.status_code
    raise ValueError(kind)


def test_a_burst_larger_than_the_pools_never_breaks_the_server(engine):
    server = Server(create_app(engine, GenerationConfig(max_new_tokens=12), model_name=MODEL))
    try:
        kinds = ["ok", "disconnect", "ok", "stream-cancel", "never-fits", "ok", "disconnect",
                 "ar", "stream-cancel", "ok", "ok", "never-fits"]  # fmt: skip
        with ThreadPoolExecutor(len(kinds)) as pool:
            codes = list(pool.map(lambda k: _send(server, k), kinds))
        by_kind = dict(zip(kinds, codes, strict=True))
        assert 500 not in codes, codes
        assert by_kind["never-fits"] == 400
        assert [c for k, c in zip(kinds, codes, strict=True) if k in ("ok", "ar")] == [200] * 6
        _settled(server)  # every pool back to full, nothing running or waiting
        assert httpx.get(server.url("/health")).status_code == 200
        again = httpx.post(server.url("/v1/chat/completions"), json=_chat(smc=SMC8), timeout=120)
        assert again.status_code == 200
        m = server.metrics()
        assert m['smcspec_pool_leases{"model": "target"}'] == 0
    finally:
        server.stop()


def test_a_request_that_can_never_fit_is_a_400_naming_the_pool(engine):
    server = Server(create_app(engine, GenerationConfig(max_new_tokens=12), model_name=MODEL))
    try:
        r = httpx.post(
            server.url("/v1/chat/completions"),
            json=_chat(smc={**SMC8, "particles": 64}, max_tokens=4000),
            timeout=30,
        )
        assert r.status_code == 400
        assert "can never fit" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_a_leaked_pool_turns_health_to_503(engine):
    """A lease of the server's that nobody releases while nothing runs (a bug) is found within
    the grace; a lease of someone else sharing the engine only makes requests wait."""
    app = create_app(engine, GenerationConfig(max_new_tokens=8), model_name=MODEL,
                     leak_grace_s=0.5)  # fmt: skip
    server = Server(app)
    pool = engine.target.model.pool
    other = pool.try_reserve(pool.free())  # someone else's: not a leak of this server
    try:
        time.sleep(1.5)
        assert httpx.get(server.url("/health")).status_code == 200
    finally:
        other.release()
    stolen = pool.try_reserve(pool.free(), owner=app.state.scheduler)  # lost by the server
    try:
        deadline = time.time() + 30
        while time.time() < deadline and httpx.get(server.url("/health")).status_code == 200:
            time.sleep(0.1)
        assert httpx.get(server.url("/health")).status_code == 503
        assert isinstance(app.state.scheduler.error, PoolLeakError)
        r = httpx.post(server.url("/v1/chat/completions"), json=_chat(), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    finally:
        stolen.release()
        server.stop()


def test_requests_that_together_exceed_the_kv_cells_take_turns(tmp_path_factory):
    """llama.cpp's KV cells are one pool shared by every request: five requests of 150
    tokens need about 5 x 160 cells of 400, so at most two run at once and the rest wait;
    none fails (before reservations, the forward that filled the cells failed every request
    in it)."""
    pytest.importorskip("llama_cpp")
    from smcspec.backends.llamacpp import LlamaCppSettings

    root = tmp_path_factory.mktemp("cells")
    settings = LlamaCppSettings(threads=1, kv_cells=400, max_sequences=16, n_batch=512)
    engine = make_tiny_gguf_chat_engine(root, llamacpp=settings, max_position_embeddings=4096)
    server = Server(create_app(engine, GenerationConfig(max_new_tokens=150), model_name=MODEL))
    try:
        body = {"model": MODEL, "prompt": "ab cd", "max_tokens": 150, "smc": {"method": "ar"}}
        url = server.url("/v1/completions")
        with ThreadPoolExecutor(5) as pool:
            replies = list(pool.map(lambda i: httpx.post(url, json={**body, "seed": i},
                                                         timeout=120), range(5)))  # fmt: skip
        assert [r.status_code for r in replies] == [200] * 5, [r.text for r in replies]
        # each reserves 150 tokens' cells whether or not it ends early (batch-dependent)
        assert all(r.json()["usage"]["completion_tokens"] >= 1 for r in replies)
        assert server.metrics()["smcspec_max_batch_requests"] <= 2
        _settled(server)
    finally:
        server.stop()


@pytest.mark.parametrize("method", ["ar", "smc"])
def test_a_non_streamed_client_that_leaves_while_tokens_flow_is_cancelled(engine, monkeypatch,
                                                                         method):  # fmt: skip
    """ar: tokens arrive more often than the disconnect poll (every forward takes 20 ms more,
    about 6 s in all): the request must still be cancelled within 5 s of its client leaving
    (it once ran to the end, held its pools and counted as a success), its pools be full
    again, and a fresh request succeed. smc: the same with 50 ms forwards (about 2 s)."""
    from test_server_hardening import _slowed

    defaults = GenerationConfig(max_new_tokens=12, ignore_eos=True)  # runs its whole budget
    server = Server(create_app(engine, defaults, model_name=MODEL))
    try:
        before = server.metrics()
        _slowed(engine, monkeypatch, 0.02 if method == "ar" else 0.05)
        smc = {"method": "ar"} if method == "ar" else {**SMC8, "particles": 4}
        body = _chat(smc=smc, max_tokens=300 if method == "ar" else 40)
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s and hangs up
            httpx.post(server.url("/v1/chat/completions"), json=body,
                       timeout=httpx.Timeout(30, read=1.0))  # fmt: skip
        left = time.monotonic()
        cancelled = f'smcspec_requests_total{{"method": "{method}", "outcome": "cancelled"}}'
        success = f'smcspec_requests_total{{"method": "{method}", "outcome": "success"}}'
        while time.monotonic() - left < 5:
            m = server.metrics()
            if m.get(cancelled, 0) > before.get(cancelled, 0) and _pools_full(server):
                break
            time.sleep(0.05)
        m = server.metrics()
        assert m.get(cancelled, 0) == before.get(cancelled, 0) + 1, "not cancelled within 5 s"
        assert m.get(success, 0) == before.get(success, 0)
        assert m["smcspec_running_requests"] == 0 and _pools_full(server)
        monkeypatch.undo()
        again = httpx.post(server.url("/v1/chat/completions"), json=_chat(smc=SMC8), timeout=60)
        assert again.status_code == 200
        _settled(server)
    finally:
        monkeypatch.undo()
        server.stop()
