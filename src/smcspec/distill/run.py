"""``smcspec distill``: fit a draft to its target, in three resumable stages.

1. ``data``: the target answers the prompts (:mod:`smcspec.distill.teacher`), into
   ``OUT/teacher.jsonl`` (or reads another run's with ``teacher=DIR``);
2. ``train``: LoRA adapters on the draft minimise the objective on those answers
   (:mod:`smcspec.distill.training`), checkpointed in ``OUT/checkpoint/``;
3. ``export``: the adapter as a draft both backends load (:mod:`smcspec.distill.export`):
   ``OUT/draft/`` with ``manifest.json``, the PEFT adapter and a llama.cpp LoRA GGUF.

Each stage skips what a previous run of the same folder already finished, so a killed run
loses at most the answer or the training steps since the last checkpoint.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from smcspec.distill.objectives import OBJECTIVES
from smcspec.errors import ConfigError

STAGES = ("data", "train", "export", "all")


@dataclass
class DistillConfig:
    """Everything ``smcspec distill`` takes.

    Attributes:
        out: the run's folder (created; a folder holding another run's checkpoint with other
            settings is refused).
        target, draft: GGUF files or Hugging Face directories (None: the default pair's).
        data: a prompt file (:func:`smcspec.distill.data.read_prompt_file`); None: the
            built-in mix (:func:`smcspec.distill.data.builtin_mix`).
        teacher: a folder holding another run's ``teacher.jsonl`` to train on (its target
            must be this target); None: this run's own ``out``.
        objective: one of :data:`~smcspec.distill.objectives.OBJECTIVES`.
        tokens: training answer tokens (the teacher generates this many, balanced across
            domains; training makes one pass over them).
        stage: ``data``, ``train``, ``export`` or ``all``.
        temperature: the deployment temperature of the teacher's answers and of the fit.
        top_k: the target's tokens kept per position. max_new_tokens: one answer's cap.
        concurrency: the target's answers decoded together (batched forwards).
        rank, lora_alpha: the LoRA adapters' rank and scale numerator (scale alpha / rank).
        lr: AdamW's peak learning rate (linear warm-up over the first 5% of steps, then
            cosine decay to 10%). step_tokens: answer tokens per optimizer step.
        validations: validation passes over the run, evenly spaced in training tokens
            (plus one before training).
        checkpoint_every: optimizer steps between checkpoints.
        seed: the teacher's sampling seeds and the training order.
        device, threads: where training runs (``cpu`` or ``cuda``) and its CPU threads.
        dtype: training's compute dtype (``float32``, or ``bfloat16`` autocast).
    """

    out: Path
    target: str | None = None
    draft: str | None = None
    data: str | None = None
    teacher: Path | None = None
    objective: str = "chi2"
    tokens: int = 120_000
    stage: str = "all"
    temperature: float = 0.7
    top_k: int = 20
    max_new_tokens: int = 512
    concurrency: int = 4
    rank: int = 8
    lora_alpha: float = 16.0
    lr: float = 2e-4
    step_tokens: int = 2048
    validations: int = 4
    checkpoint_every: int = 5
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None
    dtype: str = "float32"
    extra: dict = field(default_factory=dict)

    def validate(self) -> DistillConfig:
        """Check every setting before any model loads.

        Raises:
            ConfigError: naming the first setting out of range.
        """
        self.out = Path(self.out)
        if self.objective not in OBJECTIVES:
            raise ConfigError(
                f"unknown objective {self.objective!r}; choose from {', '.join(OBJECTIVES)}"
            )
        if self.stage not in STAGES:
            raise ConfigError(f"unknown stage {self.stage!r}; choose from {', '.join(STAGES)}")
        checks = (
            ("tokens", self.tokens, 64, 100_000_000),
            ("rank", self.rank, 1, 256),
            ("step_tokens", self.step_tokens, 16, 1_000_000),
            ("validations", self.validations, 0, 100),
            ("checkpoint_every", self.checkpoint_every, 1, 100_000),
            ("max_new_tokens", self.max_new_tokens, 16, 4096),
            ("top_k", self.top_k, 1, 20),
            ("concurrency", self.concurrency, 1, 64),
        )
        for name, value, lo, hi in checks:
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ConfigError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
        for name, value, lo, hi in (
            ("temperature", self.temperature, 1e-3, 2.0),
            ("lr", self.lr, 1e-7, 1.0),
            ("lora_alpha", self.lora_alpha, 1e-3, 1e4),
        ):
            if not (isinstance(value, int | float) and math.isfinite(value) and lo <= value <= hi):
                raise ConfigError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"--out {self.out} exists and is not a folder")
        if self.teacher is not None:
            self.teacher = Path(self.teacher)
            if not (self.teacher / "teacher.jsonl").is_file():
                raise ConfigError(f"--teacher {self.teacher} holds no teacher.jsonl")
        return self

    @property
    def teacher_dir(self) -> Path:
        """Where the teacher's records are (``teacher``, else ``out``)."""
        return self.teacher if self.teacher is not None else self.out


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def prompt_items(cfg: DistillConfig, tokenizer=None):
    """The run's prompts: the user's file, or the built-in mix (needs the tokenizer)."""
    from smcspec.distill import data

    if cfg.data is not None:
        return data.read_prompt_file(cfg.data)
    return data.builtin_mix(tokenizer, seed=cfg.seed)


