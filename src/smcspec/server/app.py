"""The ASGI app (:func:`create_app`) and the process that serves it (:func:`serve`)."""

from __future__ import annotations

import ipaddress
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from smcspec.chunked_prefill import default_chunk
from smcspec.config import GenerationConfig
from smcspec.engine import Engine
from smcspec.errors import ConfigError
from smcspec.metrics import ServerMetrics
from smcspec.potentials import COMPILE_BUDGET_S, MASK_BUDGET_S, GrammarBudget
from smcspec.scheduler import BatchScheduler
from smcspec.server.api_errors import ApiError, install_error_handlers
from smcspec.server.backend_faults import fail_requests_on_abort
from smcspec.server.completions import ServerState, create_completion
from smcspec.server.guards import ApiKeyAuth, BodySizeLimit
from smcspec.server.schemas import ChatBody, CompletionBody

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    """How the server runs.

    Attributes:
        model_name: the id clients pass as ``model`` (also listed by ``/v1/models``).
        max_running: requests decoded together (see :class:`BatchScheduler`).
        max_waiting: queued requests beyond this get 429.
        max_request_bytes: larger request bodies get 413 before they are read.
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer KEY``.
        public_metrics: with an ``api_key``, leave ``/metrics`` open (Prometheus scrapers).
        shutdown_timeout_s: on SIGTERM/SIGINT, in-flight requests get this long to finish
            before they are cancelled.
        leak_grace_s: a model's pool in use, or unable to admit the first waiting request,
            while nothing runs for this long is a leak: the worker stops, ``/health`` turns
            503 and :func:`serve` exits with 1 for a supervisor to restart it.
        prefill_chunk: prompts are cut every ``prefill_chunk`` tokens (always at the same
            places: a prompt's logits do not depend on timing), each chunk prefilled in a
            scheduler step between the other requests' forwards; None: 128 with the target
            on a CPU, 512 on a GPU (:func:`smcspec.chunked_prefill.default_chunk`).
        prefill_step_s: seconds of prefill a scheduler step aims at: a step starts another
            chunk while its prefill is expected to stay within it (the first chunk always
            runs); with the 0.1 s disconnect poll, one chunk's time bounds how soon a
            request whose client left is dropped.
        grammar_compile_s: seconds a request's constraint (response_format, tools,
            smc.regex/grammar) may take to compile; past it the request gets a 400 naming
            the limit (:class:`~smcspec.potentials.GrammarBudget`). Compiling runs off the
            event loop, so other requests are served meanwhile.
        grammar_mask_s: seconds one token mask of a constraint may take while decoding;
            past it the request fails with a 400 naming the limit.
    """

    model_name: str = "smcspec"
    max_running: int = 16
    max_waiting: int = 64
    max_request_bytes: int = 4 * 1024 * 1024
    api_key: str | None = None
    public_metrics: bool = False
    shutdown_timeout_s: float = 5.0
    leak_grace_s: float = 10.0
    prefill_chunk: int | None = None
    prefill_step_s: float = 1.0
    grammar_compile_s: float = COMPILE_BUDGET_S
    grammar_mask_s: float = MASK_BUDGET_S

    def validate(self) -> ServerSettings:
        """Raises :class:`ConfigError` for out-of-range values; returns ``self``."""
        if self.max_running < 1 or self.max_waiting < 0:
            raise ConfigError("max_running must be >= 1 and max_waiting >= 0")
        if self.max_request_bytes < 1024:
            raise ConfigError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key must not be empty")
        if self.shutdown_timeout_s < 0:
            raise ConfigError("shutdown_timeout_s must be >= 0")
        if not self.leak_grace_s > 0:
            raise ConfigError("leak_grace_s must be > 0")
        chunk = 1 if self.prefill_chunk is None else self.prefill_chunk
        if chunk < 1 or not 0 < self.prefill_step_s <= 60:
            raise ConfigError(
                "prefill_chunk must be >= 1 and prefill_step_s in (0, 60], got "
                f"{self.prefill_chunk} and {self.prefill_step_s}"
            )
        self.grammar_budget()
        return self

    def grammar_budget(self) -> GrammarBudget:
        """The constraints' time limits. Raises :class:`ConfigError` for a limit <= 0."""
        return GrammarBudget(self.grammar_compile_s, self.grammar_mask_s)


