"""The text the tuner measures the pair's acceptance on: built-in prompts, or the user's.

The pair's acceptance (sd's alpha, SMC-SD's per-token log-weights, the agreement profiles,
multi-draft sd's tree acceptance; :func:`smcspec.tuning.measure.measure_acceptance`) depends
on the text as much as on the models: on the default pair, calibrated on 20 GSM8K questions,
the tuner predicts SMC-SD N=8 K=8 with cut rounds at 6.87 tokens a round where the first 100
GSM8K answers measured 7.05; from the built-in prompts it predicts 4.59
(``docs/benchmarks/tuner-calibration/``). A workload unlike the
built-in mix (code, arithmetic, prose, JSON) is predicted from its own prompts with
``--calibration FILE``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from smcspec.errors import ConfigError
from smcspec.input_files import loads_bounded, read_text_file
from smcspec.tuning.measure import ACCEPTANCE_PROMPTS

DEFAULT_TOKENS_PER_PROMPT = 64
"""New tokens of each calibration prompt's sd run (the built-in 4 prompts: 256 in all)."""

MAX_PROMPTS = 1000
"""More prompts than this are refused (the measurement runs one sd request per prompt)."""

MAX_CALIBRATION_BYTES = 16 << 20
"""A larger calibration file is refused before it is read (1,000 prompts of 16 KiB each)."""

MAX_TOKENS_PER_PROMPT = 512
"""The most new tokens a prompt: one prompt's log-probabilities under both models are held
in memory at once, float64 ``[tokens, vocab]`` each (512 tokens of the default pair's
151,936-token vocabulary: 1.2 GB)."""


@dataclass(frozen=True)
class Calibration:
    """Prompts and a token budget for the acceptance measurement.

    Attributes:
        prompts: the prompts, each run through the chat template when the tokenizer has one.
        tokens_per_prompt: new tokens generated from each (EOS ignored).
        source: the file they came from (None: the built-in prompts).
    """

    prompts: tuple[str, ...] = ACCEPTANCE_PROMPTS
    tokens_per_prompt: int = DEFAULT_TOKENS_PER_PROMPT
    source: Path | None = None

    @property
    def builtin(self) -> bool:
        """Whether this is the built-in measurement (the cache keys written before)."""
        return self.prompts == ACCEPTANCE_PROMPTS and (
            self.tokens_per_prompt == DEFAULT_TOKENS_PER_PROMPT
        )

    @property
    def new_tokens(self) -> int:
        """New tokens of the measurement in all."""
        return self.tokens_per_prompt * len(self.prompts)

    @property
    def key(self) -> str:
        """What the cache's acceptance key gains: ``""`` for the built-in measurement (keys
        stay those of earlier caches and pair-stats files), else
        ``",calibration=<12 hex digits>"``, a SHA-256 of the prompts and the budget."""
        if self.builtin:
            return ""
        blob = json.dumps([list(self.prompts), self.tokens_per_prompt]).encode()
        return f",calibration={hashlib.sha256(blob).hexdigest()[:12]}"

    def describe(self) -> str:
        """For the predicted table's note."""
        where = "built-in prompts" if self.source is None else f"prompts of {self.source}"
        return f"{len(self.prompts)} {where}, {self.tokens_per_prompt} tokens each"


def read_calibration(path: str | Path, tokens_per_prompt: int | None = None) -> Calibration:
    """The prompts of ``path``: a JSON array of strings, or one prompt per line (blank lines
    skipped; a line holding a JSON string is decoded, for prompts with newlines).

    The file is read with bounds (:func:`smcspec.input_files.read_text_file`: a regular file
    of at most :data:`MAX_CALIBRATION_BYTES`, UTF-8 text; a JSON array nested at most
    :data:`~smcspec.input_files.MAX_JSON_DEPTH` deep).

    Raises:
        ConfigError: the file cannot be read (missing, not a regular file, too large, not
            UTF-8 text, JSON nested too deep), holds no prompt or more than
            :data:`MAX_PROMPTS`, an array entry is not a non-empty string, or
            ``tokens_per_prompt`` is not in ``[2, MAX_TOKENS_PER_PROMPT]``.
    """
    tokens = DEFAULT_TOKENS_PER_PROMPT if tokens_per_prompt is None else tokens_per_prompt
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise ConfigError(f"--calibration-tokens must be an integer, got {tokens!r}")
    if not 2 <= tokens <= MAX_TOKENS_PER_PROMPT:
        raise ConfigError(
            f"--calibration-tokens must be in [2, {MAX_TOKENS_PER_PROMPT}], got {tokens}"
        )
    path = Path(path)
    text = read_text_file(path, "the calibration prompts", MAX_CALIBRATION_BYTES)
    prompts = _parse(text, path)
    if not prompts:
        raise ConfigError(f"{path} holds no calibration prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ConfigError(f"{path} holds {len(prompts)} prompts; at most {MAX_PROMPTS}")
    return Calibration(tuple(prompts), tokens, path)


def _parse(text: str, path: Path) -> list[str]:
    if text.lstrip().startswith("["):
        items = loads_bounded(text, f"{path} (it starts with '[')")
        if not isinstance(items, list):
            raise ConfigError(f"{path} starts with '[' but is not a JSON array")
        if not all(isinstance(p, str) and p.strip() for p in items):
            raise ConfigError(f"{path}: every entry of the array must be a non-empty string")
        return items
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith('"'):
            try:
                decoded = json.loads(line)
            except json.JSONDecodeError:
                decoded = None
            if isinstance(decoded, str) and decoded.strip():
                line = decoded
        out.append(line)
    return out
