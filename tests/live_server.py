"""A real uvicorn server on a free loopback port, in a background thread (for server tests)."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn serving ``app`` on a free loopback port, in a background thread."""

    def __init__(self, app, api_key: str | None = None) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(self.url("/health"), timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("server did not start")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def client(self, timeout: float = 120) -> openai.OpenAI:
        """An openai client of this server, without retries; ``timeout`` in seconds."""
        return openai.OpenAI(
            base_url=self.url("/v1"), api_key=self.api_key or "none", max_retries=0, timeout=timeout
        )

    def metrics(self) -> dict[str, float]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        text = httpx.get(self.url("/metrics"), headers=headers).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
                out[key] = s.value
        return out

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@dataclass
class ChatTurn:
    """One chat completion's first choice: its text (None when empty), its tool calls
    (``{"id", "name", "arguments"}`` each, in order) and its finish reason."""

    content: str | None
    calls: list[dict[str, str]]
    finish_reason: str | None


def chat_turn(client: openai.OpenAI, stream: bool, **kwargs) -> ChatTurn:
    """One chat completion through ``client``, streamed or not; a stream's text joined and
    its call fragments joined by their index (a call's first delta must carry its id and
    name, once)."""
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]  # fmt: skip
        return ChatTurn(choice.message.content, calls, choice.finish_reason)
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reason = c.finish_reason or reason
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.id is not None:  # the first delta of a call: id, type and name
                    assert tc.index not in calls and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    return ChatTurn(content or None, [calls[i] for i in sorted(calls)], reason)


def chat_tool_calls(
    client: openai.OpenAI, stream: bool, **kwargs
) -> tuple[str | None, list[tuple[str, str]]]:
    """:func:`chat_turn`'s ``(finish_reason, [(name, arguments), ...])``."""
    turn = chat_turn(client, stream, **kwargs)
    return turn.finish_reason, [(c["name"], c["arguments"]) for c in turn.calls]
