"""Generated text -> assistant content and tool calls, as the text streams in.

The grammar of :class:`~smcspec.tool_calls.spec.ToolCalls` fixes the form of a call, so
reading it back is exact, with no guessing: content is the text before the first
``<tool_call>``; each call is ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``
and its ``arguments`` are the text of ARGS (a JSON object: it holds no raw newline, so the
first ``}\\n</tool_call>`` after it ends the call). A call cut short (``max_tokens``, a stop
string) keeps the arguments written so far, one cut before its name is dropped; its choice
ends with ``finish_reason`` ``length`` or ``stop``, never ``tool_calls``.

``auto``'s other forms, one call as a ``json`` block opening the reply (``FENCE_OPEN`` JSON
``FENCE_CLOSE``) or as a bare JSON object that is the whole reply, are read when the block
closes or the reply ends (the arguments arrive in one delta); one cut short, or that is no
call, stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from smcspec.tool_calls.spec import (
    ARGS_HEAD,
    CALL_CLOSE,
    CALL_HEAD,
    CALL_OPEN,
    CALL_TAIL,
    FENCE_CLOSE,
    FENCE_OPEN,
    NAME_PATTERN,
    NAME_RE,
)

_HEAD = re.compile(re.escape(CALL_OPEN + CALL_HEAD) + f"({NAME_RE})" + re.escape(ARGS_HEAD))
_HEAD_MAX = len(CALL_OPEN + CALL_HEAD + ARGS_HEAD) + 64
_END = CALL_TAIL + CALL_CLOSE


@dataclass
class ToolCall:
    """One call: ``id`` (``call_...``), the function's ``name``, ``arguments`` as JSON text."""

    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def as_openai(self) -> dict:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        fn = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": fn}


@dataclass
class ContentDelta:
    """Reply text that is content (not part of a call)."""

    text: str


@dataclass
class CallStart:
    """Call ``index`` begins: its id and name are known, its arguments follow."""

    index: int
    call: ToolCall


@dataclass
class ArgumentsDelta:
    """A piece of call ``index``'s arguments (JSON text)."""

    index: int
    text: str


