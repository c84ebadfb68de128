"""The server's logprobs, echo, prompt arrays and vLLM-style extras, through the real
``openai`` client (and httpx for the shapes the client does not send) on the tiny chat pair,
both backends: OpenAI's shapes, streamed equal to whole, one choice set per prompt, the
stream's timing in the stats and ``/metrics``, and no client error a 5xx."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from live_server import Server
from tiny_models import make_tiny_chat_engine

from smcspec import GenerationConfig
from smcspec.server import create_app
from smcspec.server.logprobs import NEG_INF_LOGPROB

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "ab cd"}]


@pytest.fixture(scope="module", params=["torch", "llamacpp"])
def server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"logprobs-server-{request.param}")
    engine = make_tiny_chat_engine(request.param, root, max_position_embeddings=4096)
    srv = Server(create_app(engine, GenerationConfig(max_new_tokens=16), model_name=MODEL))
    yield srv
    srv.stop()


def smc(method: str) -> dict:
    return {"smc": {"method": method, "particles": 3, "draft_tokens": 2}}


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_chat_logprobs_whole_and_streamed(server, method):
    """Chat ``logprobs``/``top_logprobs``: one entry per token whose texts join to the
    content, 3 alternatives each, most likely first; the stream's entries (each chunk those
    of the tokens it completes) equal the whole response's. Broken variant caught: a chunk
    carrying its tokens' entries twice (``take_logprobs`` not marking them sent): the stream
    has more entries than the reply."""
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=10, seed=4, logprobs=True,
              top_logprobs=3, extra_body=smc(method))  # fmt: skip
    whole = server.client().chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    assert len(content) == whole.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and bytes(e.bytes).decode() == e.token
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and e.logprob <= values[0] + 1e-6
    streamed, text = [], ""
    for chunk in server.client().chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert text == whole.choices[0].message.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-5)
               for a, b in zip(streamed, content, strict=True))  # fmt: skip


def test_greedy_chat_top_logprob_is_the_token(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    for e in r.choices[0].logprobs.content:
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob


def test_completions_echo_logprobs_as_lm_eval_reads_them(server):
    """``echo`` with ``logprobs`` on a prompt of token lists, as lm-eval's
    ``local-completions`` sends its loglikelihood requests: each choice's tokens are its
    prompt's then its generated token, the first prompt token's value null, every other a
    number, one ``top_logprobs`` dict each, offsets increasing, ``text`` the prompt's text
    and the answer."""
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "temperature": 0,
            "logprobs": 1, "echo": True, "seed": 1234}  # fmt: skip
    r = httpx.post(server.url("/v1/completions"), json=body, timeout=120).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["usage"]["prompt_tokens"] == 8 and r["usage"]["completion_tokens"] == 2
    for c, p in zip(r["choices"], prompts, strict=True):
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(p) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
        assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
        assert lp["text_offset"] == sorted(lp["text_offset"])
        assert c["text"] == "".join(lp["tokens"])
        # greedy: the generated token is the most likely one
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())


def test_completions_echo_streamed(server):
    """A streamed echo: the prompt's text (and its values) come first, then the tokens."""
    body = {"model": MODEL, "prompt": "ab cd", "max_tokens": 4, "logprobs": 0, "echo": True,
            "stream": True, "seed": 2, "smc": {"method": "sd"}}  # fmt: skip
    texts, values = [], []
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                texts.append(choice["text"])
                if choice["logprobs"] is not None:
                    values += choice["logprobs"]["token_logprobs"]
    assert texts[0] == "ab cd" and values[0] is None
    whole = httpx.post(server.url("/v1/completions"), json={**body, "stream": False}).json()
    assert "".join(texts) == whole["choices"][0]["text"]
    assert values == whole["choices"][0]["logprobs"]["token_logprobs"]


def test_prompt_arrays_get_one_choice_set_each(server):
    """An array of strings (or of token lists) with ``n`` 2: prompt ``p``'s choice ``i`` is
    at index ``p * 2 + i`` and is what that prompt alone draws with the same seed."""
    cl = server.client()
    prompts = ["ab cd", "ef gh ij"]
    r = cl.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, seed=9)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        alone = cl.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=6, seed=9)
        got = {c.index: c.text for c in r.choices}
        assert [got[p * 2 + i] for i in range(2)] == [c.text for c in alone.choices]
    ids = [[5, 6, 7], [8, 9]]
    t = cl.completions.create(model=MODEL, prompt=ids, max_tokens=3, seed=1)
    assert t.usage.prompt_tokens == 5 and len(t.choices) == 2


