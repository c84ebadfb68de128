"""Continuous batching of decoder programs across requests.

One worker thread owns the models. Every step it admits waiting requests (their prefill is
their first step), collects the pending forward of every running request, and runs them as
**one batched forward per model** (:meth:`DecoderModel.decode_batch`): the draft forwards of
all requests together, then the target forwards together. A request therefore joins the
running batch at the next step after it arrives, and its particles share every weight read
with the other requests' particles. Each request keeps its own random generator, so its
output does not depend on what else is in the batch beyond the arithmetic of the batched
forwards (`docs/usage/server.md#reproducibility`: the first token never, later ones by
float rounding and, on llama.cpp, by where its KV cells fall in the shared cache).

**Prefill in chunks.** A long prompt is prefilled in chunks, over several steps where it
takes long (:mod:`smcspec.chunked_prefill`: the prompt cut every ``prefill_chunk``
tokens, at the same places whatever the timing, so that a prompt's logits do not depend on
it; a step runs more chunks while its prefill is expected to stay within
``prefill_step_s``), so that a step stays about one chunk long at most whatever the
prompt's length: other requests' forwards run between the chunks, and a request cancelled
during its prefill is dropped at the next step.

**Pools.** A request is admitted only when everything it can ever take from the models'
shared pools (llama.cpp sequence ids and KV cells, the torch backend's KV bytes; see
:mod:`smcspec.backends.pool`) can be reserved for it (:meth:`Engine.try_reserve`); until then
it waits in the queue (first come, first served). Whatever ends it (its last token, an
error, a cancel, a disconnect, shutdown), :meth:`BatchScheduler._finish` releases its
reservation in a ``finally``, before its result is delivered. A request that could never fit
is refused by :meth:`BatchScheduler.submit`. A lease this scheduler took that is still held
while nothing runs, for ``leak_grace_s``, is a leak (a bug): the worker stops as below, so
that ``/health`` turns 503. (Leases of others sharing the engine, another scheduler or a
direct ``Engine.generate``, only make requests wait.)

A request cancelled by its client (disconnect) is dropped at the next step: its program is
closed and its reservation released; one cancelled while it waits is dropped from the queue.

Nothing a request does can stop the worker: building its program (seeding), its prefill
and forwards, its token and done callbacks (detokenization) and its result all run inside
guards that fail that request alone. If the worker dies anyway (a bug in the scheduler),
every queued and running request fails, :attr:`BatchScheduler.alive` turns false, later
submissions raise :class:`SchedulerStoppedError`, and ``on_fatal`` is called so that the
server process can exit for its supervisor to restart it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from smcspec.chunked_prefill import ChunkedPrefill
from smcspec.decoding.job import Job
from smcspec.decoding.program import Forward, Prefill, Program, Round, execute_rounds
from smcspec.engine import Engine, GenerationResult
from smcspec.errors import ContextLengthError, SmcspecError

log = logging.getLogger(__name__)


class QueueFullError(SmcspecError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 429)."""


class SchedulerStoppedError(SmcspecError):
    """The scheduler is not running (not started, stopping, or its worker died): HTTP 503."""


class PoolLeakError(SmcspecError):
    """A model's pool stayed in use, or could not admit a request, while nothing ran."""


