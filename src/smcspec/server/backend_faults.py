"""What ``smcspec serve`` does when llama.cpp fails fatally (see
:mod:`smcspec.backends.llamacpp.faults`): a lost RPC server or a GPU error ends the process,
but first every request running or queued gets an OpenAI-shaped 500 (a streamed one an error
event and ``[DONE]``), later requests a 503, ``/health`` turns 503, and the HTTP server shuts
down gracefully; then the process exits with status 1 for its supervisor to restart it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from smcspec.engine import Engine
from smcspec.errors import BackendFailure
from smcspec.scheduler import BatchScheduler

log = logging.getLogger(__name__)


@contextmanager
def fail_requests_on_abort(
    engine: Engine, scheduler: BatchScheduler, stop_server: Callable[[], None], grace_s: float
) -> Iterator[None]:
    """While inside, a llama.cpp abort fails the scheduler's requests, calls ``stop_server``,
    waits until the scheduler is stopped by the server's shutdown (at most ``grace_s``
    seconds, so the errors reach the clients), then ends the process with status 1.

    Does nothing for an engine without a llamacpp model (torch errors are exceptions,
    handled per request by the scheduler).
    """
    models = [m for m in (engine.target, engine.draft) if m is not None]
    if not any(m.backend == "llamacpp" for m in models):
        yield
        return
    from smcspec.backends.llamacpp.faults import on_abort

    def handler(message: str) -> None:
        log.critical("llama.cpp failed fatally (%s): failing every request, then exiting", message)
        scheduler.abandon(BackendFailure(f"the model's backend failed: {message}"))
        stop_server()
        if threading.current_thread() is not threading.main_thread():  # the loop still runs
            scheduler.stopping.wait(grace_s)
        for h in logging.getLogger().handlers:
            h.flush()
        sys.stderr.flush()
        os._exit(1)  # before ggml's abort(): a plain failure status, no core dump

    with on_abort(handler):
        yield
