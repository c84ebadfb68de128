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

import secrets
from typing import Any

from smcspec.errors import ConfigError


def special_token_texts(tokenizer: Any) -> list[str]:
    """The texts the tokenizer parses as special tokens (``<|im_start|>``, ``<|im_end|>``...)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = {t.content for t in added.values() if getattr(t, "special", False)}
    texts |= set(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted(t for t in texts if t)


def _render(tokenizer: Any, messages: list[dict[str, Any]], tokenize: bool = False) -> Any:
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=tokenize
        )
    except Exception as exc:  # the template refused the messages (jinja raise)
        raise ConfigError(f"the chat template cannot render these messages: {exc}") from exc


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of ``messages`` (``{"role", "content"}`` dicts, contents strings) under the
    tokenizer's chat template, with the generation prompt, contents tokenized as text.

    Raises:
        ConfigError: the template cannot render the messages, or it changes a content
            that holds special-token text so that it cannot be located (it then cannot be
            tokenized safely).
    """
    specials = special_token_texts(tokenizer)
    risky = [i for i, m in enumerate(messages) if any(s in m["content"] for s in specials)]
    if not risky:  # the template's own tokenization, as before
        enc = _render(tokenizer, messages, tokenize=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    marks = {i: f"\u2063smcspec-{secrets.token_hex(8)}-{i}\u2063" for i in risky}
    placed = [{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)]
    text = _render(tokenizer, placed)
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


def encode_raw(tokenizer: Any, text: str, parse_special: bool = True) -> list[int]:
    """Token ids of a raw (``--no-chat``, ``/v1/completions``) prompt, with the tokenizer's
    own BOS handling. ``parse_special`` (the default, as llama.cpp's server and vLLM do)
    turns special-token text into control tokens; False tokenizes it as text."""
    return list(
        tokenizer(text, add_special_tokens=True, split_special_tokens=not parse_special)[
            "input_ids"
        ]
    )
