"""Function tools and the constraint that makes a model's tool calls valid.

OpenAI's ``tools`` / ``tool_choice`` (Chat Completions API) become a :class:`ToolCalls`
constraint: a Lark grammar, compiled by llguidance like every other constraint
(:mod:`smcspec.potentials`), whose language is the chat template's tool-call form with the
function ``name`` limited to the offered tools and ``arguments`` to each tool's JSON schema.

The form is the one Qwen2.5's template (and the Hermes templates it follows) renders for an
assistant's ``tool_calls``::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``<tool_call>`` and ``</tool_call>`` are single tokens of those vocabularies, which
llguidance treats as special tokens, so ordinary text (``TEXT``) can never contain them.
Arguments use the separators of the template's ``tojson`` (``", "`` and ``": "``, no other
whitespace), the text the model saw in training.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from smcspec.errors import ConfigError
from smcspec.potentials import (
    JSON_WHITESPACE,
    Constraint,
    GrammarBudget,
    TokenConstraint,
    check_schema_depth,
    grammar_from,
)

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
CALL_HEAD = '\n{"name": "'
ARGS_HEAD = '", "arguments": '
CALL_TAIL = "}\n"
CALL_SEPARATOR = "\n"
"""The call form: ``CALL_OPEN + CALL_HEAD + name + ARGS_HEAD + arguments + CALL_TAIL +
CALL_CLOSE``, calls joined by ``CALL_SEPARATOR`` (what Qwen2.5's template renders)."""

ARGUMENT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options for arguments: ``json.dumps``'s separators, as ``tojson`` writes."""

NAME_RE = r"[A-Za-z0-9_-]{1,64}"  # OpenAI's rule for function names
NAME_PATTERN = re.compile(f"^{NAME_RE}$")
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class FunctionTool:
    """One function the model may call.

    Attributes:
        name: ``[A-Za-z0-9_-]{1,64}`` (OpenAI's rule).
        description: shown to the model through the chat template.
        parameters: a JSON schema of an object (the arguments); ``{}`` means no arguments.
    """

    name: str
    description: str = ""
    parameters: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_PATTERN.match(self.name):
            raise ConfigError(
                f"function name {self.name!r} must be 1-64 letters, digits, '_' or '-'"
            )
        if not isinstance(self.parameters, dict):
            raise ConfigError(f"parameters of {self.name!r} must be a JSON schema object")
        check_schema_depth(self.parameters, f"the parameters of {self.name!r}")
        kind = self.parameters.get("type", "object")
        if kind != "object":
            raise ConfigError(
                f"parameters of {self.name!r} must describe an object (type 'object'), "
                f"got type {kind!r}"
            )

    @classmethod
    def from_openai(cls, tool: Any) -> FunctionTool:
        """From one entry of OpenAI's ``tools``: ``{"type": "function", "function": {"name",
        "description", "parameters", "strict"}}``. Raises :class:`ConfigError`."""
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ConfigError("each tool must be {'type': 'function', 'function': {...}}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ConfigError("a tool's 'function' must be an object with a 'name'")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ConfigError(f"the description of {fn.get('name')!r} must be a string")
        params = fn.get("parameters")
        return cls(fn.get("name"), description, {} if params is None else params)

    def arguments_schema(self, index: int = 0) -> dict:
        """The arguments' schema as compiled: an object, json.dumps separators, and a
        resource of its own (:func:`own_root`, ``index``: the tool's place in its set), so
        that its ``$ref``s mean what they mean in the tool's schema alone wherever the
        grammar puts it (inside the schema of a fenced call under ``auto``)."""
        schema = {"type": "object", **self.parameters}
        if "properties" not in schema and "additionalProperties" not in schema:
            schema["properties"] = {}
        schema.setdefault("x-guidance", ARGUMENT_JSON)
        return own_root(schema, f"{TOOL_ID_PREFIX}{index}")

    def as_openai(self) -> dict:
        """The OpenAI-shaped entry, as chat templates expect it in ``tools``."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


TOOL_ID_PREFIX = "urn:smcspec:tool:"
"""The ``$id`` of tool ``i``'s arguments schema is this prefix and ``i``."""

DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Schema keywords whose values are JSON data, not schemas (a ``$ref`` key there is data)."""

NAMED_SCHEMAS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)
"""Schema keywords whose values map names (not keywords) to schemas."""


def own_root(schema: dict, uri: str) -> dict:
    """``schema`` as a JSON Schema resource of its own, identified by ``uri`` (its ``$id``).

    A ``$ref`` resolves against the base URI of the resource it sits in (JSON Schema 2020-12
    section 8.2.1; llguidance does so): a tool's ``"#/$defs/node"`` or ``"#"``, nested under
    another schema's ``properties``, would otherwise point into that outer schema. The
    tool's own root ``$id``, if any, is replaced (two tools with the same one would share a
    base: the later one's root would answer both), and refs that named it
    (``"ID#/$defs/x"``, ``"ID"``) become local ones; nested resources keep theirs.
    """
    own = schema.get("$id")
    out = {**schema, "$id": uri}
    if isinstance(own, str) and own:
        out = _rebase_refs(out, own.removesuffix("#"))
    return out


def _rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with every ``$ref`` that starts with ``base`` followed by ``#`` (or is
    ``base``) made local (``#...``). Recursion bounded by the schema's checked depth
    (:data:`~smcspec.potentials.MAX_SCHEMA_DEPTH`)."""
    if isinstance(schema, list):
        return [_rebase_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.split("#", 1)[0] == base:
            out[key] = "#" + value.partition("#")[2]
        elif key in DATA_KEYWORDS:
            out[key] = value
        elif key in NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _rebase_refs(sub, base) for name, sub in value.items()}
        else:
            out[key] = _rebase_refs(value, base)
    return out


FENCE_OPEN = "```json\n"
FENCE_CLOSE = "\n```"
"""The other forms ``auto`` reads as a call: a reply that opens with a Markdown ``json`` block
holding ``{"name": ..., "arguments": ...}`` (what the default 1.5B Coder target writes when
it wants a tool: it almost never writes ``<tool_call>`` on its own), or that is that object
alone, bare (the next most frequent: 3 of 40 auto replies in
``docs/benchmarks/tool-calls-cpu/``, two of them with doubled braces that were no JSON)."""


def fenced_schema(tools: Sequence[FunctionTool]) -> dict:
    """JSON schema of a call in a ``json`` block: ``name`` first, one of the tools, and that
    tool's ``arguments``; whitespace bounded as :class:`~smcspec.potentials.JsonSchema`'s."""
    calls = []
    for i, tool in enumerate(tools):
        args = {k: v for k, v in tool.arguments_schema(i).items() if k != "x-guidance"}
        calls.append({
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": args},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })  # fmt: skip
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: double quotes, JSON escapes


@dataclass(frozen=True)
class ToolCalls(Constraint):
    """The output constraint of a request with tools (see the module docstring).

    Attributes:
        tools: the offered functions (unique names, at least one).
        choice: ``"none"`` (text only), ``"auto"`` (text, or text then calls: once the model
            writes ``<tool_call>`` the call must be valid; or one call as a ``json`` block
            opening the reply, :data:`FENCE_OPEN`, or as the reply's only content, a bare
            JSON object), ``"required"`` (calls only) or a
            function's name (exactly one call of it).
        parallel: whether several calls may follow each other (``parallel_tool_calls``).

    Raises:
        ConfigError: no tools, duplicate names, an unknown choice or function name.
    """

    tools: tuple[FunctionTool, ...]
    choice: str = "auto"
    parallel: bool = True

    def __post_init__(self) -> None:
        if not self.tools:
            raise ConfigError("tool calls need at least one tool")
        names = [t.name for t in self.tools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"tool names must be unique; {dup[0]!r} appears twice")
        if self.choice not in TOOL_CHOICES and self.choice not in names:
            raise ConfigError(
                f"tool_choice {self.choice!r} is neither one of {', '.join(TOOL_CHOICES)} "
                f"nor an offered function ({', '.join(names)})"
            )

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none"

    def grammar(self) -> str:
        """llguidance's Lark grammar (``<tool_call>`` written as a special token)."""
        tools = self.tools
        if self.choice not in TOOL_CHOICES:  # one named function, one call
            tools = tuple(t for t in tools if t.name == self.choice)
        if self.choice == "auto":  # text, calls, or one call in a ```json block or bare
            lines = [
                "start: TEXT | TEXT? calls | FENCE fenced FENCE_END | fenced",
                # a reply opening a json block or a JSON object is a call
                "TEXT: /(?s:.+)/ & ~/(?s:(```json|\\{).*)/",
                f"FENCE: {_literal(FENCE_OPEN)}",
                f"FENCE_END: {_literal(FENCE_CLOSE)}",
                f"fenced: %json {json.dumps(fenced_schema(tools))}",
            ]
        else:
            start = "TEXT" if self.choice == "none" else "calls"
            lines = [f"start: {start}", "TEXT: /(?s:.+)/"]
        many = self.parallel and self.choice in ("auto", "required")
        sep = _literal(CALL_SEPARATOR)
        # a newline may end the calls (the model ends "</tool_call>\n<|im_end|>")
        lines.append(f"calls: call ({sep} call)* {sep}?" if many else f"calls: call {sep}?")
        lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
        for i, tool in enumerate(tools):
            head = _literal(CALL_HEAD + tool.name + ARGS_HEAD)
            lines.append(
                f"call_{i}: {CALL_OPEN} {head} args_{i} {_literal(CALL_TAIL)} {CALL_CLOSE}"
            )
            lines.append(f"args_{i}: %json {json.dumps(tool.arguments_schema(i))}")
        return grammar_from("lark", "\n".join(lines) + "\n")

    def compile(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: Sequence[int],
        budget: GrammarBudget | None = None,
    ) -> TokenConstraint:
        """As :meth:`Constraint.compile` (within ``budget``); first checks that the
        vocabulary has the call markers as single tokens. Raises :class:`ConfigError` (with
        llguidance's message for a schema it cannot compile; a
        :class:`~smcspec.potentials.GrammarBudgetError` past the budget)."""
        check_call_tokens(tokenizer)
        return super().compile(tokenizer, vocab_size, stop_ids, budget)

    def template_tools(self) -> list[dict]:
        """``tools`` for the chat template (OpenAI-shaped entries)."""
        return [t.as_openai() for t in self.tools]


def check_call_tokens(tokenizer: Any) -> None:
    """Raises :class:`ConfigError` unless ``<tool_call>`` and ``</tool_call>`` are single
    added tokens of ``tokenizer`` (the grammar writes them as special tokens)."""
    added = {t.content for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()}
    missing = [m for m in (CALL_OPEN, CALL_CLOSE) if m not in added]
    if missing:
        raise ConfigError(
            f"this model's vocabulary has no {missing[0]} token: smcspec writes tool calls in "
            "the <tool_call> JSON form of Qwen2.5 and Hermes templates"
        )
