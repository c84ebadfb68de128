"""Per-choice text handling and the OpenAI response objects, streamed and whole.

:class:`StopMatcher` cuts text at stop strings; :class:`Choice` is one of a request's ``n``
generated sequences; the ``*_object`` functions build OpenAI's completion and chunk bodies.
"""

from __future__ import annotations

import json
from typing import Any

from smcspec.engine import GenerationResult
from smcspec.scheduler import Request as EngineRequest


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
    """One generated sequence of a request: engine request, text, stop handling, outcome."""

    def __init__(self, index: int, stops: list[str]) -> None:
        self.index = index
        self.matcher = StopMatcher(stops)
        self.engine_req: EngineRequest | None = None
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.cancelled = False

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
        """``stop`` (a stop string, EOS or end of turn) or ``length`` (max_tokens reached)."""
        if self.matcher.stopped or self.result is None:
            return "stop"
        return self.result.finish_reason


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
        entry["message"] = {"role": "assistant", "content": c.matcher.text}
    else:
        entry["text"], entry["logprobs"] = c.matcher.text, None
    return entry


def chunk_choice(
    c: Choice, chat: bool, text: str | None, reason: str | None, first: bool = False
) -> dict[str, Any]:
    """A choice of a streamed chunk: a ``delta`` (chat) or ``text`` (completions)."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        return {"index": c.index, "delta": delta, "finish_reason": reason}
    return {"index": c.index, "text": text or "", "finish_reason": reason, "logprobs": None}
