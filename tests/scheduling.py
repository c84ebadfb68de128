"""Test helper: requests run together through one :class:`BatchScheduler`."""

from __future__ import annotations

import threading

from smcspec import Engine
from smcspec.scheduler import BatchScheduler, Request


def run_concurrently(
    engine: Engine, jobs: list, timeout: float = 120, max_running: int | None = None
) -> list:
    """Submit every job (:meth:`Engine.prepare`) to one scheduler so that its worker admits
    them at the same step (they are queued while it waits for its lock); returns their
    outcomes (results or exceptions), in order. ``max_running`` (default: all of them): with
    fewer, the later jobs are admitted, in order, as earlier ones end."""
    running = len(jobs) if max_running is None else max_running
    sched = BatchScheduler(engine, max_running=running, max_waiting=len(jobs))
    done = [threading.Event() for _ in jobs]
    outcomes: list = [None] * len(jobs)

    def finish(i: int):
        return lambda o: (outcomes.__setitem__(i, o), done[i].set())

    sched.start()
    try:
        with sched._cv:
            for i, job in enumerate(jobs):
                sched.submit(Request(job=job, on_done=finish(i)))
        assert all(d.wait(timeout) for d in done), "a request never ended"
    finally:
        sched.stop()
    return outcomes
