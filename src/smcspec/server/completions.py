"""Serving one completion request: config, submission to the scheduler, events, response.

A request with ``n`` choices becomes ``n`` engine requests (seeds ``seed + i``). The
scheduler's worker thread reports text and completion through an asyncio queue; the
handler turns those events into one JSON response or a server-sent event stream. A client
that goes away (stream or not) has its engine requests cancelled, which frees their rows
at the scheduler's next step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from smcspec.aggregate import Vote
from smcspec.config import MAX_TOP_LOGPROBS, GenerationConfig
from smcspec.decoding.job import Job
from smcspec.decoding.registry import decoder_for, with_updates, without_default_ngram
from smcspec.engine import SEED_RANGE, Engine, GenerationResult, TextStreamer
from smcspec.errors import ConfigError, ContextLengthError, PromptError
from smcspec.metrics import ServerMetrics
from smcspec.potentials import CompilersBusyError, DeadEndError, GrammarBudget, GrammarBudgetError
from smcspec.scheduler import BatchScheduler, QueueFullError, SchedulerStoppedError
from smcspec.scheduler import Request as EngineRequest
from smcspec.server.api_errors import ApiError, error_body
from smcspec.server.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    prompt_entries,
)
from smcspec.server.schemas import CommonBody, CompletionBody, constraint_spec, unsupported_fields
from smcspec.server.streaming import ResponseChoice, choice_object, chunk_choice, sse
from smcspec.tool_calls import ToolCalls

MAX_N = 8
DISCONNECT_POLL_S = 0.1  # how often a waiting non-streamed request checks its client


@dataclass
class ServerState:
    """What every route needs: the engine, its scheduler and metrics, and the defaults."""

    engine: Engine
    scheduler: BatchScheduler
    metrics: ServerMetrics
    defaults: GenerationConfig
    model_name: str
    grammar_budget: GrammarBudget = field(default_factory=GrammarBudget)
    token_texts: TokenTexts = field(init=False)  # each token's text and bytes (logprobs)

    def __post_init__(self) -> None:
        self.token_texts = TokenTexts(self.engine.tokenizer)


class ClientGone(Exception):
    """The client of a non-streamed request disconnected while it was decoding."""


def generation_config(state: ServerState, body: CommonBody) -> GenerationConfig:
    """The request's :class:`GenerationConfig`: the server defaults updated by its fields.

    Raises:
        ApiError: 400 for an unknown model, ``n`` out of range, an OpenAI field smcspec
            cannot honour, or a value the config refuses.
    """
    if body.model is not None and body.model != state.model_name:
        raise ApiError(
            400,
            f"unknown model {body.model!r}; this server serves {state.model_name!r}",
            param="model",
        )
    if not 1 <= body.n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}]", param="n")
    bad = unsupported_fields(body)
    if bad:
        reason = UNSUPPORTED_REASONS.get(bad[0], "")
        raise ApiError(400, f"{bad[0]} is not supported by this server{reason}", param=bad[0])
    updates: dict[str, Any] = logprob_updates(body)
    max_tokens = token_cap(body)
    if max_tokens is not None:
        updates["max_new_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "min_tokens",
                 "logprobs_mode"):  # fmt: skip
        value = getattr(body, name)
        if value is not None:
            updates[name] = value
    steering = {"regex", "grammar", "aggregate", "answer_regex"}
    if body.smc is not None:
        extras = body.smc.model_dump(exclude=steering)
        updates.update({k: v for k, v in extras.items() if v is not None})
    try:
        updates["constraint"] = constraint_spec(body)
        updates["vote"] = vote_spec(body)
        cfg = with_updates(state.defaults, updates)
        return without_default_ngram(cfg, updates).validate()
    except ConfigError as exc:
        raise ApiError(400, str(exc)) from exc


UNSUPPORTED_REASONS = {
    "logit_bias": (
        ": it would change the distribution SMC-SD and sd sample exactly (they weigh and "
        "accept drafted tokens against the target's own). To forbid tokens or shape the "
        "output, use a constraint (response_format, smc.regex, smc.grammar) or stop"
    ),
}
"""Why a field :func:`~smcspec.server.schemas.unsupported_fields` names is refused, where
the name alone does not say."""


def logprob_updates(body: CommonBody) -> dict[str, Any]:
    """The config's ``logprobs`` and ``prompt_logprobs`` from OpenAI's fields: chat's
    ``logprobs: true`` with ``top_logprobs`` alternatives (0 to 20; ``top_logprobs`` needs
    ``logprobs``, as OpenAI's API says), completions' ``logprobs`` (0 to 20 alternatives),
    and its ``echo`` with ``logprobs`` (the prompt's too).

    Raises:
        ApiError: 400 for a count out of range or ``top_logprobs`` without ``logprobs``.
    """
    out: dict[str, Any] = {}
    if isinstance(body, CompletionBody):
        count, name = body.logprobs, "logprobs"
        if count is not None:
            out["logprobs"] = count
            out["prompt_logprobs"] = bool(body.echo)
    else:
        count, name = body.top_logprobs, "top_logprobs"
        if count and not body.logprobs:  # 0 alternatives without logprobs: neutral
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if body.logprobs:
            out["logprobs"] = count or 0
    if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
        raise ApiError(
            400, f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {count}", param=name
        )
    return out


def token_cap(body: CommonBody) -> int | None:
    """The cap on new tokens the request asks for: ``max_completion_tokens`` (OpenAI's newer
    name) or ``max_tokens``, under the same rules; None when neither is given (null is not
    given).

    Raises:
        ApiError: 400 for a value below 1, or both given with different values.
    """
    given = {"max_completion_tokens": body.max_completion_tokens, "max_tokens": body.max_tokens}
    given = {name: value for name, value in given.items() if value is not None}
    for name, value in given.items():
        if value < 1:
            raise ApiError(400, f"{name} must be >= 1, got {value}", param=name)
    if len(set(given.values())) > 1:
        raise ApiError(
            400, "max_completion_tokens and max_tokens differ: give one of them",
            param="max_tokens",
        )  # fmt: skip
    return next(iter(given.values()), None)


def vote_spec(body: CommonBody) -> Vote | None:
    """The request's weighted vote (``smc.aggregate == "vote"``, answers by
    ``smc.answer_regex``). Raises :class:`ConfigError` for a regex without the vote or an
    invalid regex."""
    smc = body.smc
    if smc is None or smc.aggregate in (None, "none"):
        if smc is not None and smc.answer_regex is not None:
            raise ConfigError("smc.answer_regex needs smc.aggregate 'vote'")
        return None
    return Vote.regex(*([smc.answer_regex] if smc.answer_regex is not None else []))


def generation_error(exc: BaseException) -> ApiError:
    """The API error of a choice whose decoding raised ``exc``: a dead end (no token the
    constraint allows has probability under the target and its filters: the request asks
    for what this model cannot write) is the request's (400); anything else is a 500."""
    if isinstance(exc, GrammarBudgetError):  # a mask over its time limit: the request's
        return ApiError(400, str(exc), code="grammar_budget_exceeded")
    if isinstance(exc, DeadEndError):
        return ApiError(
            400,
            f"no output satisfies the constraint with these settings ({exc}); loosen the "
            "constraint or the top_k/top_p/min_p filters",
            code="constraint_dead_end",
        )
    return ApiError(500, f"generation failed: {exc}", "server_error")


def prepare_jobs(
    state: ServerState, body: CommonBody, cfg: GenerationConfig, prompts: list[Any], chat: bool
) -> list[Job]:
    """Each prompt's job (:meth:`Engine.prepare`: tokenizing, the chat template, compiling the
    constraint within ``state.grammar_budget``). Blocks for as long as that takes: the server
    runs it on a worker thread (:func:`create_completion`).

    Raises:
        ApiError: 400 naming the prompt (an invalid prompt or constraint, a constraint past
            its compile budget: code ``grammar_budget_exceeded``), 429 when every compile
            slot stays busy.
    """
    jobs = []
    for i, prompt in enumerate(prompts):
        try:
            parse_special = getattr(body, "parse_special_tokens", True)
            no_cap = token_cap(body) is None
            jobs.append(state.engine.prepare(
                prompt, cfg, chat, parse_special, fit_context=no_cap,
                grammar_budget=state.grammar_budget,
            ))  # fmt: skip
        except CompilersBusyError as exc:
            raise ApiError(429, str(exc), "rate_limit_error") from exc
        except (ConfigError, ContextLengthError) as exc:
            where = f"prompt[{i}]: " if len(prompts) > 1 else ""
            about_prompt = len(prompts) > 1 or isinstance(exc, PromptError)
            code = "grammar_budget_exceeded" if isinstance(exc, GrammarBudgetError) else None
            raise ApiError(
                400, f"{where}{exc}", param="prompt" if about_prompt else None, code=code
            ) from exc
    return jobs


class Completion:
    """One API request in flight: its choices, their events and its response.

    ``prompts``: one chat prompt (its messages), or the completions' prompts (a string or a
    token list each); every prompt gets ``n`` choices, prompt ``p``'s choice ``i`` at index
    ``p * n + i`` with seed ``seed + i`` (each prompt draws what it draws alone)."""

    def __init__(
        self,
        state: ServerState,
        body: CommonBody,
        prompts: list[Any],
        chat: bool,
        cfg: GenerationConfig,
        prompt_jobs: list[Job],
    ) -> None:
        """``cfg``: :func:`generation_config`'s; ``prompt_jobs``: :func:`prepare_jobs`'s
        (one per prompt). Must run on the event loop."""
        self.state, self.body, self.chat = state, body, chat
        self.cfg = cfg
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        engine = state.engine
        self.prompt_jobs = prompt_jobs
        self.jobs = [  # choice i of a prompt uses seed + i
            replace(job, config=replace(job.config, seed=(job.config.seed + i) % SEED_RANGE))
            for job in self.prompt_jobs
            for i in range(body.n)
        ]
        self.texts = state.token_texts
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.check_client_at = 0.0  # time.monotonic() of the next disconnect check
        constraint = self.cfg.constraint
        tools = chat and isinstance(constraint, ToolCalls) and constraint.calls_allowed
        # stop strings cut free text only: never inside a call or a constrained output
        stops_apply = constraint is None or isinstance(constraint, ToolCalls)
        self.choices = [ResponseChoice(i, stops, tools, stops_apply) for i in range(len(self.jobs))]
        self.created = int(time.time())
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = "chat.completion" if chat else "text_completion"
        echo = bool(getattr(body, "echo", False))
        for c, job in zip(self.choices, self.jobs, strict=True):
            c.prompt_index = c.index // body.n
            if echo:  # the prompt as sent (a token list: its text, control tokens included)
                p = prompts[c.prompt_index]
                c.echo = p if isinstance(p, str) else engine.tokenizer.decode(p)
            c.engine_req = self._engine_request(c, job)

    def _engine_request(self, c: ResponseChoice, job: Job) -> EngineRequest:
        """The choice ``c``'s scheduler request: its text, log-probabilities (where asked for)
        and outcome come back as events (on the worker's thread)."""
        streamer = TextStreamer(
            self.state.engine.tokenizer, lambda text: self._send("text", c, text)
        )
        asked = job.config.logprobs is not None
        streamed = replace(
            job,
            on_tokens=streamer,
            on_logprobs=(lambda lps: self._send("logprobs", c, lps)) if asked else None,
            on_prompt_logprobs=(lambda lps: self._send("prompt", c, lps)) if asked else None,
        )
        return EngineRequest(job=streamed, on_done=lambda out: self._send("done", c, out))

    def _send(
        self, what: str, c: ResponseChoice, payload: Any
    ) -> None:  # on the scheduler's thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (what, c, payload))
        except RuntimeError:  # the event loop is closed (shutdown): nobody to tell
            pass

    # ------------------------------------------------------------------ lifecycle
    def submit(self) -> None:
        """Queue every choice (each reserves its own pools when admitted). Raises ApiError 400
        (a choice could never fit the pools), 429 (queue full) or 503 (not serving)."""
        submitted = []
        try:
            for c in self.choices:
                self.state.scheduler.submit(c.engine_req)
                submitted.append(c)
        except (QueueFullError, SchedulerStoppedError, ContextLengthError) as exc:
            for c in submitted:
                c.engine_req.cancel()
            self.state.metrics.requests.labels(self.ran_method, "rejected").inc()
            if isinstance(exc, ContextLengthError):  # could never fit the models' pools
                raise ApiError(400, str(exc)) from exc
            if isinstance(exc, QueueFullError):
                raise ApiError(429, f"server overloaded: {exc}", "rate_limit_error") from exc
            raise ApiError(503, str(exc), "service_unavailable_error") from exc

    def cancel_open(self) -> None:
        """Cancel every choice still decoding (client gone, or shutdown)."""
        for c in self.choices:
            if c.open:
                c.cancelled = True
                c.engine_req.cancel()
                self._record(c, "cancelled")

    @property
    def ran_method(self) -> str:
        """The method the request runs as (greedy ``smc`` runs as ``sd``): what its metrics
        count under."""
        return decoder_for(self.jobs[0].config).method if self.jobs else self.cfg.method

    def _record(self, c: ResponseChoice, outcome: str) -> None:
        self.state.metrics.observe_request(
            self.ran_method, outcome, c.engine_req, c.result, len(self.jobs[c.index].ids)
        )

    async def _next(self, request: Request | None) -> tuple[str, ResponseChoice, Any]:
        """The next event; with ``request``, its client is checked every
        ``DISCONNECT_POLL_S`` whether or not events keep arriving (a fast decoder sends
        them more often than that)."""
        if request is None:
            return await self.queue.get()
        getter = asyncio.ensure_future(self.queue.get())
        try:
            while True:
                now = time.monotonic()
                if now >= self.check_client_at:
                    self.check_client_at = now + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        raise ClientGone
                wait_s = max(self.check_client_at - time.monotonic(), 0.0)
                done, _ = await asyncio.wait({getter}, timeout=wait_s)
                if done:
                    return getter.result()
        finally:
            getter.cancel()

    async def events(self, request: Request | None = None) -> AsyncIterator[tuple]:
        """``(kind, choice, deltas)`` until every choice is done (``kind``: ``text``,
        ``done``, or ``prompt`` when an echo's prompt log-probabilities arrive; ``deltas``:
        :meth:`ResponseChoice.feed`'s chat delta bodies); a stop string cancels its choice. Each
        token's log-probabilities (where asked for) go to its choice before its text.

        With ``request`` (non-streamed), raises :class:`ClientGone` when its client leaves.
        """
        remaining = len(self.choices)
        while remaining:
            what, c, payload = await self._next(request)
            if what == "logprobs":  # before the token's text
                c.add_logprobs(payload)
                continue
            if what == "prompt":  # the prompt's log-probabilities (echo)
                c.prompt_logprobs = payload
                yield "prompt", c, []
                continue
            if what == "text":
                deltas = c.feed(payload)
                if c.stopped:
                    c.engine_req.cancel()
                yield "text", c, deltas
                continue
            remaining -= 1
            if isinstance(payload, GenerationResult):
                c.result = payload
                self._record(c, "success")
            elif c.stopped:
                self._record(c, "stopped")
            elif not c.cancelled:
                c.error = payload
                self._record(c, "error")
            yield "done", c, c.feed("", final=True)

    # ------------------------------------------------------------------ responses
    def usage(self) -> dict[str, int]:
        """OpenAI's ``usage``: prompt tokens (each prompt once, shared by its ``n`` choices),
        tokens generated over all choices, and their sum."""
        prompt = sum(len(job.ids) for job in self.prompt_jobs)
        done = sum(c.engine_req.tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def extra(self, c: ResponseChoice) -> dict[str, Any]:
        """The ``smcspec`` field of a choice: the method, the stream's timing
        (``time_to_first_token_s``, ``max_token_gap_s``), the decoder's stats and, with
        ``smc.aggregate`` ``"vote"``, the vote (None when no particle had an answer)."""
        out = {"method": self.cfg.method}
        if c.result is not None:
            out |= c.result.stream_stats | c.result.stats
        if self.cfg.vote is not None and c.result is not None:
            out["vote"] = c.result.vote
        return out

    # ------------------------------------------------------------------ logprobs
    @property
    def wants_logprobs(self) -> bool:
        return self.cfg.logprobs is not None

    def logprobs_object(self, c: ResponseChoice, entries: list, offset: int = 0) -> dict | None:
        """OpenAI's ``logprobs`` of ``entries`` (a choice's tokens, or a chunk's): chat's
        ``content`` list, or completions' parallel lists with character offsets from
        ``offset``; None when the request did not ask for them."""
        if not self.wants_logprobs:
            return None
        if self.chat:
            return chat_logprobs(entries, self.texts)
        return completion_logprobs(entries, self.texts, offset)

    def echo_logprobs(self, c: ResponseChoice) -> dict | None:
        """The echo's ``logprobs``: the prompt's tokens, the first with nulls."""
        if not self.wants_logprobs:
            return None
        first = prompt_entries(self.jobs[c.index].ids, c.prompt_logprobs)
        return completion_logprobs([first], self.texts, 0, first_has_none=True)

    def whole_logprobs(self, c: ResponseChoice) -> dict | None:
        """A whole response's ``logprobs`` of choice ``c``: its echoed prompt's, then its
        generated tokens' (offsets after the echoed text)."""
        if not self.wants_logprobs:
            return None
        out = self.logprobs_object(c, c.logprobs, len(c.echo or ""))
        if c.echo is not None and out is not None:
            head = self.echo_logprobs(c)
            out = {key: head[key] + out[key] for key in out}
        return out

    async def respond(self, request: Request) -> dict[str, Any] | Response:
        """The whole response, after every choice is done (non-streamed request)."""
        try:
            async for _ in self.events(request):
                pass  # each choice keeps its text and calls
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the rows are freed
        finally:
            self.cancel_open()
        failed = [c for c in self.choices if c.error is not None]
        if failed:
            raise generation_error(failed[0].error)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.state.model_name,
            "choices": [
                choice_object(c, self.chat, self.extra(c), self.whole_logprobs(c))
                for c in self.choices
            ],
            "usage": self.usage(),
        }

    def _chunk(self, choices: list[dict[str, Any]], usage: dict | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
        }
        if self.body.stream_options and self.body.stream_options.include_usage:
            body["usage"] = usage
        return sse(body)

    async def stream(self) -> AsyncIterator[str]:
        """The server-sent events of a streamed request, ending in ``data: [DONE]``: chat's
        role chunk first; completions' echo (the prompt's text, and its log-probabilities
        once prefilled where asked for) before the choice's first token; each text chunk
        with the log-probabilities of the tokens it completes; the finish chunk with the
        ``smcspec`` stats (and any tokens' values not yet sent)."""
        chat = self.chat
        try:
            for c in self.choices:
                if chat:
                    yield self._chunk([chunk_choice(c, chat, None, None, first=True)])
                elif c.echo is not None and not self.wants_logprobs:
                    yield self._echo_chunk(c)
            async for what, c, deltas in self.events():
                if what == "prompt":
                    if c.echo is not None:
                        yield self._echo_chunk(c)
                    continue
                if what == "done" and c.error is not None:
                    exc = generation_error(c.error)
                    yield sse(error_body(exc.message, exc.kind, exc.param, exc.code))
                    continue
                for chunk in self._text_chunks(c, deltas):
                    yield chunk
                if what == "done":
                    lps = self._chunk_logprobs(c, c.take_logprobs())
                    last = chunk_choice(c, chat, None, c.finish_reason(), logprobs=lps)
                    last["smcspec"] = self.extra(c)
                    yield self._chunk([last])
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield self._chunk([], self.usage())
            yield sse("[DONE]")
        finally:  # client gone (or done): free the rows of anything still running
            self.cancel_open()

    def _echo_chunk(self, c: ResponseChoice) -> str:
        c.chars_sent = len(c.echo or "")
        lps = self.echo_logprobs(c)
        return self._chunk([chunk_choice(c, False, c.echo, None, logprobs=lps)])

    def _chunk_logprobs(self, c: ResponseChoice, entries: list) -> dict | None:
        if not entries:
            return None
        return self.logprobs_object(c, entries, c.chars_sent)

    def _text_chunks(self, c: ResponseChoice, deltas: list[dict[str, Any]]) -> list[str]:
        """The chunks of choice ``c``'s new ``deltas`` (chat: one each; completions: one of
        their joined text), the first with the log-probabilities of the tokens they hold."""
        if not deltas:
            return []
        lps = self._chunk_logprobs(c, c.take_logprobs())
        if self.chat:
            out = []
            for delta in deltas:
                out.append(self._chunk([chunk_choice(c, True, None, None, delta=delta,
                                                     logprobs=lps)]))  # fmt: skip
                lps = None
            return out
        text = "".join(d["content"] for d in deltas)
        chunk = self._chunk([chunk_choice(c, False, text, None, logprobs=lps)])
        c.chars_sent += len(text)
        return [chunk]


async def create_completion(
    state: ServerState, request: Request, body: CommonBody, prompts: list[Any], chat: bool
) -> dict[str, Any] | Response:
    """Serve one ``/v1/completions`` (its prompts) or ``/v1/chat/completions`` (one prompt:
    its messages) request."""
    cfg = generation_config(state, body)
    # tokenizing and compiling the constraint take a while (seconds for a large schema):
    # on a worker thread, so that the event loop serves other requests meanwhile
    jobs = await asyncio.to_thread(prepare_jobs, state, body, cfg, prompts, chat)
    completion = Completion(state, body, prompts, chat, cfg, jobs)
    completion.submit()
    if body.stream:
        return StreamingResponse(completion.stream(), media_type="text/event-stream")
    return await completion.respond(request)
