"""The OpenAI-compatible server, driven by the real ``openai`` client over loopback.

Tiny random models keep it fast; the server runs in uvicorn on 127.0.0.1 in a thread.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import Server
from tiny_models import make_tiny_chat_pair, make_tiny_gguf_chat_engine

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.server import create_app

MODEL = "tiny"


@pytest.fixture(scope="module", params=["torch", "llamacpp"])
def engine(request, tmp_path_factory):
    """The tiny chat pair on each backend (HF directories on torch, GGUF on llamacpp)."""
    root = tmp_path_factory.mktemp(f"server-{request.param}")
    if request.param == "llamacpp":
        pytest.importorskip("llama_cpp")
        return make_tiny_gguf_chat_engine(root, max_position_embeddings=4096)
    dirs = make_tiny_chat_pair(root, max_position_embeddings=4096)
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))


@pytest.fixture(scope="module")
def server(engine):
    srv = Server(create_app(engine, GenerationConfig(max_new_tokens=16), model_name=MODEL))
    yield srv
    srv.stop()


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_completion(server, method):
    r = server.client().completions.create(
        model=MODEL, prompt="ab cd", max_tokens=10, seed=3, extra_body={"smc": {"method": method}}
    )
    assert r.usage.completion_tokens == 10 or r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0
    extra = r.choices[0].model_extra["smcspec"]
    assert extra["method"] == method
    if method == "smc":
        assert {"rounds", "resamples", "mean_ess"} <= extra.keys()
    if method == "sd":
        assert "acceptance_rate" in extra


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_chat_streaming_with_usage(server, method):
    stream = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "ab cd"}],
        max_tokens=12,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"smc": {"method": method, "particles": 3, "draft_tokens": 2}},
    )
    text, reasons, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons in (["length"], ["stop"])
    assert usage is not None and 1 <= usage.completion_tokens <= 12
    # the streamed text equals the non-streamed text of the same seeded request
    full = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "ab cd"}],
        max_tokens=12,
        seed=5,
        extra_body={"smc": {"method": method, "particles": 3, "draft_tokens": 2}},
    )
    assert full.choices[0].message.content == text


def test_stop_strings_and_n(server):
    r = server.client().completions.create(model=MODEL, prompt="ab", max_tokens=16, n=3, seed=1)
    assert len(r.choices) == 3 and sorted(c.index for c in r.choices) == [0, 1, 2]
    text = r.choices[0].text
    if len(text) > 3:
        stop = text[2:4]
        s = server.client().completions.create(
            model=MODEL, prompt="ab", max_tokens=16, seed=1, stop=[stop]
        )
        assert stop not in s.choices[0].text and text.startswith(s.choices[0].text)
        assert s.choices[0].finish_reason == "stop"


def _isolation_settings(engine) -> dict:
    """Decoder settings whose output a concurrent request must reproduce exactly.

    torch: SMC-SD itself (the batched forward computes each row as it would alone).
    llamacpp: llama.cpp's arithmetic depends on the batch's size (max |logit difference|
    0.03 on these tiny models between a 128-token and a 16-token batch), so sampled outputs
    are equal only in distribution; greedy decoding (top_k=1), whose logit gaps here are far
    wider than that, must still be reproduced token for token.
    """
    if engine.target.backend == "llamacpp":
        return {"method": "ar", "top_k": 1}
    return {"method": "smc", "particles": 4, "draft_tokens": 3}


def _solo(engine, prompt: str, seed: int, tokens: int) -> str:
    cfg = GenerationConfig(max_new_tokens=tokens, seed=seed, **_isolation_settings(engine))
    return engine.generate(prompt, cfg, chat=False).text


def test_concurrent_streams_are_batched_and_isolated(server, engine):
    prompts = ["ab", "cd ef", "gh", "ij kl mn", "op", "qr st", "uv", "wx yz"]
    before = server.metrics()
    settings = _isolation_settings(engine)
    top_k = settings.pop("top_k", None)
    extra = {"smc": settings} | ({"top_k": top_k} if top_k else {})

    def run(i: int) -> tuple[str, int]:
        stream = server.client().completions.create(
            model=MODEL,
            prompt=prompts[i],
            max_tokens=40 + i,
            seed=100 + i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        text, usage = "", None
        for chunk in stream:
            usage = chunk.usage or usage
            text += "".join(c.text for c in chunk.choices)
        return text, usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    after = server.metrics()
    for i, (text, n_tokens) in enumerate(results):
        assert n_tokens <= 40 + i
        # same seed alone gives the same text: nobody got another request's tokens
        assert text == _solo(engine, prompts[i], 100 + i, 40 + i)
    assert after["smcspec_max_batch_requests"] >= 2  # requests really shared forwards
    key = f'smcspec_requests_total{{"method": "{settings["method"]}", "outcome": "success"}}'
    assert after[key] - before.get(key, 0) == 8


def test_disconnect_frees_the_rows(server):
    body = {
        "model": MODEL,
        "prompt": "ab",
        "max_tokens": 4000,
        "stream": True,
        "smc": {"particles": 16, "draft_tokens": 4},
    }
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url("/v1/completions"), json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and '"text"' in line:
                    break  # got a token: hang up mid-stream
    deadline = time.time() + 20
    while time.time() < deadline:
        m = server.metrics()
        if m["smcspec_running_requests"] == 0:
            break
        time.sleep(0.05)
    assert m["smcspec_running_requests"] == 0
    assert m.get('smcspec_requests_total{"method": "smc", "outcome": "cancelled"}', 0) >= 1


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "nope", "prompt": "ab"}, "model"),
        ({"model": MODEL, "prompt": "ab", "max_tokens": 0}, "max_tokens"),
        # the same rules for OpenAI's newer name (0 ran to the end of turn on cb48c1a)
        ({"model": MODEL, "prompt": "ab", "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"model": MODEL, "prompt": "ab", "max_completion_tokens": -3}, "max_completion_tokens"),
        (
            {"model": MODEL, "prompt": "ab", "max_completion_tokens": 4, "max_tokens": 5},
            "max_tokens",
        ),
        ({"model": MODEL, "prompt": "ab", "smc": {"particles": 0}}, None),
        ({"model": MODEL, "prompt": "ab", "smc": {"draft_tokens": 1000}}, None),
        ({"model": MODEL, "prompt": "ab", "temperature": -0.5}, None),
        ({"model": MODEL, "prompt": "ab", "smc": {"resampler": "bogus"}}, None),
        ({"model": MODEL, "prompt": "ab", "smc": {"finished_particles": "drop"}}, None),
        ({"model": MODEL, "prompt": list(range(1, 90)) * 50, "max_tokens": 10}, None),
        ({"model": MODEL, "prompt": ""}, "prompt"),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "ab", "n": 99}, "n"),
    ],
)
def test_bad_input_gets_400_and_the_server_keeps_serving(server, body, param):
    r = httpx.post(server.url("/v1/completions"), json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param
    assert httpx.get(server.url("/health")).status_code == 200


# OpenAI's nullable request fields (openai-python's ``Optional`` params, generated from its
# OpenAPI spec), seed aside; the last ones are OpenAI fields smcspec ignores
NULLABLE = ["frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
            "stop", "stream", "stream_options", "temperature", "top_p"]  # fmt: skip
NULLABLE_CHAT = NULLABLE + ["max_completion_tokens", "top_logprobs", "store", "metadata",
                            "modalities", "audio", "prediction", "service_tier"]  # fmt: skip
NULLABLE_COMPLETIONS = NULLABLE + ["best_of", "echo", "suffix"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_openai_nullable_fields_sent_as_null_take_their_defaults(server, chat):
    """SDKs send explicit nulls: every field OpenAI's request schemas make nullable is
    accepted as null and means its default (the same reply as without it). On cb48c1a
    ``"n": null`` and ``"stream": null`` were 400s."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"model": MODEL, "seed": 7, "smc": {"method": "sd"}}
    base |= {"messages": [{"role": "user", "content": "ab cd"}]} if chat else {"prompt": "ab cd"}
    nulls = dict.fromkeys(NULLABLE_CHAT if chat else NULLABLE_COMPLETIONS)
    plain = httpx.post(server.url(path), json=base, timeout=60)
    nulled = httpx.post(server.url(path), json={**base, **nulls}, timeout=60)
    assert plain.status_code == nulled.status_code == 200, nulled.text
    assert nulled.headers["content-type"].startswith("application/json")  # stream: false
    key = "message" if chat else "text"
    assert [c[key] for c in nulled.json()["choices"]] == [c[key] for c in plain.json()["choices"]]
    unseeded = httpx.post(server.url(path), json={**base, **nulls, "seed": None}, timeout=60)
    assert unseeded.status_code == 200 and len(unseeded.json()["choices"]) == 1


