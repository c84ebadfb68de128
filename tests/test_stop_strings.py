"""The stop-string rule: stop strings cut free text only, never a constrained span.

A tool call (and an output under ``response_format``, ``smc.regex`` or ``smc.grammar``) is
either complete or cut by ``max_tokens``: a stop string inside it does not end the reply.
:class:`~smcspec.server.streaming.ResponseChoice` is driven with the exact text a model writes, in
every split into streamed pieces; the server path runs on the tiny torch pair.
"""

from __future__ import annotations

import json

import httpx
import pytest
from live_server import Server
from tiny_models import make_tiny_chat_pair

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.server import create_app
from smcspec.server.streaming import ResponseChoice

PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _run(text: str, stops: list[str], tools: bool = True, stops_apply: bool = True,
         step: int = 1) -> tuple[ResponseChoice, list[dict]]:  # fmt: skip
    """Feed ``text`` in pieces of ``step`` characters, then end it."""
    c = ResponseChoice(0, stops, tools=tools, stops_apply=stops_apply)
    deltas: list[dict] = []
    for i in range(0, len(text), step):
        deltas += c.feed(text[i : i + step])
        if c.stopped:
            break
    deltas += c.feed("", final=True)
    return c, deltas


def _streamed_arguments(deltas: list[dict]) -> str:
    return "".join(
        tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", [])
    )


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
@pytest.mark.parametrize("stop", ["Paris", '": "', "}", "</tool_call>", "<tool_call>", "\n"])
def test_a_stop_string_inside_a_call_does_not_cut_it(stop, step):
    c, deltas = _run(PARIS, [stop], step=step)
    assert not c.stopped
    msg = c.message()
    assert msg["content"] is None
    (call,) = msg["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert _streamed_arguments(deltas) == call["function"]["arguments"]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_stop_string_in_content_before_a_call_ends_the_reply_there(step):
    c, deltas = _run("Let me check Paris. " + PARIS, ["Paris"], step=step)
    assert c.stopped and c.finish_reason() == "stop"
    assert c.message() == {"role": "assistant", "content": "Let me check "}
    assert not any("tool_calls" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == "Let me check "


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_content_after_a_complete_call_is_cut_by_a_stop_string(step):
    c, _ = _run(PARIS + "\nDone. Paris is nice.", ["Paris"], step=step)
    assert c.stopped
    msg = c.message()
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert msg["content"] == "\nDone. "


@pytest.mark.parametrize("step", [1, 1000])
def test_a_stop_string_cannot_span_content_and_a_call(step):
    """'text<tool_call>' with the stop 'text<tool' must not match across the call's start."""
    c, _ = _run("hello " + PARIS, ["hello <tool"], step=step)
    assert not c.stopped
    assert c.message()["tool_calls"] and c.message()["content"] == "hello"


def test_without_tools_stop_strings_cut_as_before():
    c, deltas = _run("one two three", ["two"], tools=False, step=2)
    assert c.stopped and c.text == "one " and "".join(d["content"] for d in deltas) == "one "


def test_under_a_constraint_stop_strings_never_cut():
    c, _ = _run('{"a": "b"}', ['"'], tools=False, stops_apply=False)
    assert not c.stopped and c.text == '{"a": "b"}'


# ---------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    dirs = make_tiny_chat_pair(tmp_path_factory.mktemp("stops"), max_position_embeddings=96)
    engine = Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))
    srv = Server(create_app(engine, GenerationConfig(max_new_tokens=12), model_name="tiny"))
    yield srv
    srv.stop()


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_regex_output_is_not_cut_by_a_stop_string_it_contains(server, method, stream):
    """The regex forces 'ab cd'; the stop string 'b' inside it must not cut it."""
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 12, "stop": ["b"], "stream": stream,
            "smc": {"method": method, "regex": "ab cd"}, "seed": 3}  # fmt: skip
    if not stream:
        r = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("ab cd", "stop")
        return
    text = ""
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == "ab cd"


def test_without_a_constraint_a_stop_string_cuts(server):
    """The greedy reply without a stop, then with its own third character as the stop."""
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 12, "temperature": 0,
            "smc": {"method": "ar"}}  # fmt: skip
    url = server.url("/v1/completions")
    full = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    assert len(full) >= 3, full
    stop = full[2]
    cut = httpx.post(url, json={**body, "stop": [stop]}, timeout=60).json()["choices"][0]
    assert cut["text"] == full[: full.index(stop)] and cut["finish_reason"] == "stop"
