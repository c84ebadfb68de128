"""The teacher signal: the target's own answers to the training prompts, with its next-token
distribution at every answer position, generated once and kept.

Each answer is sampled with ``ar`` at the deployment temperature, so the answers are exact
samples of the target, the states the draft will later draft from. The same pass keeps the
target's ``k`` most likely tokens and their log-probabilities at every position (the
distribution the token was drawn from: the target after temperature,
:mod:`smcspec.decoding.logprobs`' processed mode); the mass outside them is implied
(``1 - sum``). Training reads these records and never runs the target.

Records are appended to ``teacher.jsonl`` one finished answer at a time
(:class:`~smcspec.eval.results.ResultFile`: a kill loses at most the answers in progress, and
a rerun resumes). A few answers are decoded together, their forwards batched. Which prompt
comes next balances the domains: the domain with the fewest training answer tokens so far
goes next, until every domain holds its share of the budget, so that each domain's share of
the completion tokens is equal to within a few answers (the SMC-SD authors' lesson: a
math-heavy mix lost code). The validation prompts of every domain are answered first.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from smcspec.config import MAX_TOP_LOGPROBS, GenerationConfig
from smcspec.distill.data import PromptItem
from smcspec.errors import ConfigError
from smcspec.eval.results import ResultFile

TEACHER_FILE = "teacher.jsonl"
TEACHER_META = "teacher.json"


@dataclass(frozen=True)
class TeacherSettings:
    """How the teacher answers are made (stored in ``teacher.json``; a resumed run must match).

    Attributes:
        target: the target's name; target_sha256: its file's SHA-256 (None for a directory).
        temperature: the deployment temperature ``T`` of the answers and of the kept
            distributions (the draft is fitted at the same temperature).
        top_k: tokens kept per position (at most :data:`MAX_TOP_LOGPROBS`).
        max_new_tokens: the cap of one answer.
        train_tokens: training answer tokens to reach, over all domains together.
        seed: answer ``i`` is drawn with seed ``seed + i``.
    """

    target: str
    target_sha256: str | None
    temperature: float = 0.7
    top_k: int = MAX_TOP_LOGPROBS
    max_new_tokens: int = 512
    train_tokens: int = 120_000
    seed: int = 0

    def validate(self) -> TeacherSettings:
        """Raises :class:`ConfigError` for a setting out of range."""
        if not 0 < self.temperature <= 2:
            raise ConfigError(f"temperature must be in (0, 2], got {self.temperature}")
        if not 1 <= self.top_k <= MAX_TOP_LOGPROBS:
            raise ConfigError(f"top_k must be in [1, {MAX_TOP_LOGPROBS}], got {self.top_k}")
        if not 16 <= self.max_new_tokens <= 4096:
            raise ConfigError(f"max_new_tokens must be in [16, 4096], got {self.max_new_tokens}")
        if not 64 <= self.train_tokens <= 100_000_000:
            raise ConfigError(f"the token budget must be in [64, 1e8], got {self.train_tokens}")
        return self


@dataclass
class TeacherRecord:
    """One answer of the target (a line of ``teacher.jsonl``).

    Attributes:
        id: the prompt's id; domain, split (``train`` | ``val``), source: the prompt's.
        prompt_ids: the chat-templated prompt's token ids.
        ids: the answer's token ids (the end-of-turn token included where it ended there).
        top_ids, top_logprobs: per answer token, the target's ``k`` most likely ids and their
            log-probabilities (nats) at that position.
        finish_reason: ``stop`` or ``length``.
    """

    id: str
    domain: str
    split: str
    source: str
    prompt_ids: list[int]
    ids: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    finish_reason: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TeacherRecord:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def read_records(out: Path) -> list[TeacherRecord]:
    """The records of ``out/teacher.jsonl`` (none if absent)."""
    return [TeacherRecord.from_dict(r) for r in ResultFile(out / TEACHER_FILE).records()]


def domain_tokens(records: list[TeacherRecord], split: str = "train") -> dict[str, int]:
    """Answer tokens per domain among the records of ``split``."""
    out: dict[str, int] = {}
    for r in records:
        if r.split == split:
            out[r.domain] = out.get(r.domain, 0) + len(r.ids)
    return out


def next_prompts(
    items: list[PromptItem], records: list[TeacherRecord], settings: TeacherSettings
) -> Iterator[PromptItem]:
    """The prompts still to answer, in order: every validation prompt, then, answer by
    answer, the next training prompt of the domain with the fewest training tokens so far,
    until each domain holds ``train_tokens / domains`` or runs out of prompts.

    A generator: it reads ``records`` (which the caller extends as answers arrive) each time
    it is resumed.
    """
    done = {r.id for r in records}
    yield from (it for it in items if it.split == "val" and it.id not in done)
    domains = sorted({it.domain for it in items if it.split == "train"})
    queues = {d: [it for it in items if it.split == "train" and it.domain == d] for d in domains}
    share = settings.train_tokens / max(len(domains), 1)
    while True:
        tokens = domain_tokens(records)
        open_domains = [
            d for d in domains
            if tokens.get(d, 0) < share and any(it.id not in done for it in queues[d])
        ]  # fmt: skip
        if not open_domains:
            return
        d = min(open_domains, key=lambda d: (tokens.get(d, 0), d))
        item = next(it for it in queues[d] if it.id not in done)
        done.add(item.id)
        yield item


def check_meta(out: Path, settings: TeacherSettings, prompts_digest: str) -> None:
    """Write ``out/teacher.json`` (the settings and the mix's digest); on a resumed run,
    refuse settings that differ from those the records were made with (the budget may
    change; the prompts are checked record by record, :func:`check_records`).

    Raises:
        ConfigError: naming the first setting that differs.
    """
    meta = {**asdict(settings), "prompts_sha256": prompts_digest}
    path = out / TEACHER_META
    if path.exists():
        old = json.loads(path.read_text())
        for key, value in meta.items():
            if key not in ("train_tokens", "prompts_sha256") and old.get(key) != value:
                raise ConfigError(
                    f"{out} holds teacher answers made with {key}={old.get(key)!r}, not "
                    f"{value!r}: use another --out, or the same settings to resume"
                )
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=1) + "\n")


def check_records(engine, items: list[PromptItem], records: list[TeacherRecord], out: Path) -> None:
    """Every record already in ``out`` answers a prompt of ``items`` with the same id, domain
    and split, and the same tokens: a mix that changed where no answer was made yet resumes.

    Raises:
        ConfigError: naming the first record whose prompt is gone or changed.
    """
    by_id = {it.id: it for it in items}
    for r in records:
        item = by_id.get(r.id)
        if (
            item is None
            or (item.domain, item.split) != (r.domain, r.split)
            or (engine.encode(item.prompt) != r.prompt_ids)
        ):
            raise ConfigError(
                f"{out} holds an answer to prompt {r.id!r}, which these prompts no longer hold "
                "as it was: use another --out"
            )


def generate_teacher(
    engine,
    items: list[PromptItem],
    out: Path,
    settings: TeacherSettings,
    prompts_digest: str,
    progress: Callable[[TeacherRecord, dict[str, int]], None] | None = None,
    concurrency: int = 4,
) -> list[TeacherRecord]:
    """Answer the prompts still to answer with the target (see the module notes) and return
    every record of ``out``.

    ``concurrency`` answers are decoded together (one :class:`~smcspec.scheduler.BatchScheduler`,
    their forwards batched: on a CPU a forward over a few rows costs little more than over
    one); each is still its own seeded ``ar`` draw. A domain may then overshoot its share by
    up to ``concurrency`` answers (the balance counts finished answers).

    Args:
        engine: an :class:`~smcspec.engine.Engine` holding the target (no draft needed).
        items: the prompt mix (:func:`smcspec.distill.data.builtin_mix` or a user's file).
        out: the run's folder (``teacher.jsonl``, ``teacher.json``).
        settings: :class:`TeacherSettings`.
        prompts_digest: the mix's SHA-256 (:func:`smcspec.distill.data.digest`).
        progress: called after each answer with it and the training tokens per domain.
        concurrency: answers decoded at once (>= 1).
    Raises:
        ConfigError: settings that differ from a run already in ``out``; an answer's own
            error (a prompt too long for the context).
    """
    import queue

    from smcspec.scheduler import BatchScheduler, Request

    settings.validate()
    check_meta(out, settings, prompts_digest)
    file = ResultFile(out / TEACHER_FILE)
    records = read_records(out)
    check_records(engine, items, records, out)
    index = {it.id: i for i, it in enumerate(items)}
    todo = next_prompts(items, records, settings)
    finished: queue.Queue = queue.Queue()
    sched = BatchScheduler(engine, max_running=concurrency, max_waiting=concurrency)
    sched.start()
    in_flight = 0
    try:
        while True:
            while in_flight < concurrency and (item := next(todo, None)) is not None:
                cfg = GenerationConfig(
                    method="ar",
                    temperature=settings.temperature,
                    max_new_tokens=settings.max_new_tokens,
                    seed=settings.seed + index[item.id],
                    logprobs=settings.top_k,
                )
                prompt_ids = engine.encode(item.prompt)
                job = engine.prepare(prompt_ids, cfg, fit_context=True)
                sched.submit(Request(job=job, on_done=_put(finished, item, prompt_ids)))
                in_flight += 1
            if in_flight == 0:
                return records
            item, prompt_ids, result = finished.get()
            in_flight -= 1
            if isinstance(result, BaseException):
                raise result
            record = _record(item, prompt_ids, result)
            file.append(asdict(record))
            records.append(record)
            if progress is not None:
                progress(record, domain_tokens(records))
    finally:
        sched.stop()


def _put(finished, item: PromptItem, prompt_ids: list[int]):
    def on_done(outcome) -> None:  # on the scheduler's thread
        finished.put((item, prompt_ids, outcome))

    return on_done


def _record(item: PromptItem, prompt_ids: list[int], result) -> TeacherRecord:
    lp = result.logprobs
    return TeacherRecord(
        id=item.id,
        domain=item.domain,
        split=item.split,
        source=item.source,
        prompt_ids=prompt_ids,
        ids=list(result.token_ids),
        top_ids=lp.top_ids,
        top_logprobs=[[round(v, 6) for v in row] for row in lp.top_logprobs],
        finish_reason=result.finish_reason,
    )