def test_a_null_prompt_is_openais_document_start(server):
    """``"prompt": null``: OpenAI's documented default, ``<|endoftext|>``, as if given."""
    base = {"model": MODEL, "seed": 1, "max_tokens": 4}
    nulled = httpx.post(server.url("/v1/completions"), json={**base, "prompt": None}, timeout=60)
    given = httpx.post(server.url("/v1/completions"), json={**base, "prompt": "<|endoftext|>"},
                       timeout=60)  # fmt: skip
    assert nulled.status_code == given.status_code, (nulled.text, given.text)
    if given.status_code == 200:  # a 400 where the text maps outside the model's vocabulary
        assert nulled.json()["usage"] == given.json()["usage"]
        assert nulled.json()["choices"][0]["text"] == given.json()["choices"][0]["text"]
    else:
        assert nulled.json() == given.json()


def test_max_completion_tokens_caps_like_max_tokens(server):
    replies = []
    for name in ("max_tokens", "max_completion_tokens"):
        body = {"model": MODEL, "prompt": "ab", "seed": 2, name: 3, "smc": {"method": "ar"}}
        r = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3, r.text
        replies.append((r.json()["usage"], r.json()["choices"][0]["text"]))
    assert replies[0] == replies[1]


def test_malformed_json_is_400(server):
    r = httpx.post(
        server.url("/v1/chat/completions"),
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    ok = server.client().completions.create(model=MODEL, prompt="ab", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


def test_models_and_metrics_endpoints(server):
    assert [m.id for m in server.client().models.list()] == [MODEL]
    server.client().completions.create(model=MODEL, prompt="ab", max_tokens=2, seed=0)
    m = server.metrics()
    for name in (
        "smcspec_prompt_tokens_total",
        "smcspec_generation_tokens_total",
        "smcspec_time_to_first_token_seconds_count",
        "smcspec_smc_rounds_total",
        "smcspec_smc_resamples_total",
        "smcspec_smc_mean_ess_count",
        "smcspec_sd_draft_tokens_total",
        "smcspec_sd_accepted_tokens_total",
        "smcspec_waiting_requests",
        "smcspec_running_requests",
    ):
        assert name in m, name
    assert m["smcspec_generation_tokens_total"] > 0


def test_a_greedy_smc_request_is_counted_with_sd_stats(server):
    """Greedy smc runs as greedy sd: /metrics counts it under ``sd`` with sd's drafted and
    accepted tokens, and puts nothing into SMC-SD's ESS histogram or rounds (issue 63: the
    ESS of 0.0 it used to observe, and the drafted tokens it never added)."""
    before = server.metrics()
    r = server.client().completions.create(
        model=MODEL,
        prompt="ab",
        max_tokens=12,
        temperature=0.0,
        extra_body={"smc": {"method": "smc", "particles": 4, "draft_tokens": 3}},
    )
    assert r.choices[0].model_extra["smcspec"]["ran_as"] == "sd"
    m = server.metrics()

    def grew(key: str) -> float:
        return m.get(key, 0.0) - before.get(key, 0.0)

    assert grew('smcspec_requests_total{"method": "sd", "outcome": "success"}') == 1
    assert grew('smcspec_requests_total{"method": "smc", "outcome": "success"}') == 0
    assert grew("smcspec_sd_draft_tokens_total") > 0
    assert 0 <= grew("smcspec_sd_accepted_tokens_total") <= grew("smcspec_sd_draft_tokens_total")
    assert grew("smcspec_smc_mean_ess_count") == 0
    assert grew("smcspec_smc_rounds_total") == 0


def test_metrics_count_distinct_rows(server):
    """At a low temperature the 8 particles draft the same tokens: each model's forwards
    compute fewer distinct rows than they are fed, and /metrics counts both."""
    before = server.metrics()
    server.client().completions.create(
        model=MODEL,
        prompt="ab",
        max_tokens=16,
        temperature=0.05,
        seed=1,
        extra_body={"smc": {"particles": 8, "draft_tokens": 3}},
    )
    m = server.metrics()
    for role in ("target", "draft"):
        label = f'{{"model": "{role}"}}'
        fed = m[f"smcspec_forward_rows_total{label}"] - before.get(
            f"smcspec_forward_rows_total{label}", 0
        )
        computed = m[f"smcspec_forward_distinct_rows_total{label}"] - before.get(
            f"smcspec_forward_distinct_rows_total{label}", 0
        )
        assert 0 < computed < fed, (role, computed, fed)


def test_finished_particles_rule_is_a_request_option(server):
    """``smc.finished_particles`` picks the rule per request; the stats say how many particles
    were banked (none under the paper's "keep" rule)."""
    c = server.client()
    stats = {}
    for rule in ("bank", "keep"):
        r = c.completions.create(
            model=MODEL, prompt="ab", max_tokens=8, seed=1,
            extra_body={"smc": {"method": "smc", "finished_particles": rule}},
        )  # fmt: skip
        stats[rule] = r.choices[0].model_extra["smcspec"]
    assert stats["bank"]["banked"] >= 1 and stats["keep"]["banked"] == 0


def test_multi_draft_sd_and_cut_rounds_are_request_options(server):
    """``smc.particles`` with ``"method": "sd"`` runs multi-draft sd (its stats give N and the
    per-depth acceptance), ``"method": "sd"`` alone stays chain sd on this smc server (N 1,
    not the server's 4 particles), and ``round_end`` / ``stop_epsilon`` reach SMC-SD."""
    c = server.client()

    def stats(smc: dict) -> dict:
        r = c.completions.create(model=MODEL, prompt="ab cd", max_tokens=10, seed=2,
                                 extra_body={"smc": smc})  # fmt: skip
        return r.choices[0].model_extra["smcspec"]

    multi = stats({"method": "sd", "particles": 4, "draft_tokens": 3})
    assert multi["particles"] == 4 and len(multi["acceptance_by_depth"]) == 3
    assert "particles" not in stats({"method": "sd", "draft_tokens": 3})  # chain sd
    cut = stats({"method": "smc", "particles": 4, "draft_tokens": 4, "round_end": "ess"})
    assert "cut_rounds" in cut and cut["mean_round_tokens"] >= 1
    r = httpx.post(server.url("/v1/completions"), json={
        "model": MODEL, "prompt": "ab", "smc": {"stop_epsilon": 1.5}}, timeout=30)  # fmt: skip
    assert r.status_code == 400 and "stop_epsilon" in r.json()["error"]["message"]


def _held_programs(engine, monkeypatch, gate: threading.Event, holding: threading.Event):
    """Make every request's program stop after its first step (its prefill) until ``gate``
    is set: the scheduler's worker waits inside its step, outside the scheduler's lock, so
    the request stays running and nothing else is admitted while submissions still reach
    the queue. ``holding`` is set once the worker waits there."""
    real = engine.program

    def held(job):
        program = real(job)
        try:
            result = yield next(program)
            holding.set()
            if not gate.wait(60):
                raise RuntimeError("the test never opened the gate")
            step = program.send(result)
            while True:
                result = yield step
                step = program.send(result)
        except StopIteration as done:
            return done.value
        finally:
            program.close()

    monkeypatch.setattr(engine, "program", held)


def _until(condition, what: str, timeout: float = 60) -> None:
    """Wait for ``condition()`` (a state the test set up, not a race: the timeout only
    bounds a broken server)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_overload_gets_429(engine, monkeypatch):
    """A server with room for one running and one waiting request: the first request is
    held running (its program waits after its prefill) and the second is queued, so a third
    gets 429 in OpenAI's error shape, at once; released, the first two answer 200 and the
    server takes requests again (health 200, a new request 200). The queue is filled by
    holding the worker, not by racing long requests against the clock, so the outcome does
    not depend on the machine's load.

    Broken variants it catches (run by hand): ``BatchScheduler.submit`` ignoring
    ``max_waiting`` (the third request is queued: "the third request was queued"); the
    server answering a full queue with 503 instead of 429."""
    gate, holding = threading.Event(), threading.Event()
    _held_programs(engine, monkeypatch, gate, holding)
    app = create_app(
        engine, GenerationConfig(max_new_tokens=16), model_name=MODEL, max_running=1,
        max_waiting=1,
    )  # fmt: skip
    srv = Server(app)
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 4, "smc": {"method": "ar"}}

    def post() -> httpx.Response:
        return httpx.post(srv.url("/v1/completions"), json=body, timeout=60)

    try:
        with ThreadPoolExecutor(3) as pool:
            try:
                running = pool.submit(post)
                _until(holding.is_set, "the first request to run")
                waiting = pool.submit(post)
                _until(lambda: app.state.scheduler.num_waiting == 1, "the second to be queued")
                third = pool.submit(post)
                _until(lambda: third.done() or app.state.scheduler.num_waiting > 1, "the third")
                assert app.state.scheduler.num_waiting == 1, "the third request was queued"
                refused = third.result()
                assert not running.done() and not waiting.done()
            finally:
                gate.set()  # (on a failure too: the held requests end before the pool does)
            assert refused.status_code == 429
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error" and "overloaded" in error["message"]
            assert set(error) == {"message", "type", "param", "code"}
            assert [f.result().status_code for f in (running, waiting)] == [200, 200]
        assert httpx.get(srv.url("/health")).status_code == 200
        again = post()
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
    finally:
        srv.stop()


def test_health_is_503_when_not_serving(engine):
    app = create_app(engine, model_name=MODEL)
    from fastapi.testclient import TestClient

    client = TestClient(app)  # lifespan not started: the scheduler is not running
    assert client.get("/health").status_code == 503


def test_a_failing_request_does_not_stop_the_worker(server, engine, monkeypatch):
    real = engine.program

    def broken(job):
        program = real(job)
        yield next(program)  # the prefill runs, then the decoder "crashes"
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "program", broken)
    r = httpx.post(server.url("/v1/completions"), json={"model": MODEL, "prompt": "ab"}, timeout=60)
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    monkeypatch.setattr(engine, "program", real)
    assert httpx.get(server.url("/health")).status_code == 200
    ok = server.client().completions.create(model=MODEL, prompt="ab", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_sampling_parameters_reach_the_decoder(server, method):
    """top_k=1 makes the exact methods greedy: different seeds give the same text. (smc
    samples the truncated target only approximately: with top_k=1 a drafted token other than
    the target's argmax kills its particle, see docs/sampling.md.)"""

    def text(seed: int, **extra) -> str:
        r = server.client().completions.create(
            model=MODEL, prompt="ab cd", max_tokens=12, seed=seed,
            extra_body={"smc": {"method": method}, **extra},
        )  # fmt: skip
        return r.choices[0].text

    assert text(1, top_k=1) == text(2, top_k=1) == text(3, top_k=1)
    assert len({text(s) for s in (1, 2, 3)}) > 1  # without it the seeds differ


def _text(server, seed: int = 4, **fields) -> list[str]:
    body = {"model": MODEL, "prompt": "ab cd", "max_tokens": 12, "seed": seed, **fields}
    r = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [c["text"] for c in r.json()["choices"]]


@pytest.mark.parametrize("method", ["ar", "sd"])
@pytest.mark.parametrize(
    "filters", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=["top_k", "top_p", "min_p"]
)
def test_truncation_fields_are_applied_not_ignored(server, method, filters):
    """Each filter at its extreme keeps only the most likely token, so the sampled output must
    equal greedy decoding's (and differ from plain sampling with the same seed)."""
    smc = {"smc": {"method": method}}
    greedy = _text(server, temperature=0, **smc)
    assert _text(server, **filters, **smc) == greedy
    assert _text(server, **smc) != greedy  # with seed 4 plain sampling leaves the argmax


def test_choice_i_uses_seed_plus_i(server):
    both = _text(server, seed=10, n=2, smc={"method": "ar"})
    assert both[1] == _text(server, seed=11, smc={"method": "ar"})[0]
    assert both[0] == _text(server, seed=10, smc={"method": "ar"})[0]
    assert both[0] != both[1]


def test_concurrent_greedy_requests_of_every_method_equal_their_solo_runs(server, engine):
    """Greedy sd and smc (which runs as sd) roll their caches back while other requests share
    their forwards; ar, sd and smc requests in flight together must each give what they
    give alone (on llamacpp too: greedy choices are far wider apart here than llama.cpp's
    batch-size arithmetic moves the logits)."""
    prompts = ["ab", "cd ef", "gh", "ij kl mn", "op", "qr st"]
    methods = ["sd", "smc", "ar", "smc", "sd", "ar"]

    def run(i: int) -> str:
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 30, "temperature": 0,
                "smc": {"method": methods[i], "particles": 4, "draft_tokens": 3}}  # fmt: skip
        r = httpx.post(server.url("/v1/completions"), json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(run, range(len(prompts))))
    for i, text in enumerate(texts):
        cfg = GenerationConfig(
            method=methods[i], temperature=0, max_new_tokens=30, particles=4, draft_tokens=3
        )
        assert text == engine.generate(prompts[i], cfg, chat=False).text, (i, methods[i])


@pytest.mark.parametrize("stream", [False, True])
def test_sd_with_ngram_drafts_equals_greedy_ar(server, stream):
    """``"smc": {"method": "sd", "draft": "ngram"}``: at temperature 0 the text is greedy
    ar's, on both backends, streamed or not; smc refuses the n-gram draft with a 400."""
    client = server.client()
    prompt = "ab cd ab cd ab cd ab"
    texts = {}
    for name, smc in (("ar", {"method": "ar"}), ("ngram", {"method": "sd", "draft": "ngram"})):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                  extra_body={"smc": smc})  # fmt: skip
        if stream and name == "ngram":
            chunks = list(client.completions.create(stream=True, **kw))
            texts[name] = "".join(c.choices[0].text for c in chunks if c.choices)
            extra = chunks[-1].choices[0].model_extra["smcspec"]
        else:
            r = client.completions.create(**kw)
            texts[name], extra = r.choices[0].text, r.choices[0].model_extra["smcspec"]
        if name == "ngram":
            assert extra["draft"] == "ngram" and "acceptance_rate" in extra
    assert texts["ngram"] == texts["ar"]
    bad = {"model": MODEL, "prompt": prompt, "smc": {"method": "smc", "draft": "ngram"}}
    r = httpx.post(server.url("/v1/completions"), json=bad, timeout=30)
    assert r.status_code == 400 and "point mass" in r.json()["error"]["message"]