def test_prompt_arrays_with_n_echo_each_choice_its_own_prompt(server):
    """``echo`` with an array of three prompts and ``n`` 2: choice ``p * 2 + i`` begins with
    prompt ``p``'s text, whole and streamed (the stream's first chunk of each choice is its
    prompt). Broken variant caught: the echo indexing the prompts the other way round (prompt
    ``index % 3``, or ``index % n``): choices 1-4 echo another prompt (one prompt or ``n`` 1,
    the other tests' cases, cannot tell)."""
    prompts = ["ab cd", "ef gh ij", "kl mn"]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 2, "echo": True,
            "seed": 3}  # fmt: skip
    r = httpx.post(server.url("/v1/completions"), json=body, timeout=120).json()
    assert sorted(c["index"] for c in r["choices"]) == list(range(6))
    for c in r["choices"]:
        assert c["text"].startswith(prompts[c["index"] // 2]), (c["index"], c["text"])
    first: dict[int, str] = {}
    with httpx.stream("POST", server.url("/v1/completions"), json={**body, "stream": True},
                      timeout=120) as resp:  # fmt: skip
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    first.setdefault(c["index"], c["text"])
    assert first == {i: prompts[i // 2] for i in range(6)}


def test_ignore_eos_and_min_tokens_extras(server):
    """aiperf's fixed-length mode (``ignore_eos`` and ``min_tokens`` top-level extras): as
    many tokens as asked; ``min_tokens`` alone keeps answers that long."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "ignore_eos": True,
            "min_tokens": 12, "seed": 1}  # fmt: skip
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
    body = {**body, "ignore_eos": False, "min_tokens": 6, "n": 3, "temperature": 1.5}
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 18


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "ab", "logit_bias": {"3": 1.0}}, "logit_bias"),
        ("/v1/completions", {"prompt": "ab", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "ab", "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": [[]]}, "prompt"),
        ("/v1/completions", {"prompt": [1.5]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, "a"]]}, "prompt"),
        ("/v1/completions", {"prompt": ["ab", ""]}, "prompt"),
        ("/v1/completions", {"prompt": ["ab"] * 65}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 10**9]]}, "prompt"),
        ("/v1/completions", {"prompt": "ab", "min_tokens": 9, "max_tokens": 4}, None),
        ("/v1/completions", {"prompt": "ab", "logprobs_mode": "logits"}, "logprobs_mode"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
         "top_logprobs"),
    ],
)  # fmt: skip
def test_bad_logprob_and_prompt_fields_are_400s(server, path, body, param):
    r = httpx.post(server.url(path), json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param or err["param"].startswith(param), err


def test_logit_bias_says_why(server):
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "ab", "logit_bias": {"1": 5}})
    assert "constraint" in r.json()["error"]["message"]
    ok = httpx.post(server.url("/v1/completions"), json={"prompt": "ab", "logit_bias": {}})
    assert ok.status_code == 200  # an empty bias is neutral


def test_head_where_get_is_served(server):
    for path in ("/metrics", "/health", "/v1/models"):
        r = httpx.head(server.url(path))
        assert r.status_code == 200 and r.content == b""
    assert httpx.head(server.url("/v1/completions")).status_code == 405


def test_impossible_alternatives_are_sent_as_minus_9999(server):
    """top-k 2 with 5 alternatives: the 3 outside the sampling distribution are -inf, sent
    as -9999.0 (JSON has no infinity)."""
    r = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=5,
        seed=1, extra_body={"smc": {"method": "ar"}, "top_k": 2},
    )  # fmt: skip
    for e in r.choices[0].logprobs.content:
        assert [t.logprob for t in e.top_logprobs][2:] == [NEG_INF_LOGPROB] * 3


def test_stream_timing_in_the_stats_and_metrics(server):
    """Each choice's ``smcspec`` carries its time to first token and longest gap between
    streamed tokens; ``/metrics`` counts both by method."""
    before = server.metrics()
    for method in ("ar", "smc"):
        stream = server.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=10, seed=3, stream=True,
            extra_body={**smc(method), "ignore_eos": True},
        )  # fmt: skip
        last = [c for chunk in stream for c in chunk.choices if c.finish_reason][0]
        extra = last.model_extra["smcspec"]
        assert 0 < extra["time_to_first_token_s"] and extra["max_token_gap_s"] >= 0
    after = server.metrics()
    for method in ("ar", "smc"):
        for name in ("smcspec_max_token_gap_seconds_count",
                     "smcspec_method_time_to_first_token_seconds_count"):  # fmt: skip
            key = name + json.dumps({"method": method})
            assert after[key] - before.get(key, 0) >= 1, key
