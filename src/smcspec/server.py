"""OpenAI-compatible HTTP server: ``smcspec serve``.

FastAPI + uvicorn. Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``stream: true`` as server-sent events ending in ``data: [DONE]``, and
``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text). SMC-SD controls travel in an extra ``smc`` object
(``{"method", "particles", "draft_tokens", "draft_temperature", "alpha", "ess_threshold",
"resampler"}``); responses carry ``usage`` and an extra ``smcspec`` object with the
decoder's statistics. Requests are decoded together by :class:`BatchScheduler`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from smcspec.config import GenerationConfig
from smcspec.engine import Engine, GenerationResult, TextStreamer
from smcspec.errors import ConfigError, ContextLengthError, SmcspecError
from smcspec.metrics import ServerMetrics
from smcspec.scheduler import BatchScheduler, QueueFullError
from smcspec.scheduler import Request as EngineRequest

MAX_N = 8


class SmcOptions(BaseModel):
    """The ``smc`` extra field: per-request decoder settings (server defaults otherwise)."""

    model_config = ConfigDict(extra="forbid")
    method: Literal["smc", "sd", "ar"] | None = None
    particles: int | None = None
    draft_tokens: int | None = None
    draft_temperature: float | None = None
    alpha: float | None = None
    ess_threshold: float | None = None
    resampler: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    smc: SmcOptions | None = None


class CompletionBody(_Common):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back possible partial matches."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, piece: str, final: bool = False) -> str:
        """Add ``piece``; returns the text that can be sent now."""
        if self.stopped:
            return ""
        self.text += piece
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            final = True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : end], end
        return out


class _Choice:
    """One generated sequence of a request: engine request, text and stop handling."""

    def __init__(self, index: int, stops: list[str]) -> None:
        self.index = index
        self.matcher = StopMatcher(stops)
        self.engine_req: EngineRequest | None = None
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None


def create_app(
    engine: Engine,
    defaults: GenerationConfig | None = None,
    model_name: str = "smcspec",
    max_running: int = 16,
    max_waiting: int = 64,
) -> FastAPI:
    """Build the ASGI app serving ``engine`` (the scheduler starts with the app's lifespan).

    Args:
        defaults: decoding settings used where a request does not give its own.
        model_name: the id clients pass as ``model`` (also listed by ``/v1/models``).
        max_running, max_waiting: see :class:`BatchScheduler`.
    """
    defaults = (defaults or GenerationConfig()).validate()
    metrics = ServerMetrics()
    scheduler = BatchScheduler(engine, max_running, max_waiting, on_step=metrics.observe_step)
    metrics.bind_scheduler(scheduler)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="smcspec", lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.engine = scheduler, metrics, engine

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return _error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:])
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg = "the request body is not valid JSON"
        return _error(
            400, f"{loc + ': ' if loc else ''}{msg}", "invalid_request_error", loc or None
        )

    @app.get("/health")
    async def health():
        if scheduler.alive:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return PlainTextResponse(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "smcspec"}],
        }

    def config_for(body: _Common) -> GenerationConfig:
        if body.model is not None and body.model != model_name:
            raise ApiError(
                400,
                f"unknown model {body.model!r}; this server serves {model_name!r}",
                param="model",
            )
        if not 1 <= body.n <= MAX_N:
            raise ApiError(400, f"n must be in [1, {MAX_N}]", param="n")
        updates: dict[str, Any] = {}
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is not None:
            updates["max_new_tokens"] = max_tokens
        if body.temperature is not None:
            updates["temperature"] = body.temperature
        if body.seed is not None:
            updates["seed"] = body.seed
        if body.smc is not None:
            updates.update({k: v for k, v in body.smc.model_dump().items() if v is not None})
        try:
            return replace(defaults, **updates).validate()
        except ConfigError as exc:
            raise ApiError(400, str(exc)) from exc

    async def handle(body: _Common, prompt, chat: bool, kind: str):
        cfg = config_for(body)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            jobs = [
                engine.prepare(
                    prompt, replace(cfg, seed=None if cfg.seed is None else cfg.seed + i), chat
                )
                for i in range(body.n)
            ]
        except (ConfigError, ContextLengthError) as exc:
            raise ApiError(400, str(exc)) from exc
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        choices = [_Choice(i, stops) for i in range(body.n)]
        created, rid = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"

        def send(item) -> None:  # called on the scheduler's thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is closed (shutdown): nobody to tell
                pass

        for choice, job in zip(choices, jobs, strict=True):

            def on_text(piece: str, c: _Choice = choice) -> None:
                send(("text", c, piece))

            streamer = TextStreamer(engine.tokenizer, on_text)

            def on_done(outcome, c: _Choice = choice) -> None:
                send(("done", c, outcome))

            choice.engine_req = EngineRequest(job=job, on_tokens=streamer, on_done=on_done)
        submitted = []
        try:
            for choice in choices:
                scheduler.submit(choice.engine_req)
                submitted.append(choice)
        except QueueFullError as exc:
            for c in submitted:
                c.engine_req.cancel()
            metrics.requests.labels(cfg.method, "rejected").inc()
            raise ApiError(429, f"server overloaded: {exc}", "rate_limit_error") from exc

        def finish_reason(c: _Choice) -> str:
            if c.matcher.stopped:
                return "stop"
            r = c.result
            return "length" if r is not None and r.new_tokens >= cfg.max_new_tokens else "stop"

        def usage() -> dict:
            done = [c.engine_req.tokens for c in choices]
            return {
                "prompt_tokens": len(jobs[0].ids),
                "completion_tokens": sum(done),
                "total_tokens": len(jobs[0].ids) + sum(done),
            }

        def extra(c: _Choice) -> dict:
            return {"method": cfg.method, **(c.result.stats if c.result else {})}

        def record(c: _Choice, outcome: str) -> None:
            metrics.observe_request(cfg.method, outcome, c.engine_req, c.result, len(jobs[0].ids))

        async def events():
            """(kind, choice, payload) until every choice is done; stop strings cancel."""
            remaining = len(choices)
            while remaining:
                what, c, payload = await queue.get()
                if what == "text":
                    delta = c.matcher.feed(payload)
                    if c.matcher.stopped:
                        c.engine_req.cancel()
                    yield "text", c, delta
                    continue
                remaining -= 1
                if isinstance(payload, GenerationResult):
                    c.result = payload
                    record(c, "success")
                elif c.matcher.stopped:
                    record(c, "stopped")
                else:
                    c.error = payload
                    record(c, "error")
                yield "done", c, c.matcher.feed("", final=True)

        if not body.stream:
            async for _ in events():
                pass
            failed = [c for c in choices if c.error is not None]
            if failed:
                raise ApiError(500, f"generation failed: {failed[0].error}", "server_error")
            out = []
            for c in choices:
                entry = {"index": c.index, "finish_reason": finish_reason(c), "smcspec": extra(c)}
                if chat:
                    entry["message"] = {"role": "assistant", "content": c.matcher.text}
                else:
                    entry["text"], entry["logprobs"] = c.matcher.text, None
                out.append(entry)
            return {
                "id": rid,
                "object": kind,
                "created": created,
                "model": model_name,
                "choices": out,
                "usage": usage(),
            }

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(c: _Choice, text: str | None, reason: str | None, first: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                if text:
                    delta["content"] = text
                choice = {"index": c.index, "delta": delta, "finish_reason": reason}
            else:
                choice = {
                    "index": c.index,
                    "text": text or "",
                    "finish_reason": reason,
                    "logprobs": None,
                }
            if reason is not None:
                choice["smcspec"] = extra(c)
            body_: dict[str, Any] = {
                "id": rid,
                "object": chunk_kind,
                "created": created,
                "model": model_name,
                "choices": [choice],
            }
            if include_usage:
                body_["usage"] = None
            return f"data: {json.dumps(body_)}\n\n"

        async def sse():
            try:
                if chat:
                    for c in choices:
                        yield chunk(c, None, None, first=True)
                async for what, c, text in events():
                    if what == "text":
                        if text:
                            yield chunk(c, text, None)
                        continue
                    if c.error is not None:
                        err = {
                            "error": {
                                "message": f"generation failed: {c.error}",
                                "type": "server_error",
                                "param": None,
                                "code": None,
                            }
                        }
                        yield f"data: {json.dumps(err)}\n\n"
                        continue
                    if text:
                        yield chunk(c, text, None)
                    yield chunk(c, None, finish_reason(c))
                if include_usage:
                    tail = {
                        "id": rid,
                        "object": chunk_kind,
                        "created": created,
                        "model": model_name,
                        "choices": [],
                        "usage": usage(),
                    }
                    yield f"data: {json.dumps(tail)}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # client gone (or done): free the rows of anything still running
                for c in choices:
                    if c.result is None and c.error is None and not c.matcher.stopped:
                        c.engine_req.cancel()
                        record(c, "cancelled")

        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        if isinstance(body.prompt, str) and not body.prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return await handle(body, body.prompt, chat=False, kind="text_completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        messages = [m.model_dump() for m in body.messages]
        return await handle(body, messages, chat=True, kind="chat.completion")

    return app


def serve(engine: Engine, host: str, port: int, **kwargs) -> None:
    """Run the server with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(create_app(engine, **kwargs), host=host, port=port, log_level="info")


__all__ = ["ApiError", "SmcspecError", "create_app", "serve"]
