"""Per-choice text handling and the OpenAI response objects, streamed and whole.

:class:`StopMatcher` cuts text at stop strings; :class:`Choice` is one of a request's ``n``
generated sequences; the ``*_object`` functions build OpenAI's completion and chunk bodies.
"""

from __future__ import annotations

import json
from typing import Any

from smcspec.engine import GenerationResult
from smcspec.scheduler import Request as EngineRequest
from smcspec.tool_calls import ArgumentsDelta, CallStart, ContentDelta, ToolCallParser


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back possible partial matches."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, piece: str, final: bool = False) -> str:
        """Add ``piece``; returns the text that can be sent now."""
        if self.stopped:
            return ""
        self.text += piece
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            final = True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : end], end
        return out


class Choice:
    """One generated sequence of a request: engine request, text, stop handling, outcome.

    With ``tools``, the text (after stop strings) also goes through a
    :class:`~smcspec.tool_calls.ToolCallParser` that splits it into content and calls.
    """

    def __init__(self, index: int, stops: list[str], tools: bool = False) -> None:
        self.index = index
        self.matcher = StopMatcher(stops)
        self.parser = ToolCallParser() if tools else None
        self.engine_req: EngineRequest | None = None
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.cancelled = False

    def deltas(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """Chat ``delta`` bodies for new ``text``: ``{"content"}``, or with tools the
        content and ``tool_calls`` fragments (id, type and name first, then arguments)."""
        if self.parser is None:
            return [{"content": text}] if text else []
        events = self.parser.feed(text) + (self.parser.finish() if final else [])
        return [_delta(e) for e in events]

    @property
    def open(self) -> bool:
        """Still decoding: no result, no error, not stopped by a stop string, not cancelled."""
        return (
            self.result is None
            and self.error is None
            and not self.matcher.stopped
            and not self.cancelled
        )

    def finish_reason(self) -> str:
        """``stop`` (a stop string, EOS or end of turn), ``length`` (max_tokens reached) or
        ``tool_calls`` (ended after complete tool calls)."""
        if self.matcher.stopped or self.result is None:
            return "stop"
        calls = self.parser.calls if self.parser is not None else []
        if self.result.finish_reason == "stop" and calls and all(c.complete for c in calls):
            return "tool_calls"
        return self.result.finish_reason

    def message(self) -> dict[str, Any]:
        """The whole reply's assistant message (after the last :meth:`deltas`)."""
        if self.parser is None:
            return {"role": "assistant", "content": self.matcher.text}
        out: dict[str, Any] = {"role": "assistant", "content": self.parser.content}
        if self.parser.calls:
            out["tool_calls"] = [c.as_openai() for c in self.parser.calls]
        return out


def _delta(event: ContentDelta | CallStart | ArgumentsDelta) -> dict[str, Any]:
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, CallStart):
        call = event.call
        entry = {
            "index": event.index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        return {"tool_calls": [entry]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event line (``data: ...`` and a blank line)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def choice_object(c: Choice, chat: bool, extra: dict[str, Any]) -> dict[str, Any]:
    """A choice of a whole (non-streamed) response."""
    entry: dict[str, Any] = {
        "index": c.index,
        "finish_reason": c.finish_reason(),
        "smcspec": extra,
    }
    if chat:
        entry["message"] = c.message()
    else:
        entry["text"], entry["logprobs"] = c.matcher.text, None
    return entry


def chunk_choice(
    c: Choice,
    chat: bool,
    text: str | None,
    reason: str | None,
    first: bool = False,
    delta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A choice of a streamed chunk: a ``delta`` (chat; ``delta`` given, or content
    ``text``) or ``text`` (completions)."""
    if chat:
        body: dict[str, Any] = {"role": "assistant"} if first else {}
        if delta is not None:
            body.update(delta)
        elif text:
            body["content"] = text
        return {"index": c.index, "delta": body, "finish_reason": reason}
    return {"index": c.index, "text": text or "", "finish_reason": reason, "logprobs": None}
