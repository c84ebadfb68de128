"""Tool calling through the OpenAI-compatible server on the real default pair, driven by the
real ``openai`` client: a weather-and-calculator toolset, every method, streamed and not.
The session's one server of the real pair (``real_server``, tests/conftest.py) serves them;
each test sends its own requests.

Every returned call must parse and validate against its function's schema (``jsonschema_rs``).
"""

from __future__ import annotations

import json

import jsonschema_rs
import pytest
from live_server import chat_tool_calls, chat_turn

pytestmark = [pytest.mark.slow, pytest.mark.real_pair]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
CALCULATOR = {
    "type": "object",
    "properties": {"expression": {"type": "string", "maxLength": 40}},
    "required": ["expression"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression",
            "parameters": CALCULATOR,
        },
    },
]
SCHEMAS = {"get_weather": WEATHER, "calculator": CALCULATOR}


@pytest.fixture
def server(real_server):
    """The session's server of the real pair (64 new tokens by default)."""
    return real_server


def _valid(name: str, arguments: str) -> dict:
    assert name in SCHEMAS, name
    args = json.loads(arguments)
    jsonschema_rs.validate(SCHEMAS[name], args)  # raises ValidationError
    return args


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_required_gives_a_valid_call(server, method):
    r = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "What is the weather like in Paris right now?"}],
        tools=TOOLS,
        tool_choice="required",
        temperature=0.7,
        seed=1,
        extra_body={"smc": {"method": method}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        _valid(call.function.name, call.function.arguments)
    assert r.usage.completion_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_inside_a_call_does_not_break_it(server, stream):
    """Once "stop": ["Paris"] returned arguments '{"city": "' (not JSON): stop strings now
    cut free text only, never a call. Stop strings every call holds (its key, '":', "}")
    are tested on the tiny tool server (tests/test_server_constraints.py)."""
    reason, calls = chat_tool_calls(
        server.client(), stream, model=server.model,
        messages=[{"role": "user", "content": "What is the weather like in Paris right now?"}],
        tools=TOOLS, tool_choice="required", temperature=0.7, seed=1, stop=["Paris"],
    )  # fmt: skip
    assert reason == "tool_calls" and calls
    for name, arguments in calls:
        _valid(name, arguments)
    assert any("Paris" in arguments for _, arguments in calls)  # the stop string was in it


def test_a_named_function_gives_one_call_of_it(server):
    r = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "What is 17 times 23?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "calculator"}},
        seed=2,
    )
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "calculator"
    _valid("calculator", calls[0].function.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_calls_a_tool_when_the_question_needs_one(server, stream):
    """The 1.5B target writes its call as a json block; auto reads it as a call, valid."""
    kwargs = dict(
        messages=[{"role": "user", "content": "What's the weather like in Paris today?"}],
        tools=TOOLS, seed=1, temperature=0.7,
    )  # fmt: skip
    turn = chat_turn(server.client(), stream, model=server.model, **kwargs)
    finish, content, calls = turn.finish_reason, turn.content, turn.calls
    assert finish == "tool_calls" and content is None and len(calls) == 1, (content, calls)
    assert calls[0]["name"] == "get_weather"
    assert _valid("get_weather", calls[0]["arguments"])["city"] == "Paris"


def test_auto_answers_in_text_when_no_tool_is_needed(server):
    """24 tokens: a call would begin within them (``<tool_call>`` or a json block)."""
    r = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        tools=TOOLS,
        seed=0,
        max_tokens=24,
    )
    choice = r.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
    assert choice.message.content and "<tool_call>" not in choice.message.content


def test_a_two_turn_agent_loop(server):
    """Turn 1: a call (``required``: the 1.5B target rarely starts a call by itself); the
    client runs it and sends the result back; turn 2 (``auto``) answers in text (its first
    16 tokens: the loop's second request is what is checked, not the answer's length).
    Streamed: the loop not streamed, and streamed again, on the tiny tool pair
    (tests/test_server_constraints.py), the real template's calls not streamed above."""
    client, stream = server.client(), True
    messages = [{"role": "user", "content": "What is 17 times 23? Use the calculator."}]
    turn = {"messages": messages, "tools": TOOLS, "seed": 3}
    first = chat_turn(client, stream, model=server.model, tool_choice="required", **turn)
    calls = first.calls
    assert first.finish_reason == "tool_calls" and first.content is None and calls
    for c in calls:
        _valid(c["name"], c["arguments"])
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls
            ],
        }
    )
    for c in calls:
        result = "391" if c["name"] == "calculator" else "12 degrees celsius, sunny"
        messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    second = chat_turn(client, stream, model=server.model, max_tokens=16, **turn)
    assert second.finish_reason in ("stop", "length", "tool_calls")
    assert second.content or second.calls  # an answer, or (model's choice) another valid call
    for c in second.calls:
        _valid(c["name"], c["arguments"])
