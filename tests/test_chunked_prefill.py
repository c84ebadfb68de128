"""Chunked prefill (:mod:`smcspec.chunked_prefill`): a long prompt runs in chunks,
each a scheduler step, so that other requests advance between them and a request whose
client left is dropped within the server's promised 5 s whatever its prompt's length.

Both backends' chunked prefills equal their whole-prompt prefills (the logits after the
prompt and of a forward after it, for one row and for particles sharing the prefix), the
decoders' outputs for a seed are unchanged by chunking, and a real server with a slow model
lets go of a long prompt whose client disconnected while a short request sent meanwhile
finishes.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from live_server import Server
from scheduling import run_concurrently
from test_server_pools import _pools_full, _settled
from tiny_models import make_tiny_chat_pair, make_tiny_gguf, make_tiny_gguf_chat_engine

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.chunked_prefill import ChunkedPrefill
from smcspec.decoding.program import Prefill, prefill_chunk
from smcspec.scheduler import BatchScheduler, Request
from smcspec.server import create_app

P = 300  # prompt tokens
PROMPT = torch.randint(0, 95, (P,), generator=torch.Generator().manual_seed(0))
NEXT = torch.randint(0, 95, (4, 5), generator=torch.Generator().manual_seed(1))
# chunkings of the prompt: single tokens, odd sizes, over llama.cpp's n_batch (64 below)
CHUNKINGS = {"ones-first": [1] * 5 + [P - 5], "thirteens": [13] * 23 + [1],
             "n_batch+36": [100] * 3}  # fmt: skip
# max |logit difference| of a chunked prefill from the whole one, measured on these tiny
# models (logits up to ~30): torch float32 2.9e-5; llama.cpp (f32 KV) 2.3e-2, as its own
# recomputations differ (it rounds some CPU steps to 16 bits, and other batch shapes take
# other kernels: tests/test_backend_llamacpp.py's ATOL_SAME)
TORCH_ATOL, LLAMACPP_ATOL = 1e-4, 5e-2


def _prefill_then_decode(model, cache, chunks: list[int] | None):
    """The prompt's logits (whole, or chunk by chunk) and those of 5 tokens decoded after
    it on every row of ``cache``."""
    if chunks is None:
        first = model.prefill(PROMPT, cache)
    else:
        at = 0
        for size in chunks:
            first = model.prefill(PROMPT, cache, at, at + size)
            assert (first is None) == (at + size < P)
            at += size
    return first.clone(), model.decode(NEXT[: cache.rows], cache).clone()


@pytest.fixture(scope="module")
def torch_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunks-torch")
    from tiny_models import make_tiny_hf_model

    return load_hf_dir(make_tiny_hf_model(root, "qwen2", max_position_embeddings=1024)).model


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("kind", ["particles-4", "static-eager"])
def test_a_torch_prefill_in_chunks_equals_the_whole_one(torch_model, kind, chunking):
    """Chunks of a prompt into the prefix four particles share (an ordinary cache, and a
    static one in eager round mode): the logits after the prompt and of a forward after it within
    TORCH_ATOL of the whole prompt's. Broken variants: a chunk's queries attending only to
    its own keys (no earlier chunks), RoPE positions from 0 in every chunk."""
    model = torch_model
    rows, static = 4, kind == "static-eager"
    model.rounds = "eager" if static else "auto"
    try:

        def fresh():
            if static:
                return model.new_cache(rows, 8, static=True, prompt_len=P)
            return model.new_cache(rows, 8)

        whole = _prefill_then_decode(model, fresh(), None)
        cache = fresh()
        assert static == (type(cache).__name__ == "StaticKVCache")
        got = _prefill_then_decode(model, cache, CHUNKINGS[chunking])
    finally:
        model.rounds = "auto"
    for a, b in zip(got, whole, strict=True):
        torch.testing.assert_close(a, b, atol=TORCH_ATOL, rtol=0)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    root = tmp_path_factory.mktemp("chunks-gguf")
    return make_tiny_gguf(root, "qwen2", 96, seed=5, max_position_embeddings=1024)[0]


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_a_llamacpp_prefill_in_chunks_equals_the_whole_one(gguf_path, chunking):
    """The same on llama.cpp (its sequences: the prompt decoded into the first row's
    sequence chunk by chunk, shared with the other rows after the last chunk), with chunks
    over its ``n_batch`` of 64: within LLAMACPP_ATOL. Broken variants: the rows sharing
    only the prompt's first chunk, positions from 0 in every chunk."""
    from smcspec.backends.llamacpp import LlamaCppModel, LlamaCppSettings

    settings = LlamaCppSettings(threads=1, kv_cells=4096, kv_type="f32", n_batch=64,
                                max_sequences=8)  # fmt: skip
    model = LlamaCppModel(gguf_path, settings)
    try:
        whole = _prefill_then_decode(model, model.new_cache(4, 8), None)
        got = _prefill_then_decode(model, model.new_cache(4, 8), CHUNKINGS[chunking])
    finally:
        model.release()
    for a, b in zip(got, whole, strict=True):
        torch.testing.assert_close(a, b, atol=LLAMACPP_ATOL, rtol=0)


