"""A real uvicorn server on a free loopback port, in a background thread (for server tests)."""

from __future__ import annotations

import json
import socket
import threading
import time

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


def chat_tool_calls(
    client: openai.OpenAI, stream: bool, **kwargs
) -> tuple[str | None, list[tuple[str, str]]]:
    """One chat completion through ``client`` (streamed or not), as ``(finish_reason,
    [(name, arguments), ...])``: a stream's call fragments joined by their index."""
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.finish_reason, calls
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    reason = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reason = c.finish_reason or reason
            for tc in c.delta.tool_calls or []:
                if tc.function.name:
                    names[tc.index] = tc.function.name
                args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    return reason, [(names[i], args[i]) for i in sorted(names)]