def create_app(
    engine: Engine,
    defaults: GenerationConfig | None = None,
    settings: ServerSettings | None = None,
    **overrides,
) -> FastAPI:
    """Build the ASGI app serving ``engine``; the scheduler runs with the app's lifespan.

    Args:
        defaults: decoding settings used where a request does not give its own.
        settings: :class:`ServerSettings`; keyword ``overrides`` replace its fields
            (``create_app(engine, model_name="x", max_waiting=1)``).
    Raises:
        ConfigError: invalid defaults or settings.
    """
    settings = replace(settings or ServerSettings(), **overrides).validate()
    defaults = (defaults or GenerationConfig()).validate()
    metrics = ServerMetrics()
    scheduler = BatchScheduler(
        engine,
        settings.max_running,
        settings.max_waiting,
        on_step=metrics.observe_step,
        leak_grace_s=settings.leak_grace_s,
        prefill_chunk=settings.prefill_chunk or default_chunk(engine.target.model.device),
        prefill_step_s=settings.prefill_step_s,
    )
    metrics.bind_scheduler(scheduler)
    state = ServerState(
        engine, scheduler, metrics, defaults, settings.model_name, settings.grammar_budget()
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="smcspec", lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.engine = scheduler, metrics, engine
    app.state.settings = settings
    install_error_handlers(app)
    _add_routes(app, state)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    if settings.api_key is not None:  # added last: the outermost layer
        open_paths = {"/health"} | ({"/metrics"} if settings.public_metrics else set())
        app.add_middleware(ApiKeyAuth, key=settings.api_key, open_paths=frozenset(open_paths))
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    get = ["GET", "HEAD"]  # HEAD wherever GET is served (aiperf probes /metrics with it)

    @app.api_route("/health", methods=get)
    async def health():
        if state.scheduler.alive:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.api_route("/metrics", methods=get)
    async def prometheus_metrics():
        return PlainTextResponse(state.metrics.render(), media_type=state.metrics.content_type)

    @app.api_route("/v1/models", methods=get)
    async def models():
        model = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "smcspec"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        prompts = body.prompts()
        for i, p in enumerate(prompts):
            if isinstance(p, str) and not p:
                where = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
                raise ApiError(400, f"{where} must not be empty", param="prompt")
        return await create_completion(state, request, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        messages = [m.as_template_message() for m in body.messages]
        return await create_completion(state, request, body, [messages], chat=True)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only accepts local connections."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    engine: Engine,
    host: str,
    port: int,
    defaults: GenerationConfig | None = None,
    settings: ServerSettings | None = None,
    **overrides,
) -> int:
    """Serve with uvicorn until SIGINT/SIGTERM, or until the scheduler's worker dies.

    Returns the process exit code: 0 after a signal, 1 if the worker died (a bug), so a
    supervisor restarts the server. In-flight requests get ``shutdown_timeout_s`` to finish.
    If llama.cpp fails fatally (a lost RPC server, a GPU error), requests get a 5xx,
    ``/health`` 503, and the process exits with 1 from inside llama.cpp's abort
    (:mod:`smcspec.server.backend_faults`); this function does not return then.
    """
    import uvicorn

    app = create_app(engine, defaults, settings, **overrides)
    settings = app.state.settings
    if settings.api_key is None and not is_loopback(host):
        log.warning(
            "serving on %s without an API key: anyone who can reach it can use it "
            "(pass --api-key or set SMCSPEC_API_KEY)",
            host,
        )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="info",
            timeout_graceful_shutdown=settings.shutdown_timeout_s,
        )
    )
    scheduler: BatchScheduler = app.state.scheduler

    def stop_server() -> None:
        server.should_exit = True

    def on_fatal(exc: BaseException) -> None:
        log.critical("the scheduler's worker died (%s: %s); stopping", type(exc).__name__, exc)
        stop_server()

    scheduler.on_fatal = on_fatal
    grace_s = settings.shutdown_timeout_s + 5.0
    with fail_requests_on_abort(engine, scheduler, stop_server, grace_s):
        server.run()
    return 1 if scheduler.error is not None else 0