def test_chunks_out_of_order_are_refused(torch_model, gguf_path):
    from smcspec.backends.llamacpp import LlamaCppModel, LlamaCppSettings

    llama = LlamaCppModel(gguf_path, LlamaCppSettings(threads=1, kv_cells=4096))
    try:
        for model in (torch_model, llama):
            cache = model.new_cache(1, 8)
            assert model.prefill(PROMPT, cache, 0, 10) is None
            for start, end in ((5, 20), (11, 20), (10, 10), (10, P + 1)):
                with pytest.raises(ValueError, match="prefill chunk"):
                    model.prefill(PROMPT, cache, start, end)
            assert model.prefill(PROMPT, cache, 10, P) is not None
    finally:
        llama.release()


def test_chunks_are_cut_at_the_same_places_whatever_the_speed():
    """A prompt is cut every max_tokens tokens whatever its model's measured speed (issue
    87: the cuts once followed the speed, the first prompt of a fresh server cut at 64
    tokens, later ones at 16 on a slow model, and llama.cpp's logits with them); the speed
    only says how long the next chunk is expected to take."""
    pace = ChunkedPrefill(max_tokens=16, step_s=1.0)
    model = object()
    step = Prefill(model, PROMPT, None)
    assert pace.expected_s(step) == float("inf")  # not measured yet
    for rate in (None, 1e5, 3.0):
        if rate is not None:
            pace._rates[id(model)] = rate
        cuts, step.done = [], 0
        while step.remaining:
            step.done += pace.next_chunk(step)
            cuts.append(step.done)
        assert cuts == [*range(16, P, 16), P], (rate, cuts)
    step.done = P - 10
    assert pace.expected_s(step) == 10 / 3  # the 10 tokens left, at 3 tokens a second
    step.done = 20  # a chunk ends at the next multiple of max_tokens
    assert pace.next_chunk(step) == 12 and ChunkedPrefill(max_tokens=512).next_chunk(step) == P - 20


def test_a_fast_model_runs_a_long_prompt_in_one_step(engine):
    """Where chunks are quick (here: a tiny model, 1 s a step), a step runs chunk after
    chunk of a long prompt: an 800-token prompt in chunks of 64 is prefilled in a few
    steps, not 13 (the common path is not slowed by a step per chunk)."""
    sched = BatchScheduler(engine, prefill_chunk=64, prefill_step_s=1.0)
    steps: list = []
    sched.on_step = steps.append
    ended = threading.Event()
    sched.start()
    try:
        sched.submit(Request(_job(engine, "ar", 0, prompt_len=800), lambda out: ended.set()))
        assert ended.wait(60)
    finally:
        sched.stop()
    prefill_steps = [s.prefill_tokens for s in steps if s.prefill_tokens]
    assert sum(prefill_steps) == 800 and len(prefill_steps) < 13, prefill_steps


# ----------------------------------------------------------------------------- decoders
METHODS = ["ar", "sd", "smc"]


@pytest.fixture(scope="module", params=["torch", "llamacpp"])
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"chunks-engine-{request.param}")
    if request.param == "llamacpp":
        pytest.importorskip("llama_cpp")
        from smcspec.backends.llamacpp import LlamaCppSettings

        settings = LlamaCppSettings(threads=1, kv_cells=16384, kv_type="f32", n_batch=512)
        return make_tiny_gguf_chat_engine(root, llamacpp=settings, max_position_embeddings=4096)
    dirs = make_tiny_chat_pair(root, max_position_embeddings=4096)
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))