def run_data_stage(cfg: DistillConfig, log: Callable[[str], None] = _log) -> None:
    """Stage 1: the teacher's answers (see the module notes)."""
    from tqdm import tqdm

    from smcspec.distill import data
    from smcspec.distill.teacher import TeacherSettings, generate_teacher
    from smcspec.engine import Engine
    from smcspec.models.default_pair import DEFAULT_TARGET

    items = prompt_items(cfg) if cfg.data is not None else None  # a bad file fails first
    engine = Engine.load(cfg.target, with_draft=False, log=log)
    if items is None:
        items = prompt_items(cfg, engine.tokenizer)
    sha = DEFAULT_TARGET.sha256 if cfg.target is None else _sha256_or_none(target_file(cfg))
    settings = TeacherSettings(
        target=engine.target.name,
        target_sha256=sha,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        max_new_tokens=cfg.max_new_tokens,
        train_tokens=cfg.tokens,
        seed=cfg.seed,
    )
    domains = sorted({it.domain for it in items})
    bar = tqdm(total=cfg.tokens, unit="tok", desc="teacher answers", file=sys.stderr)

    def progress(record, tokens: dict[str, int]) -> None:
        bar.n = sum(tokens.values())
        bar.set_postfix_str(" ".join(f"{d} {tokens.get(d, 0)}" for d in domains))
        bar.refresh()

    generate_teacher(
        engine, items, cfg.out, settings, data.digest(items), progress, cfg.concurrency
    )
    bar.close()


def _sha256_or_none(path: Path) -> str | None:
    from smcspec.models.gguf_convert import sha256_file

    p = Path(path)
    return sha256_file(p) if p.is_file() else None


def target_file(cfg: DistillConfig) -> Path:
    """The target's file or folder (the default pair's assembled on first use).

    Raises:
        ModelFileError: a missing path.
    """
    from smcspec.errors import ModelFileError
    from smcspec.models.default_pair import DEFAULT_TARGET, ensure_packaged_model
    from smcspec.models.loading import cache_root

    if cfg.target is None:
        return ensure_packaged_model(DEFAULT_TARGET, cache_root())
    p = Path(cfg.target).expanduser()
    if not p.exists():
        raise ModelFileError(f"target path does not exist: {p}")
    return p


def check_pair_files(cfg: DistillConfig) -> None:
    """The target and the draft exist and share one vocabulary (read from their files).

    Raises:
        ModelFileError: a missing file, or vocabularies that differ.
    """
    from smcspec.distill.training import draft_source
    from smcspec.models.pair import check_files_share_vocabulary

    check_files_share_vocabulary(target_file(cfg), draft_source(cfg)[0])


def distill(cfg: DistillConfig, log: Callable[[str], None] = _log) -> Path | None:
    """Run ``cfg.stage`` (all three by default); return the exported draft's folder when
    the export stage ran.

    Raises:
        ConfigError, ModelFileError: bad settings or files, before any model loads where
            they can be seen then.
    """
    cfg.validate()
    if cfg.data is not None:
        prompt_items(cfg)  # a bad prompt file is refused before any model loads
    if cfg.stage != "export":
        check_pair_files(cfg)
    if cfg.stage in ("data", "all") and cfg.teacher is None:
        run_data_stage(cfg, log)
    if cfg.stage in ("train", "all"):
        from smcspec.distill.training import train

        train(cfg, log)
    if cfg.stage in ("export", "all"):
        from smcspec.distill.export import export

        return export(cfg, log)
    return None
