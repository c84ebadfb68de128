"""OpenAI-compatible HTTP server: ``smcspec serve``.

FastAPI + uvicorn. Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``stream: true`` as server-sent events ending in ``data: [DONE]``, and
``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text). SMC-SD controls travel in an extra ``smc`` object; responses carry
``usage`` and an extra ``smcspec`` object with the decoder's statistics. Requests are
decoded together by :class:`~smcspec.scheduler.BatchScheduler`.

Modules: :mod:`.schemas` (request bodies), :mod:`.completions` (serving one request),
:mod:`.streaming` (stop strings and response objects), :mod:`.errors` (the one error
shape), :mod:`.guards` (API key and body-size limit), :mod:`.app` (routes and process).
"""

from smcspec.server.api_errors import ApiError
from smcspec.server.app import ServerSettings, create_app, serve

__all__ = ["ApiError", "ServerSettings", "create_app", "serve"]