def _job(engine, method: str, seed: int, prompt_len: int = 100):
    ids = torch.randint(0, 90, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    cfg = GenerationConfig(method=method, max_new_tokens=12, particles=4, draft_tokens=3,
                           seed=seed)  # fmt: skip
    return engine.prepare(ids.tolist(), cfg)


@pytest.mark.parametrize("method", METHODS)
def test_a_seeds_output_is_the_same_with_the_prompt_in_chunks(engine, method, monkeypatch):
    """Each decoder through a scheduler that prefills 100-token prompts in chunks of 16 (7
    chunks, each a step, two requests interleaved) gives the tokens it gives with the
    prompt prefilled whole (``Engine.generate``), for two seeds. Broken variant: a
    chunked prefill whose KV is off (any of the backend variants above)."""
    monkeypatch.setattr("scheduling.BatchScheduler", _chunked_scheduler(16))
    jobs = [_job(engine, method, seed) for seed in range(2)]
    chunked = run_concurrently(engine, jobs)
    for job, out in zip(jobs, chunked, strict=True):
        assert not isinstance(out, BaseException), out
        whole = engine.generate(job.ids, job.config)
        assert out.token_ids == whole.token_ids, (method, job.config.seed)


ONE_CHUNK_A_STEP = 1e-9  # prefill_step_s: each step runs one chunk


def _chunked_scheduler(chunk: int):
    def make(engine, **kw):
        return BatchScheduler(engine, prefill_chunk=chunk, prefill_step_s=ONE_CHUNK_A_STEP, **kw)

    return make


def test_a_long_prompt_runs_in_chunks_between_other_requests_steps(engine):
    """An 800-token prompt prefilled a 16-token chunk a step: 50 chunks on the target, and a
    short request admitted with it gets its turn at the second step and decodes its whole
    reply (12 tokens) meanwhile: it finishes while the long one is still prefilling. Broken
    variant: the whole prompt in one step (the short request then waits)."""
    sched = BatchScheduler(engine, max_running=4, prefill_chunk=16,
                           prefill_step_s=ONE_CHUNK_A_STEP)  # fmt: skip
    steps: list = []
    sched.on_step = steps.append
    done: dict[str, float] = {}
    finished = threading.Event()

    def record(name):
        def on_done(out):
            assert not isinstance(out, BaseException), out
            done[name] = len(steps)
            if len(done) == 2:
                finished.set()

        return on_done

    sched.start()
    try:
        with sched._cv:  # admitted at the same step
            sched.submit(Request(_job(engine, "ar", 0, prompt_len=800), record("long")))
            sched.submit(Request(_job(engine, "ar", 1, prompt_len=5), record("short")))
        assert finished.wait(120)
    finally:
        sched.stop()
    prefill_steps = [s for s in steps if s.prefill_tokens]
    assert sum(s.prefill_tokens for s in steps) == 805
    assert [s.prefill_tokens for s in steps[:3]] == [16, 5, 16]  # in turn
    assert max(s.prefill_tokens for s in steps) == 16
    assert len(prefill_steps) == 51  # 800 / 16, and the short prompt's
    assert done["short"] < 51 <= done["long"]


def test_a_request_cancelled_during_its_prefill_is_dropped_at_the_next_chunk(engine):
    """Cancelled after its second chunk, a long prompt's request ends at the next step:
    its prefill goes no further and its pools are full again."""
    sched = BatchScheduler(engine, prefill_chunk=16, prefill_step_s=ONE_CHUNK_A_STEP)
    ran: list[int] = []
    outcome: list = []
    ended = threading.Event()
    req = Request(_job(engine, "sd", 0, prompt_len=400),
                  lambda out: (outcome.append(out), ended.set()))  # fmt: skip

    def on_step(stats):
        ran.append(stats.prefill_tokens)
        if len(ran) == 2:
            req.cancel()

    sched.on_step = on_step
    sched.start()
    try:
        sched.submit(req)
        assert ended.wait(60)
    finally:
        sched.stop()
    assert isinstance(outcome[0], RuntimeError) and "cancelled" in str(outcome[0])
    assert sum(ran) == 32  # two chunks of 16, then dropped
    for pool in engine.pools().values():
        assert pool.leases == 0 and pool.free() == pool.capacity


def test_prefill_chunk_runs_a_short_prompt_as_one_plain_prefill(torch_model, monkeypatch):
    """A prompt that fits one chunk is one ``model.prefill(prompt, cache)``, as unchunked
    (the common path is not slowed and keeps its numerics, the captured static prefill
    included)."""
    calls = []
    real = torch_model.prefill
    monkeypatch.setattr(torch_model, "prefill", lambda *a: calls.append(len(a)) or real(*a))
    step = Prefill(torch_model, PROMPT[:20], torch_model.new_cache(1, 4))
    assert prefill_chunk(step, 512) is not None and calls == [2] and step.remaining == 0


# ----------------------------------------------------------------------------- the server
MODEL = "tiny"
LONG = 3000  # prompt tokens
SECONDS_PER_TOKEN = 0.003  # a slow model's prefill: 9 s for the long prompt, whole


@pytest.fixture(scope="module", params=["torch", "llamacpp"])
def server_engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"chunks-server-{request.param}")
    if request.param == "llamacpp":
        pytest.importorskip("llama_cpp")
        from smcspec.backends.llamacpp import LlamaCppSettings

        settings = LlamaCppSettings(threads=1, kv_cells=8192, max_sequences=16, n_batch=512)
        return make_tiny_gguf_chat_engine(root, llamacpp=settings, max_position_embeddings=4096)
    dirs = make_tiny_chat_pair(root, max_position_embeddings=4096)
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))


