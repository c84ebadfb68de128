"""Request bodies of the OpenAI-compatible endpoints (pydantic models).

Field names and meanings follow OpenAI's Completions and Chat Completions APIs. Fields that
OpenAI defines but smcspec cannot honour are declared so that a request which sets them to
anything but their neutral value is refused with 400 instead of being silently ignored
(:func:`unsupported_fields`); fields OpenAI does not define are ignored, as OpenAI clients
send extras such as ``user``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from smcspec.errors import ConfigError
from smcspec.potentials import Constraint, Grammar, JsonSchema, Regex

# chat roles smcspec accepts; "developer" is OpenAI's newer name for "system"
ROLES = ("system", "developer", "user", "assistant")


class SmcOptions(BaseModel):
    """The ``smc`` extra field: per-request decoder settings (server defaults otherwise)."""

    model_config = ConfigDict(extra="forbid")
    method: Literal["smc", "sd", "ar"] | None = None
    particles: int | None = None
    draft_tokens: int | None = None
    draft_temperature: float | None = None
    alpha: float | None = None
    ess_threshold: float | None = None
    resampler: str | None = None
    regex: str | None = None  # the output must match this regular expression
    grammar: str | None = None  # the output must follow this Lark grammar


class StreamOptions(BaseModel):
    include_usage: bool = False


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
    # OpenAI fields smcspec does not implement: refused unless neutral
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None


class CompletionBody(CommonBody):
    prompt: str | list[int]
    # smcspec extension: special-token text in a raw prompt becomes control tokens (true,
    # as llama.cpp's server and vLLM do) or is tokenized as text (false)
    parse_special_tokens: bool = True
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    """One part of a message's content given as a list (only text parts are supported)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart]

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; use one of {', '.join(ROLES)}")
        return role

    def as_template_message(self) -> dict[str, str]:
        """``{"role", "content"}`` for the chat template: text parts joined by newlines
        (as vLLM does), ``developer`` mapped to ``system``."""
        content = self.content
        if not isinstance(content, str):
            content = "\n".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatBody(CommonBody):
    messages: list[ChatMessage] = Field(min_length=1)


def constraint_spec(body: CommonBody) -> Constraint | None:
    """The request's output constraint: ``response_format`` ``json_object`` (any JSON
    object) or ``json_schema`` (``{"json_schema": {"schema": ...}}``), or the ``smc`` extras
    ``regex`` / ``grammar`` (Lark). At most one may be given.

    Raises:
        ConfigError: two constraints, a ``json_schema`` format without a schema, or a schema
            that is not an object (the pattern/grammar itself is checked when compiled).
    """
    found: list[Constraint] = []
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
        raise ConfigError("give at most one of response_format json, smc.regex, smc.grammar")
    return found[0] if found else None


def unsupported_fields(body: CommonBody) -> list[str]:
    """Names of OpenAI fields ``body`` sets to a value smcspec cannot honour."""
    bad = []
    if body.logprobs not in (None, False, 0):
        bad.append("logprobs")
    if body.top_logprobs not in (None, 0):
        bad.append("top_logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            bad.append(name)
    if body.logit_bias:
        bad.append("logit_bias")
    fmt = body.response_format
    if fmt is not None and fmt.get("type") not in ("text", "json_object", "json_schema"):
        bad.append("response_format")
    if body.tools:
        bad.append("tools")
    if body.tool_choice not in (None, "none"):
        bad.append("tool_choice")
    if isinstance(body, CompletionBody):
        if body.echo:
            bad.append("echo")
        if body.best_of not in (None, 1):
            bad.append("best_of")
        if body.suffix:
            bad.append("suffix")
    return bad
