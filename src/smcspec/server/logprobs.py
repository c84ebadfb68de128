"""Token log-probabilities in OpenAI's shapes (chat's ``logprobs.content``, completions'
``logprobs`` with ``tokens``, ``token_logprobs``, ``top_logprobs`` and ``text_offset``).

A token's ``token`` is its text as the tokenizer decodes it alone, and ``bytes`` its exact
UTF-8 bytes: for a byte-level BPE vocabulary (GPT-2's, Qwen's, Llama 3's) read from the
token's own symbols, so a token holding part of a multi-byte character gives those bytes (its
``token`` text then shows U+FFFD, as OpenAI's does); for SentencePiece's ``<0xHH>`` byte
tokens that byte. JSON has no infinity: a ``-inf`` log-probability (an alternative outside the
sampling distribution's support, when a request asks for more alternatives than it keeps) is
sent as ``-9999.0``, as vLLM sends it.
"""

from __future__ import annotations

import math
import re
from typing import Any

from smcspec.decoding.logprobs import TokenLogprobs

NEG_INF_LOGPROB = -9999.0
"""What ``-inf`` is sent as (JSON has no infinity; vLLM's value)."""

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character (Radford et al.
    2019, ``encoder.py``; the table every byte-level BPE tokenizer uses)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else NEG_INF_LOGPROB


class TokenTexts:
    """Each token id's text and bytes for ``tokenizer`` (a ``transformers`` tokenizer),
    computed once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, bytes)`` of ``token_id``."""
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        tok = self.tokenizer
        piece = tok.convert_ids_to_tokens(token_id)
        text = tok.decode([token_id], skip_special_tokens=False)
        if isinstance(piece, str):
            if self.byte_level and piece and all(c in _BYTE_OF_CHAR for c in piece):
                raw = bytes(_BYTE_OF_CHAR[c] for c in piece)
                return raw.decode("utf-8", errors="replace"), list(raw)
            m = _BYTE_TOKEN.fullmatch(piece)
            if m is not None:
                raw = bytes([int(m.group(1), 16)])
                return raw.decode("utf-8", errors="replace"), list(raw)
        return text, list(text.encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprobs], texts: TokenTexts) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object: ``{"content": [...], "refusal": None}``, one entry
    ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}`` per
    token of ``entries``."""
    content = []
    for e in entries:
        for t, lp, ids, vals in zip(e.token_ids, e.logprobs, e.top_ids, e.top_logprobs,
                                    strict=True):  # fmt: skip
            text, raw = texts(t)
            top = []
            for i, v in zip(ids, vals, strict=True):
                alt, alt_raw = texts(i)
                top.append({"token": alt, "logprob": _finite(v), "bytes": alt_raw})
            content.append({"token": text, "logprob": _finite(lp), "bytes": raw,
                            "top_logprobs": top})  # fmt: skip
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: list[TokenLogprobs],
    texts: TokenTexts,
    offset: int,
    first_has_none: bool = False,
) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` object for the tokens of ``entries``: ``tokens``
    (their texts), ``token_logprobs``, ``top_logprobs`` (a ``{token text: logprob}`` dict per
    token; alternatives whose texts coincide keep the most likely) and ``text_offset`` (each
    token's character offset in the choice's text, from ``offset``, adding each token's text
    length). ``first_has_none``: the first token is a prompt's first, which nothing predicts
    (its ``token_logprobs`` and ``top_logprobs`` entries are null, as OpenAI's echo gives)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}  # fmt: skip
    for e in entries:
        for t, lp, ids, vals in zip(e.token_ids, e.logprobs, e.top_ids, e.top_logprobs,
                                    strict=True):  # fmt: skip
            text, _ = texts(t)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            top: dict[str, float] = {}
            for i, v in zip(ids, vals, strict=True):
                top.setdefault(texts(i)[0], _finite(v))
            out["token_logprobs"].append(_finite(lp))
            out["top_logprobs"].append(top)
    if first_has_none and out["tokens"]:
        out["token_logprobs"][0] = None
        out["top_logprobs"][0] = None
    return out


def prompt_entries(ids: list[int], prompt: TokenLogprobs | None) -> TokenLogprobs:
    """The echo's entries for a prompt of ``ids``: the first token (nothing predicts it; a
    placeholder for :func:`completion_logprobs`' ``first_has_none``) then ``prompt``'s."""
    first = TokenLogprobs([ids[0]], [0.0], [[]], [[]])
    if prompt is not None:
        first.extend(prompt)
    return first
