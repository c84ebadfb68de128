"""Request bodies of the OpenAI-compatible endpoints (pydantic models).

Field names and meanings follow OpenAI's Completions and Chat Completions APIs. Fields that
OpenAI defines but smcspec cannot honour are declared so that a request which sets them to
anything but their neutral value is refused with 400 instead of being silently ignored
(:func:`unsupported_fields`); fields OpenAI does not define are ignored, as OpenAI clients
send extras such as ``user``. Fields OpenAI's request schemas make nullable may be sent as
``null`` (SDKs send explicit nulls) and then take their default (:data:`NULL_IS_DEFAULT`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from smcspec.config import GenerationConfig, field_type
from smcspec.errors import ConfigError
from smcspec.potentials import MAX_SCHEMA_DEPTH, Constraint, Grammar, JsonSchema, Regex, json_depth
from smcspec.tool_calls import FunctionTool, ToolCalls

# chat roles smcspec accepts; "developer" is OpenAI's newer name for "system"
ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI content-part types this text-only server refuses, and what they carry
_MEDIA_PARTS = {"image_url": "image", "input_image": "image", "input_audio": "audio",
                "file": "file", "input_file": "file"}  # fmt: skip


def _smc_options() -> type[BaseModel]:
    """The ``smc`` extra field: per-request decoder settings (server defaults otherwise). Its
    fields are the :class:`GenerationConfig` fields marked ``server`` (``config.py``), each
    optional, plus ``regex`` (the output must match this regular expression), ``grammar``
    (the output must follow this Lark grammar), ``aggregate`` (``"vote"``: the response also
    carries the weighted vote over the particles' answers) and ``answer_regex`` (a particle's
    answer for the vote: the last match, its first group if any; default the last number).
    Code rewards are not offered here: the server does not run code a client sends."""
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(GenerationConfig):
        if not f.metadata.get("server"):
            continue
        choices = f.metadata.get("server_choices")
        kind = Literal[choices] if choices else field_type(f)
        fields[f.name] = (kind | None, None)
    fields |= {"regex": (str | None, None), "grammar": (str | None, None)}
    fields |= {"aggregate": (Literal["none", "vote"] | None, None)}
    fields |= {"answer_regex": (str | None, None)}
    return create_model(
        "SmcOptions", __config__=ConfigDict(extra="forbid"), __doc__=_smc_options.__doc__, **fields
    )


SmcOptions = _smc_options()


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` adds a final chunk with token counts."""

    include_usage: bool = False


DOCUMENT_START = "<|endoftext|>"
"""OpenAI's default ``prompt``: the document separator (one special token in Qwen's and
GPT-2's vocabularies, plain text in others)."""

MAX_PROMPTS = 64
"""The most prompts one ``/v1/completions`` request may carry (an array of strings or of
token lists; each becomes ``n`` choices)."""

NULL_IS_DEFAULT = ("n", "stream", "prompt")
"""Fields OpenAI documents as nullable whose ``null`` smcspec replaces by the default (``n``
1, ``stream`` false, ``prompt`` :data:`DOCUMENT_START`, as OpenAI's API does); every other
nullable OpenAI field is declared ``X | None`` and None already means its default
(``max_tokens``, ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
``stream_options``, ``logprobs``, ``top_logprobs``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, ``best_of``, ``echo``, ``suffix``; and the extras
``ignore_eos``, ``min_tokens``, ``logprobs_mode``)."""


