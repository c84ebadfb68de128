"""What particles are measured against in ``eval``: n independent ``ar`` samples, batched.

* **best-of-n** (``ar-bon-nN``): n ``ar`` samples reranked by a reward; the first sample with
  the highest reward is the answer. Its output law has a closed form
  (:func:`best_of_n_probs`).
* **self-consistency** (``ar-sc-nN``, Wang et al. 2023): n ``ar`` samples, the answer the most
  samples extracted wins (an unweighted :func:`smcspec.aggregate.weighted_vote`); the text is
  the first sample that gave it.

The n samples run as n requests of one :class:`~smcspec.scheduler.BatchScheduler`, so each
step is one batched forward over all of them, as SMC-SD batches its particles (the prompt is
prefilled once per sample).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

from smcspec.aggregate import weighted_vote
from smcspec.config import GenerationConfig
from smcspec.engine import Engine, GenerationResult
from smcspec.scheduler import BatchScheduler, Request

SAMPLE_SEED_STRIDE = 1_000_003
"""Sample j of a request seeded s is seeded ``s + j * SAMPLE_SEED_STRIDE`` (sample 0 is the
plain ``ar`` answer of the same seed)."""


@dataclass
class Samples:
    """n answers to one prompt and the wall seconds from the first submit to the last
    result."""

    results: list[GenerationResult]
    seconds: float

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.results]

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.results)


def sample_batch(
    engine: Engine, prompt, cfg: GenerationConfig, n: int, timeout_s: float = 3600.0
) -> Samples:
    """``n`` samples of ``cfg`` (seeds as :data:`SAMPLE_SEED_STRIDE` says), decoded together.

    Raises:
        ConfigError, ContextLengthError: from :meth:`Engine.prepare`; the first error a
            sample ended with; TimeoutError after ``timeout_s``.
    """
    done, lock = threading.Event(), threading.Lock()
    results: dict[int, GenerationResult | BaseException] = {}

    def finisher(j: int) -> Callable[[GenerationResult | BaseException], None]:
        def on_done(outcome: GenerationResult | BaseException) -> None:
            with lock:
                results[j] = outcome
                if len(results) == n:
                    done.set()

        return on_done

    seed = cfg.seed or 0
    jobs = [
        engine.prepare(prompt, replace(cfg, seed=seed + j * SAMPLE_SEED_STRIDE)) for j in range(n)
    ]
    sched = BatchScheduler(engine, max_running=n, max_waiting=n)
    sched.start()
    try:
        start = time.perf_counter()
        for j, job in enumerate(jobs):
            sched.submit(Request(job=job, on_done=finisher(j)))
        if not done.wait(timeout=timeout_s):
            raise TimeoutError(f"{n} samples did not finish in {timeout_s:g} s")
        seconds = time.perf_counter() - start
    finally:
        sched.stop()
    ordered = [results[j] for j in range(n)]
    for r in ordered:
        if isinstance(r, BaseException):
            raise r
    return Samples(ordered, seconds)  # type: ignore[arg-type]


def best_of_n(rewards: Sequence[float]) -> int:
    """The index of the first sample with the highest reward. Raises ValueError if empty."""
    if not rewards:
        raise ValueError("best-of-n needs at least one sample")
    return max(range(len(rewards)), key=lambda i: (rewards[i], -i))


def self_consistency(answers: Sequence[Hashable | None]) -> int | None:
    """The index of the first sample whose answer the most samples share; None when no
    sample has an answer."""
    won = weighted_vote(answers, [1.0] * len(answers))
    if won is None:
        return None
    return next(i for i, a in enumerate(answers) if a == won.answer)


def best_of_n_probs(probs: dict[Hashable, float], reward: dict[Hashable, float], n: int):
    """The exact law of best-of-n's answer when each sample is drawn from ``probs``.

    Outcomes are ranked by reward, ties broken by sample order (the first best sample wins,
    as :func:`best_of_n` does); with ties the law is that of the best reward *level*, shared
    among the tied outcomes in proportion to their probability. For a reward level r with
    ``F(r) = P(R < r)`` and ``G(r) = P(R <= r)``, ``P(best level = r) = G(r)^n - F(r)^n``.

    Args:
        probs: outcome -> probability (sums to 1).
        reward: outcome -> reward.
        n: samples (>= 1).
    Returns:
        outcome -> probability that best-of-n answers it.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    levels = sorted({reward[x] for x in probs})
    out = {}
    below = 0.0
    for r in levels:
        mass = sum(p for x, p in probs.items() if reward[x] == r)
        level_p = (below + mass) ** n - below**n
        for x, p in probs.items():
            if reward[x] == r:
                out[x] = level_p * p / mass if mass > 0 else 0.0
        below += mass
    return out
