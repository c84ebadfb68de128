"""Chat prompts: messages rendered by the model's own template, contents tokenized as text.

A chat template puts control tokens around each message (Qwen2.5: ``<|im_start|>user\\n``
... ``<|im_end|>``). Rendering the messages to one string and tokenizing it would also
parse any control-token text a user wrote *inside* a message, letting them forge a system
or assistant turn. :func:`encode_chat` renders the template with a placeholder for each
content, tokenizes the template's own text with its special tokens, and each content with
special tokens split into ordinary text (``split_special_tokens``), as OpenAI's API does.
Messages without special-token text take the ordinary path, so their ids are unchanged.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from smcspec.errors import ConfigError


def special_token_texts(tokenizer: Any) -> list[str]:
    """The texts the tokenizer parses as special tokens (``<|im_start|>``, ``<|im_end|>``...)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {t.content for t in added.values() if getattr(t, "special", False)}
    texts |= set(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted(t for t in texts if t)


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tokenize: bool = False,
    tools: list[dict] | None = None,
) -> Any:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=tokenize
        )
    except Exception as exc:  # the template refused the messages (jinja raise)
        raise ConfigError(f"the chat template cannot render these messages: {exc}") from exc


def encode_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None = None
) -> list[int]:
    """Token ids of ``messages`` (``{"role", "content"}`` dicts, contents strings; assistant
    messages may carry ``tool_calls``, ``tool`` messages a ``tool_call_id``) under the
    tokenizer's chat template, with the generation prompt, contents tokenized as text.
    ``tools`` (OpenAI-shaped function entries) are given to the template, which must render
    them and the ``<tool_call>`` form (:func:`check_tool_template`).

    Raises:
        ConfigError: the template cannot render the messages or the tools, special-token
            text inside tools or tool calls, or a template that changes a content holding
            special-token text so that it cannot be located (it then cannot be tokenized
            safely).
    """
    specials = special_token_texts(tokenizer)
    if tools is not None:
        check_tool_template(tokenizer)
    _refuse_specials_in_calls(specials, messages, tools)
    risky = [i for i, m in enumerate(messages) if any(s in m["content"] for s in specials)]
    if not risky:  # the template's own tokenization, as before
        enc = _render(tokenizer, messages, tokenize=True, tools=tools)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    marks = {i: f"\u2063smcspec-{secrets.token_hex(8)}-{i}\u2063" for i in risky}
    placed = [{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)]
    text = _render(tokenizer, placed, tools=tools)
    ids: list[int] = []
    for i in risky:
        before, sep, text = text.partition(marks[i])
        if not sep or marks[i] in text:
            raise ConfigError(
                f"message {i} holds special-token text and the chat template does not keep it "
                "as written, so it cannot be tokenized as plain text"
            )
        ids += tokenizer(before, add_special_tokens=False)["input_ids"]
        content = messages[i]["content"]
        ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids + list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _refuse_specials_in_calls(
    specials: list[str], messages: list[dict[str, Any]], tools: list[dict] | None
) -> None:
    """Tool definitions and earlier calls are rendered into the prompt as JSON, where
    special-token text would become control tokens: refuse it (ConfigError)."""
    parts = [("tools", tools)] if tools else []
    parts += [(f"message {i}'s tool_calls", m["tool_calls"]) for i, m in enumerate(messages)
              if m.get("tool_calls")]  # fmt: skip
    for what, value in parts:
        text = json.dumps(value, ensure_ascii=False)
        found = next((s for s in specials if s in text), None)
        if found is not None:
            raise ConfigError(f"{what} must not contain the special-token text {found!r}")


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "smcspec_probe",
        "description": "smcspec-probe-description",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}


def check_tool_template(tokenizer: Any) -> None:
    """Raises :class:`ConfigError` unless the chat template renders ``tools`` and an
    assistant's ``tool_calls`` in the ``<tool_call>`` JSON form the grammar writes
    (:mod:`smcspec.tool_calls.spec`), as Qwen2.5's does."""
    from smcspec.tool_calls.spec import ARGS_HEAD, CALL_CLOSE, CALL_HEAD, CALL_OPEN, CALL_TAIL

    call = {"name": "smcspec_probe", "arguments": {"a": 1}}
    messages = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": call}],
        },
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL], tokenize=False)
    except Exception as exc:
        raise ConfigError(f"this model's chat template cannot render tools: {exc}") from exc
    form = CALL_OPEN + CALL_HEAD + "smcspec_probe" + ARGS_HEAD + '{"a": 1}' + CALL_TAIL + CALL_CLOSE
    if "smcspec-probe-description" not in text:
        raise ConfigError("this model's chat template does not render tools")
    if form not in text:
        raise ConfigError(
            "this model's chat template writes tool calls in a form smcspec does not know "
            "(it knows the <tool_call> JSON form of Qwen2.5 and Hermes templates)"
        )


def encode_raw(tokenizer: Any, text: str, parse_special: bool = True) -> list[int]:
    """Token ids of a raw (``--no-chat``, ``/v1/completions``) prompt, with the tokenizer's
    own BOS handling. ``parse_special`` (the default, as llama.cpp's server and vLLM do)
    turns special-token text into control tokens; False tokenizes it as text."""
    return list(
        tokenizer(text, add_special_tokens=True, split_special_tokens=not parse_special)[
            "input_ids"
        ]
    )