Event = ContentDelta | CallStart | ArgumentsDelta


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Splits streamed text into content and tool calls (see the module docstring).

    ``feed(text)`` returns the events that text completes; ``finish()`` the rest. After
    ``finish``, :attr:`content` (None when the reply was only calls or empty) and
    :attr:`calls` hold the whole reply.
    """

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._content: list[str] = []
        self._buf = ""
        self._state = "text"  # text | fenced | bare | head | args | between

    @property
    def content(self) -> str | None:
        """The reply's text outside the calls so far; None when there is none, or only
        whitespace beside calls (the ``content: null`` of a message that only calls tools)."""
        text = "".join(self._content)
        return text if text.strip() or (text and not self.calls) else None

    def _say(self, text: str, out: list[Event]) -> None:
        if text:
            self._content.append(text)
            out.append(ContentDelta(text))

    def feed(self, text: str) -> list[Event]:
        """Events completed by ``text`` (content is held back while it may be the start of
        a call, and trailing whitespace while a call may follow)."""
        self._buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def _step(self, out: list[Event]) -> bool:  # one transition; True if it made progress
        if self._state == "text" and not self._content and not self.calls:
            opened = self._step_opening()
            if opened is not None:
                return opened
        step = {
            "bare": lambda out: False,  # a bare call is the whole reply: read at the end
            "fenced": self._step_fenced,
            "text": self._step_text,
            "head": self._step_head,
            "args": self._step_args,
            "between": self._step_between,
        }[self._state]
        return step(out)

    def _step_opening(self) -> bool | None:
        """The reply's start under auto: a json block or a bare ``{`` opens a call; None
        when the reply is text (or may still become a block)."""
        buf = self._buf
        if buf.startswith(FENCE_OPEN):  # auto's other form: a call in a json block
            self._state = "fenced"
            return True
        if buf.startswith("{"):  # or a bare call, the whole reply: read at the end
            self._state = "bare"
            return False
        if FENCE_OPEN.startswith(buf):
            return False  # may still become one
        return None

    def _step_fenced(self, out: list[Event]) -> bool:
        buf = self._buf
        at = buf.find(FENCE_CLOSE, len(FENCE_OPEN))
        if at < 0:
            return False
        call = _fenced_call(buf[len(FENCE_OPEN) : at])
        if call is None:  # not a call after all (not from the grammar): text
            self._state = "text"
            self._say(buf[: at + len(FENCE_CLOSE)], out)
            self._buf = buf[at + len(FENCE_CLOSE) :]
            return True
        self._start_call(call[0], out)
        self._arguments(call[1], out)
        self.calls[-1].complete = True
        self._buf, self._state = buf[at + len(FENCE_CLOSE) :], "between"
        return True

    def _step_text(self, out: list[Event]) -> bool:
        buf = self._buf
        at = buf.find(CALL_OPEN)
        if at >= 0:
            self._say(buf[:at].rstrip() if not self.calls else buf[:at], out)
            self._buf, self._state = buf[at:], "head"
            return True
        before = buf[: len(buf) - _held_prefix(buf, CALL_OPEN)]
        keep = len(buf) - len(before.rstrip())  # a possible marker, the space before it
        self._say(buf[: len(buf) - keep], out)
        self._buf = buf[len(buf) - keep :]
        return False

    def _step_head(self, out: list[Event]) -> bool:
        buf = self._buf
        m = _HEAD.match(buf)
        if m:
            self._start_call(m.group(1), out)
            self._buf, self._state = buf[m.end() :], "args"
            return True
        if len(buf) > _HEAD_MAX:  # not a call after all: it is text
            self._say(buf[: len(CALL_OPEN)], out)
            self._buf, self._state = buf[len(CALL_OPEN) :], "text"
            return True
        return False

    def _step_args(self, out: list[Event]) -> bool:
        buf = self._buf
        at = buf.find(_END)
        upto = at if at >= 0 else len(buf) - _held_prefix(buf, _END)
        self._arguments(buf[:upto], out)
        if at >= 0:
            self.calls[-1].complete = True
            self._buf, self._state = buf[at + len(_END) :], "between"
            return True
        self._buf = buf[upto:]
        return False

    def _step_between(self, out: list[Event]) -> bool:
        """Between calls: whitespace, then another call or (not from the grammar) text."""
        buf = self._buf
        rest = buf.lstrip()
        if not rest:
            return False
        if CALL_OPEN.startswith(rest[: len(CALL_OPEN)]):
            if rest.startswith(CALL_OPEN):
                self._buf, self._state = rest, "head"
                return True
            return False
        self._buf, self._state = buf, "text"
        return True

    def _start_call(self, name: str, out: list[Event]) -> None:
        call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", name)
        self.calls.append(call)
        out.append(CallStart(len(self.calls) - 1, call))

    def _arguments(self, text: str, out: list[Event]) -> None:
        if text:
            self.calls[-1].arguments += text
            out.append(ArgumentsDelta(len(self.calls) - 1, text))

    def finish(self) -> list[Event]:
        """The events of what is still held back (the text has ended)."""
        out: list[Event] = []
        buf, self._buf = self._buf, ""
        call = _fenced_call(buf) if self._state == "bare" else None
        if call is not None:
            self._start_call(call[0], out)
            self._arguments(call[1], out)
            self.calls[-1].complete = True
        elif self._state in ("text", "fenced", "bare"):  # cut short or no call: text
            self._say(buf, out)
        elif self._state == "args":
            self._arguments(buf, out)
        self._state = "text"
        return out


def _fenced_call(text: str) -> tuple[str, str] | None:
    """``(name, arguments)`` of the call a json block holds (``{"name": str, "arguments":
    object}``), else None; arguments re-written with ``json.dumps``'s separators, as the
    template form has them."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than json allows
        return None
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
        return None
    name, args = obj["name"], obj["arguments"]
    if not isinstance(name, str) or not NAME_PATTERN.match(name) or not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a whole reply (see :class:`ToolCallParser`)."""
    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls
