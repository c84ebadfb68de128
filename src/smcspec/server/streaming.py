"""Per-choice text handling and the OpenAI response objects, streamed and whole.

:class:`StopMatcher` cuts text at stop strings; :class:`ResponseChoice` is one of a request's ``n``
generated sequences (stop strings apply to its free text, never inside a tool call or a
constrained output); the ``*_object`` functions build OpenAI's completion and chunk bodies.
"""

from __future__ import annotations

import json
from typing import Any

from smcspec.decoding.logprobs import TokenLogprobs
from smcspec.engine import GenerationResult
from smcspec.scheduler import Request as EngineRequest
from smcspec.tool_calls import ArgumentsDelta, CallStart, ContentDelta, ToolCall, ToolCallParser


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


class ResponseChoice:
    """One generated sequence of a request: engine request, text, stop handling, outcome.

    Stop strings apply to free text only, never inside a constrained span: with ``tools``
    the text first goes through a :class:`~smcspec.tool_calls.ToolCallParser`, and only its
    content (not a call) is matched against the stop strings; a stop string cannot span a
    call. With ``stops_apply`` false (an output under ``response_format``, ``smc.regex`` or
    ``smc.grammar``, which is constrained from its first token to its last) they never cut.
    So a call or a constrained output is either complete or cut by ``max_tokens``
    (``finish_reason`` ``length``).
    """

    def __init__(
        self, index: int, stops: list[str], tools: bool = False, stops_apply: bool = True
    ) -> None:
        self.index = index
        self.prompt_index = 0  # which prompt of the request (completions: one or several)
        self.echo: str | None = None  # completions' echo: the prompt's text, sent first
        self.logprobs: list[TokenLogprobs] = []  # each token's, as it arrives (if asked)
        self.logprobs_sent = 0  # how many of them a stream's chunks have carried
        self.prompt_logprobs: TokenLogprobs | None = None  # echo with logprobs
        self.chars_sent = 0  # characters of text a stream has sent (completions' offsets)
        self.stops = stops if stops_apply else []
        self.matcher = StopMatcher(self.stops)
        self.parser = ToolCallParser() if tools else None
        self.calls: list[ToolCall] = []  # the calls sent to the client
        self.content: list[str] = []  # the free text sent to the client
        self.engine_req: EngineRequest | None = None
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.cancelled = False

    def add_logprobs(self, entry: TokenLogprobs) -> None:
        """A generated token's log-probabilities, before its text arrives; dropped once a
        stop string has ended the reply (so the values cover the tokens up to the one that
        completed it)."""
        if not self.stopped:
            self.logprobs.append(entry)

    def take_logprobs(self) -> list[TokenLogprobs]:
        """The entries no stream chunk has carried yet (then marked carried)."""
        out = self.logprobs[self.logprobs_sent :]
        self.logprobs_sent = len(self.logprobs)
        return out

    @property
    def stopped(self) -> bool:
        """A stop string ended the reply (its free text is cut just before it)."""
        return self.matcher.stopped

    def feed(self, piece: str, final: bool = False) -> list[dict[str, Any]]:
        """Chat ``delta`` bodies for new generated text ``piece`` (``final``: the text has
        ended): ``{"content"}``, and with tools the ``tool_calls`` fragments (id, type and
        name first, then arguments). Nothing once a stop string has matched."""
        if self.stopped:
            return []
        if self.parser is None:
            return self._content(self.matcher.feed(piece, final))
        events = self.parser.feed(piece) + (self.parser.finish() if final else [])
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, ContentDelta):
                out += self._content(self.matcher.feed(event.text))
                if self.stopped:
                    return out  # what followed the stop string is dropped
                continue
            if isinstance(event, CallStart):  # the content before the call is complete
                out += self._content(self.matcher.feed("", final=True))
                self.matcher = StopMatcher(self.stops)
                self.calls.append(event.call)
            out.append(_delta(event))
        if final:
            out += self._content(self.matcher.feed("", final=True))
        return out

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.content.append(text)
        return [{"content": text}]

    @property
    def text(self) -> str:
        """The free text sent so far (the whole reply's text without tools)."""
        return "".join(self.content)

    @property
    def open(self) -> bool:
        """Still decoding: no result, no error, not stopped by a stop string, not cancelled."""
        done = self.result is not None or self.error is not None
        return not (done or self.stopped or self.cancelled)

    def finish_reason(self) -> str:
        """``stop`` (a stop string, EOS or end of turn), ``length`` (max_tokens reached) or
        ``tool_calls`` (ended after complete tool calls)."""
        if self.stopped or self.result is None:
            return "stop"
        calls = self.calls
        if self.result.finish_reason == "stop" and calls and all(c.complete for c in calls):
            return "tool_calls"
        return self.result.finish_reason

    def message(self) -> dict[str, Any]:
        """The whole reply's assistant message (after the last :meth:`feed`): with tools,
        ``content`` is None when the reply holds only calls (or whitespace beside them)."""
        text = self.text
        if self.parser is None:
            return {"role": "assistant", "content": text}
        content = text if text.strip() or (text and not self.calls) else None
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if self.calls:
            out["tool_calls"] = [c.as_openai() for c in self.calls]
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


def choice_object(
    c: ResponseChoice, chat: bool, extra: dict[str, Any], logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A choice of a whole (non-streamed) response (``logprobs``: its OpenAI-shaped
    log-probabilities, :mod:`smcspec.server.logprobs`, or None when not asked for)."""
    entry: dict[str, Any] = {
        "index": c.index,
        "finish_reason": c.finish_reason(),
        "smcspec": extra,
        "logprobs": logprobs,
    }
    if chat:
        entry["message"] = c.message()
    else:
        entry["text"] = (c.echo or "") + c.text
    return entry


def chunk_choice(
    c: ResponseChoice,
    chat: bool,
    text: str | None,
    reason: str | None,
    first: bool = False,
    delta: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A choice of a streamed chunk: a ``delta`` (chat; ``delta`` given, or content
    ``text``) or ``text`` (completions), with the log-probabilities of the tokens it
    carries (None when not asked for, or none arrived)."""
    if chat:
        body: dict[str, Any] = {"role": "assistant"} if first else {}
        if delta is not None:
            body.update(delta)
        elif text:
            body["content"] = text
        return {"index": c.index, "delta": body, "logprobs": logprobs, "finish_reason": reason}
    return {"index": c.index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