def _slow_prefills(engine, monkeypatch) -> list[tuple[int, int]]:
    """Every prefill of the target takes SECONDS_PER_TOKEN a prompt token it runs (a slow
    model); returns the ``(prompt length, tokens run)`` of each call."""
    model = engine.target.model
    real = model.prefill
    ran: list[tuple[int, int]] = []

    def slow(prompt, cache, *span):
        start, end = span if span else (0, prompt.shape[-1])
        ran.append((prompt.shape[-1], end - start))
        time.sleep(SECONDS_PER_TOKEN * (end - start))
        return real(prompt, cache, *span)

    monkeypatch.setattr(model, "prefill", slow)
    return ran


def test_a_long_prompt_whose_client_left_lets_go_of_the_server(server_engine, monkeypatch):
    """A 3,000-token prompt on a slow model (9 s of prefill whole), its client gone after
    2 s; a 2-token request sent 0.5 s after it. The short request finishes within the
    promised 5 s of being sent and the long one is cancelled, its pools full again, within
    5 s of its client leaving, with its prefill cut short (chunks, not the whole prompt).
    On cb48c1a the prefill ran as one step: the short request waited for it, and the long
    one held its pools until it ended, 7 s after its client left (broken variant:
    ``prefill_chunk`` running the rest of the prompt at once)."""
    server = Server(create_app(server_engine, GenerationConfig(max_new_tokens=4),
                               model_name=MODEL))  # fmt: skip
    try:
        ran = _slow_prefills(server_engine, monkeypatch)
        before = server.metrics()
        url = server.url("/v1/completions")
        long_body = {"model": MODEL, "prompt": [i % 90 for i in range(LONG)], "max_tokens": 4,
                     "smc": {"method": "ar"}}  # fmt: skip
        short_body = {"model": MODEL, "prompt": "ab cd", "max_tokens": 2, "smc": {"method": "ar"}}
        short: dict = {}

        def send_short():
            t0 = time.monotonic()
            r = httpx.post(url, json=short_body, timeout=60)
            short.update(status=r.status_code, seconds=time.monotonic() - t0)

        left: dict = {}

        def send_long():
            try:
                httpx.post(url, json=long_body, timeout=httpx.Timeout(30, read=2.0))
            except httpx.ReadTimeout:
                left["at"] = time.monotonic()  # the client gives up and hangs up

        long_client = threading.Thread(target=send_long)
        long_client.start()
        time.sleep(0.5)
        short_client = threading.Thread(target=send_short)
        short_client.start()
        long_client.join(30)
        assert "at" in left, "the long request ended before its client left"
        cancelled = 'smcspec_requests_total{"method": "ar", "outcome": "cancelled"}'
        while time.monotonic() - left["at"] < 5:
            if server.metrics().get(cancelled, 0) > before.get(cancelled, 0):
                if _pools_full(server) and not short_client.is_alive():
                    break
            time.sleep(0.05)
        gone_after = time.monotonic() - left["at"]
        short_client.join(60)
        assert short.get("status") == 200 and short["seconds"] < 5, short
        m = server.metrics()
        assert m.get(cancelled, 0) == before.get(cancelled, 0) + 1, "not cancelled"
        assert gone_after < 5 and _pools_full(server), gone_after
        long_chunks = [n for p, n in ran if p == LONG]
        assert len(long_chunks) > 1 and sum(long_chunks) < LONG, long_chunks  # cut short
        monkeypatch.undo()
        _settled(server)
    finally:
        monkeypatch.undo()
        server.stop()


def test_the_server_chunks_128_tokens_on_a_cpu_unless_told(engine):
    """The default chunk follows the target's device (128 tokens on a CPU, where the default
    pair prefills fastest in chunks of 64-128, 512 elsewhere); a given one is kept."""
    from smcspec.chunked_prefill import default_chunk

    assert default_chunk("cpu") == 128 and default_chunk("cuda:0") == 512
    assert create_app(engine).state.scheduler.prefill.max_tokens == 128
    assert create_app(engine, prefill_chunk=48).state.scheduler.prefill.max_tokens == 48