@dataclass
class Request:
    """One generation handled by the :class:`BatchScheduler`: its :class:`Job` and what the
    scheduler keeps of its run.

    The job carries the request's callbacks and, once admitted, its reservation, in one
    place: ``job.on_tokens`` is called (on the worker thread) with token ids as they become
    final, ``job.on_logprobs`` (with ``config.logprobs``) with each token's log-probabilities
    just before ``on_tokens`` streams it, ``job.on_prompt_logprobs`` with the prompt's once
    it is prefilled (``config.prompt_logprobs``); ``job.reservation`` is set on admission
    (on the request's own copy of the job: one job may back several requests) and released
    when the request ends (:meth:`BatchScheduler._finish`); a job submitted with one is
    refused (ValueError). ``on_done`` is called exactly once, with the result or the
    exception that ended the request. ``first_token_s``: seconds from submission to the
    first streamed token; ``max_gap_s``: the longest wait between two streamed tokens (what
    a client waits at most once the answer has started; SMC-SD streams only what every
    particle holds); both also in the result (``GenerationResult.first_token_s``,
    ``max_gap_s``).
    """

    job: Job
    on_done: Callable[[GenerationResult | BaseException], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    first_token_s: float | None = None
    max_gap_s: float | None = None
    last_token_at: float | None = None
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float | None = None  # when the worker admitted it (perf_counter)
    program: Program | None = None
    pending: Prefill | Forward | Round | None = None
    tokens: int = 0
    prefill_turn: int = -1  # the step that last ran a chunk of its prefill

    def __post_init__(self) -> None:
        if self.job.reservation is not None:  # _finish would release what it did not take
            raise ValueError("a scheduler's request takes its reservation on admission")

    def cancel(self) -> None:
        """Ask the scheduler to drop this request at its next step."""
        self.cancelled.set()


@dataclass
class StepStats:
    """What one scheduler step did (for metrics and tests)."""

    requests: int
    rows: dict[str, int]  # model role -> rows (sequences x tokens) in its batched forward
    seconds: float
    # model role -> distinct rows its forward computed (smcspec.backends.shared_rows)
    distinct_rows: dict[str, int] = field(default_factory=dict)
    prefill_tokens: int = 0  # prompt tokens prefilled (chunks of every request's prompt)


class BatchScheduler:
    """Runs requests on ``engine`` with continuous batching on a worker thread.

    Args:
        engine: the loaded pair.
        max_running: at most this many requests decode together.
        max_waiting: submissions beyond this many queued requests raise QueueFullError.
        on_step: optional observer called after every step with :class:`StepStats`.
        on_fatal: called (on the worker thread) with the exception if the worker dies.
        leak_grace_s: how long a lease of this scheduler may stay held while nothing runs
            before it is declared leaked.
        prefill_chunk: prompts are prefilled in chunks of this many tokens (see the module
            notes).
        prefill_step_s: seconds of prefill a step aims at (see the module notes).
    Raises:
        ConfigError: ``prefill_chunk < 1`` or ``prefill_step_s <= 0``.
    """

    def __init__(
        self,
        engine: Engine,
        max_running: int = 16,
        max_waiting: int = 64,
        on_step: Callable[[StepStats], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        leak_grace_s: float = 10.0,
        prefill_chunk: int = 512,
        prefill_step_s: float = 1.0,
    ) -> None:
        self.engine = engine
        self.prefill = ChunkedPrefill(prefill_chunk, prefill_step_s)
        self._steps = 0  # steps run
        self.max_running, self.max_waiting = max_running, max_waiting
        self.leak_grace_s = leak_grace_s
        self._idle_since: float | None = None  # nothing running, yet a pool in use or blocked
        self.on_step, self.on_fatal = on_step, on_fatal
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._cv = threading.Condition()
        self._stop = False
        self.stopping = threading.Event()  # set by stop()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        """Start the worker thread that admits and steps requests."""
        self._thread = threading.Thread(target=self._loop, name="smcspec-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to stop and wait up to ``timeout`` seconds for it to end."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self.stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Serving: started, not stopping, and the worker has not died."""
        return (
            self._thread is not None
            and self._thread.is_alive()
            and not self._stop
            and self.error is None
        )

    @property
    def num_waiting(self) -> int:
        """Requests queued, not yet admitted."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests admitted and decoding."""
        return len(self._running)

    def submit(self, request: Request) -> None:
        """Queue ``request``.

        Raises:
            ContextLengthError: the request could never fit the models' pools.
            QueueFullError: ``max_waiting`` requests are already queued.
            SchedulerStoppedError: the worker is not running.
        """
        reason = self.engine.never_fits(request.job)
        if reason is not None:
            raise ContextLengthError(reason)
        with self._cv:
            if not self.alive:
                reason = f": the worker died ({self.error!r})" if self.error else ""
                raise SchedulerStoppedError(f"the server is not serving requests{reason}")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFullError(
                    f"{len(self._waiting)} requests are already waiting (limit {self.max_waiting})"
                )
            self._waiting.append(request)
            self._cv.notify_all()

    def abandon(self, exc: BaseException) -> None:
        """The models cannot run any more (their backend failed fatally, e.g. llama.cpp is
        aborting the process): fail every queued and running request with ``exc`` and stop
        serving (:attr:`alive` turns false, :meth:`submit` raises SchedulerStoppedError).

        Callable from any thread, including the worker's own from inside a forward (the
        lock is re-entrant). Programs are not closed and reservations not released: that
        would call into the failed backend, and the process is about to end.
        """
        locked = self._cv.acquire(timeout=2.0)  # never wait forever on a wedged holder
        try:
            self.error = self.error or exc
            left = [*self._running, *self._waiting]
            self._running.clear()
            self._waiting.clear()
        finally:
            if locked:
                self._cv.release()
        for req in left:
            req.pending = None
            try:
                req.on_done(exc)
            except Exception:
                log.exception("a request's on_done callback failed")

    # ------------------------------------------------------------------ worker
    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stop and not self._waiting and not self._running:
                        self._check_idle_pools()
                        self._cv.wait(timeout=1.0)
                    if self._stop:
                        break
                    self._admit_waiting()
                    if not self._running:  # the first waiting request does not fit yet
                        self._check_idle_pools()
                        self._cv.wait(timeout=0.05)
                        continue
                    self._idle_since = None
                self.step()
        except BaseException as exc:  # a bug in the worker: fail everything, stay visible
            log.exception("the scheduler's worker died")
            with self._cv:
                self.error = exc
                left = [*self._running, *self._waiting]
                self._running.clear()
                self._waiting.clear()
            for req in left:
                self._finish(req, RuntimeError(f"the server's worker failed: {exc!r}"))
            if self.on_fatal is not None:
                self.on_fatal(exc)
        finally:
            with self._cv:
                left = [*self._running, *self._waiting]
                self._running.clear()
                self._waiting.clear()
            for req in left:
                self._finish(req, RuntimeError("the server is shutting down"))

    def _admit_waiting(self) -> None:
        """Admit waiting requests in order while they fit (called holding the lock)."""
        while self._waiting and len(self._running) < self.max_running:
            head = self._waiting[0]
            if head.cancelled.is_set():
                self._waiting.popleft()
                self._finish(head, RuntimeError("cancelled"))
                continue
            reservation = self.engine.try_reserve(head.job, owner=self)
            if reservation is None:
                return
            self._waiting.popleft()
            head.job = replace(head.job, reservation=reservation)  # its own; _finish releases it
            self._admit(head)

    def _check_idle_pools(self) -> None:
        """With nothing running, this scheduler must hold no lease. Raises
        :class:`PoolLeakError` once one has been held for ``leak_grace_s`` regardless."""
        held = {role: pool.leases_of(self) for role, pool in self.engine.pools().items()}
        if not any(held.values()):
            self._idle_since = None
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= self.leak_grace_s:
            free = {role: pool.free() for role, pool in self.engine.pools().items()}
            raise PoolLeakError(
                f"nothing has run for {self.leak_grace_s:g} s, yet this server still holds "
                f"leases {held} (free: {free}): a leak"
            )

    def _admit(self, req: Request) -> None:
        req.admitted = time.perf_counter()
        stream = req.job.on_tokens

        def on_tokens(ids: list[int], req: Request = req) -> None:
            if ids:
                now = time.perf_counter()
                if req.first_token_s is None:
                    req.first_token_s = now - req.submitted
                else:
                    gap = now - (req.last_token_at or now)
                    req.max_gap_s = max(req.max_gap_s or 0.0, gap)
                req.last_token_at = now
            req.tokens += len(ids)
            if stream is not None:
                stream(ids)

        try:  # the program streams through the timing above, to the job's own on_tokens
            req.program = self.engine.program(replace(req.job, on_tokens=on_tokens))
        except Exception as exc:  # e.g. a generator that refuses the seed
            log.exception("request failed before its first step")
            self._finish(req, exc)
            return
        self._advance(req, None, first=True)
        if req.pending is not None:
            self._running.append(req)

    def _advance(self, req: Request, result: torch.Tensor | None, first: bool = False) -> None:
        try:
            req.pending = next(req.program) if first else req.program.send(result)
        except StopIteration as done:
            req.pending = None
            seconds = time.perf_counter() - (req.admitted or req.submitted)
            try:
                outcome = self.engine.finish(req.job, done.value, seconds)
                outcome.first_token_s, outcome.max_gap_s = req.first_token_s, req.max_gap_s
            except Exception as exc:  # detokenization failed: this request fails alone
                log.exception("request failed after decoding")
                outcome = exc
            self._finish(req, outcome)
        except Exception as exc:  # NaN logits, or a bug: this request fails, others go on
            if not isinstance(exc, SmcspecError):
                log.exception("request failed")
            req.pending = None
            self._finish(req, exc)

    def _finish(self, req: Request, outcome) -> None:
        """End ``req``: close its program, release its reservation, then tell its owner."""
        try:
            if req.program is not None:
                req.program.close()
        except Exception:  # a program that fails while closing is done all the same
            log.exception("closing a request's program failed")
        finally:
            reservation = req.job.reservation
            if reservation is not None:
                req.job.reservation = None
                try:
                    reservation.release()
                except Exception:  # a backend that cannot clear: visible as a leak later
                    log.exception("releasing a request's reservation failed")
        try:
            req.on_done(outcome)
        except Exception:  # a broken callback must not stop the worker
            log.exception("a request's on_done callback failed")

    @torch.inference_mode()
    def step(self) -> StepStats:
        """Run one step: every running request's pending forward, batched per model."""
        t0 = time.perf_counter()
        for req in [r for r in self._running if r.cancelled.is_set()]:
            req.pending = None
            self._finish(req, RuntimeError("cancelled"))
        live = [r for r in self._running if r.pending is not None]
        self._steps += 1
        results, prefilled = self._run_prefills(live)
        rows: dict[str, int] = {}
        distinct: dict[str, int] = {}
        groups: dict[int, list[Request]] = {}
        for req in live:
            if isinstance(req.pending, Forward):
                groups.setdefault(id(req.pending.model), []).append(req)
        for members in groups.values():
            results |= self._run_forward_batch(members, rows, distinct)
        for req in live:
            if id(req) in results and req.pending is not None:
                self._advance(req, results[id(req)])
        self._running = [r for r in self._running if r.pending is not None]
        seconds = time.perf_counter() - t0
        stats = StepStats(len(live), rows, seconds, distinct, prefilled)
        if self.on_step is not None:
            try:
                self.on_step(stats)
            except Exception:  # an observer must not stop the worker
                log.exception("the on_step observer failed")
        return stats

    def _run_prefills(self, live: list[Request]) -> tuple[dict[int, torch.Tensor], int]:
        """Chunks of the pending prefills, one at a time (their lengths differ), in turn
        from the least recently served, while the next one is expected to keep this step's
        prefill within ``prefill_step_s`` (the first always runs; the rest wait for the next
        step); then the pending fused rounds (:func:`~smcspec.decoding.program.execute_rounds`:
        those of one kind on one bank as one batched call, the others on their own).
        Returns ``{id(request): result}`` (a prefill's logits once its prompt is whole) and
        the prompt tokens prefilled. One that raises (e.g. out of memory) fails its request
        only."""
        results: dict[int, torch.Tensor] = {}
        turns = collections.deque(sorted((r for r in live if isinstance(r.pending, Prefill)),
                                         key=lambda r: r.prefill_turn))  # fmt: skip
        spent, prefilled = 0.0, 0
        while turns:
            req = turns.popleft()
            if spent and spent + self.prefill.expected_s(req.pending) > self.prefill.step_s:
                break
            try:
                logits, tokens, seconds = self.prefill.run(req.pending)
            except Exception as exc:
                self._fail(req, exc, "prefill")
                continue
            spent, prefilled, req.prefill_turn = spent + seconds, prefilled + tokens, self._steps
            if logits is not None:
                results[id(req)] = logits
            else:
                turns.append(req)  # its next chunk may still fit this step
        rounds = [r for r in live if isinstance(r.pending, Round)]
        for req, out in zip(rounds, execute_rounds([r.pending for r in rounds]), strict=True):
            if isinstance(out, Exception):
                self._fail(req, out, "fused round")
            else:
                results[id(req)] = out
        return results, prefilled

    def _fail(self, req: Request, exc: Exception, what: str) -> None:
        """End ``req`` with ``exc`` (logged with its traceback unless a user's error)."""
        if not isinstance(exc, SmcspecError):
            log.error("%s failed", what, exc_info=exc)
        req.pending = None
        self._finish(req, exc)

    def _run_forward_batch(
        self, members: list[Request], rows: dict[str, int], distinct: dict[str, int]
    ) -> dict[int, torch.Tensor]:
        """One batched forward over the pending :class:`Forward` requests of ``members`` (all on one
        model): ``{id(request): logits}``; adds the rows fed and the distinct rows computed to
        ``rows``/``distinct`` under the model's role. A forward that raises fails these
        requests and keeps the worker serving."""
        model = members[0].pending.model
        role = "target" if model is self.engine.target.model else "draft"
        items = [(r.pending.tokens, r.pending.cache, r.pending.last_only) for r in members]
        rows[role] = sum(t.numel() for t, _, _ in items)
        computed = sum(c.histories.computed for _, c, _ in items)
        try:
            outs = model.decode_batch(items)
        except Exception as exc:
            if not isinstance(exc, SmcspecError):
                log.exception("batched forward failed")
            for r in members:
                r.pending = None
                self._finish(r, exc)
            return {}
        distinct[role] = sum(c.histories.computed for _, c, _ in items) - computed
        return {id(r): out for r, out in zip(members, outs, strict=True)}