class CommonBody(BaseModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    smc: SmcOptions | None = None
    # extras that vLLM's server takes and its clients (aiperf, lm-eval) send
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    # smcspec's (named after vLLM's server option): the sampling distribution's values, or
    # the model's raw log_softmax
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] | None = None
    # OpenAI fields smcspec does not implement: refused unless neutral
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("n", "stream", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if value is None else value


class CompletionBody(CommonBody):
    """The body of ``/v1/completions``: the prompt as OpenAI allows it (a string, a list of
    token ids, a list of strings or a list of token-id lists; each prompt of a list gets its
    own ``n`` choices), ``logprobs`` (alternatives per token, 0 to 20) and ``echo``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    # smcspec extension: special-token text in a raw prompt becomes control tokens (true,
    # as llama.cpp's server and vLLM do) or is tokenized as text (false)
    parse_special_tokens: bool = True
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        """``null`` is OpenAI's default prompt; any other shape than OpenAI's four is refused
        in the client's terms, before the union's per-branch errors."""
        if prompt is None:
            return DOCUMENT_START
        if isinstance(prompt, str):
            return prompt
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(
                "prompt must be a string, a list of token ids, a list of strings or a list "
                "of token-id lists (not empty)"
            )
        if all(_is_token_id(t) for t in prompt):
            return prompt
        if len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts a request, got {len(prompt)}")
        texts = isinstance(prompt[0], str)
        for i, p in enumerate(prompt):
            tokens = isinstance(p, list) and bool(p) and all(_is_token_id(t) for t in p)
            if isinstance(p, str) if texts else tokens:
                continue
            kind = "a string" if texts else "a non-empty list of token ids (integers)"
            raise ValueError(
                f"prompt[{i}] must be {kind}, as prompt[0] is: a list of prompts holds strings "
                "only or token lists only"
            )
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a string or a token list (one for a single prompt)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class TextPart(BaseModel):
    """One part of a message's content given as a list (only text parts are supported)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCallIn(BaseModel):
    """An earlier call's function: its ``name`` and ``arguments`` (JSON text of an object)."""

    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str

    def parsed_arguments(self) -> dict[str, Any]:
        """The call's ``arguments`` string parsed as a JSON object.

        Raises:
            ValueError: not JSON (or nested deeper than ``json.loads`` recurses), JSON that
                is not an object, or nested deeper than :data:`MAX_SCHEMA_DEPTH` (what a
                tool's schema can ask for; the chat template and the special-token check
                recurse over it).
        """
        try:
            value = json.loads(self.arguments)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise ValueError(f"arguments of {self.name!r} are not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"arguments of {self.name!r} must be a JSON object")
        if json_depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"arguments of {self.name!r} nest deeper than {MAX_SCHEMA_DEPTH} levels"
            )
        return value


class ToolCallIn(BaseModel):
    """One call of an assistant message in the history (OpenAI's ``tool_calls`` entry)."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    """One message: ``content`` may be null only for an assistant message with
    ``tool_calls``; a ``tool`` message answers the call named by ``tool_call_id``."""

    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Content parts other than text (``image_url``, ``input_audio``, ``file``) are
        refused in the client's terms, before the union's per-branch errors."""
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in _MEDIA_PARTS:
                    raise ValueError(
                        f"{_MEDIA_PARTS[kind]} inputs ({kind!r} content parts) are not "
                        "supported by this model: send text parts only"
                    )
                if kind != "text":
                    raise ValueError(
                        f"content parts must be {{'type': 'text', 'text': ...}}, got type {kind!r}"
                    )
        return content

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
        return role

    @model_validator(mode="after")
    def _consistent(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only in an assistant message with tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        for call in self.tool_calls or []:
            call.function.parsed_arguments()  # raises for arguments that are not an object
        return self

    def as_template_message(self) -> dict[str, Any]:
        """The message for the chat template: text parts joined by newlines (as vLLM does),
        ``developer`` mapped to ``system``, null content as ``""``, and earlier calls'
        arguments parsed (templates render them with ``tojson``)."""
        content = self.content or ""
        if not isinstance(content, str):
            content = "\n".join(part.text for part in content)
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": content,
        }
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": c.function.parsed_arguments(),
                    },
                }
                for c in self.tool_calls
            ]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatBody(CommonBody):
    """The body of ``/v1/chat/completions``: the messages (tools in :class:`CommonBody`),
    ``logprobs`` (bool) and ``top_logprobs`` (0 to 20, with ``logprobs``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _tool_messages_answer_calls(self) -> ChatBody:
        """Each ``tool`` message must answer a call of the assistant message before it
        (directly, or after other tool messages answering the same turn)."""
        open_ids: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.role == "tool":
                if m.tool_call_id not in open_ids:
                    raise ValueError(
                        f"message {i} answers tool call {m.tool_call_id!r}, which the "
                        "assistant message before it did not make"
                    )
                continue
            open_ids = {c.id for c in m.tool_calls or []}
        return self


def constraint_spec(body: CommonBody) -> Constraint | None:
    """The request's output constraint: ``response_format`` ``json_object`` (any JSON
    object) or ``json_schema`` (``{"json_schema": {"schema": ...}}``), or the ``smc`` extras
    ``regex`` / ``grammar`` (Lark). At most one may be given.

    Raises:
        ConfigError: two constraints, a ``json_schema`` format without a schema, or a schema
            that is not an object (the pattern/grammar itself is checked when compiled).
    """
    found: list[Constraint] = []
    tools = tool_constraint(body)
    if tools is not None:
        found.append(tools)
    fmt = body.response_format or {}
    if fmt.get("type") == "json_object":
        found.append(JsonSchema({"type": "object"}))
    elif fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ConfigError("response_format json_schema needs json_schema.schema (an object)")
        found.append(JsonSchema(schema))
    if body.smc is not None and body.smc.regex is not None:
        found.append(Regex(body.smc.regex))
    if body.smc is not None and body.smc.grammar is not None:
        found.append(Grammar(body.smc.grammar))
    if len(found) > 1:
        raise ConfigError("give at most one of tools, response_format json, smc.regex, smc.grammar")
    return found[0] if found else None


def tool_constraint(body: CommonBody) -> ToolCalls | None:
    """The :class:`ToolCalls` constraint of a chat request with ``tools`` (None without).

    ``tool_choice``: ``none``, ``auto`` (the default with tools), ``required``, or
    ``{"type": "function", "function": {"name": ...}}``; ``parallel_tool_calls`` defaults to
    true, as OpenAI's does.

    Raises:
        ConfigError: a malformed tool or tool_choice, duplicate or unknown function names,
            a tool_choice that needs tools without any.
    """
    choice: Any = body.tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ConfigError(
                "tool_choice must be none, auto, required or "
                "{'type': 'function', 'function': {'name': ...}}"
            )
        choice = fn["name"]
    if not body.tools:
        if choice not in (None, "none"):
            raise ConfigError(f"tool_choice {choice!r} needs tools")
        return None
    tools = tuple(FunctionTool.from_openai(t) for t in body.tools)
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return ToolCalls(tools, choice or "auto", parallel)


def unsupported_fields(body: CommonBody) -> list[str]:
    """Names of OpenAI fields ``body`` sets to a value smcspec cannot honour."""
    bad = []
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            bad.append(name)
    if body.logit_bias:
        bad.append("logit_bias")
    fmt = body.response_format
    if fmt is not None and fmt.get("type") not in ("text", "json_object", "json_schema"):
        bad.append("response_format")
    if isinstance(body, CompletionBody):
        if body.tools:
            bad.append("tools")  # tools need the chat template: /v1/chat/completions
        if body.tool_choice not in (None, "none"):
            bad.append("tool_choice")
        if body.best_of not in (None, 1):
            bad.append("best_of")
        if body.suffix:
            bad.append("suffix")
    return bad
