"""One error shape for every 4xx/5xx the server answers.

Every error body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``: request
errors the handlers raise (:class:`ApiError`), body validation and parsing errors, routing
errors (404, 405), and anything unexpected (500, logged with its traceback).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# OpenAI's error types by status
_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


# pydantic's error types for a body that is not a JSON object (form data, an array, ...)
_NOT_AN_OBJECT = ("model_attributes_type", "dict_type", "model_type")


def _body_not_an_object(content_type: str | None) -> str:
    """The message for a body that did not parse as a JSON object, in the client's terms."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        return (
            f"the request body must be a JSON object sent with Content-Type: application/json "
            f"(got {media}; `curl -d` sends form data unless given "
            "-H 'Content-Type: application/json')"
        )
    return "the request body must be a JSON object"


class ApiError(Exception):
    """A request the server refuses: HTTP ``status``, message, OpenAI error type and param."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON body of an error (also sent as an SSE event when a stream fails)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    kind: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A JSON error response with OpenAI's shape."""
    if kind is None:
        kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception the app can raise to :func:`error_response`."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.kind, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:])
        msg = first.get("msg", "invalid request").removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            msg, loc = "the request body is not valid JSON", ""
        elif tuple(first.get("loc", ())) == ("body",) and first.get("type") in _NOT_AN_OBJECT:
            msg = _body_not_an_object(request.headers.get("content-type"))
        return error_response(400, f"{loc + ': ' if loc else ''}{msg}", param=loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"no route {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 400:  # FastAPI's "error parsing the body" (e.g. bad UTF-8)
            message = f"the request body could not be read: {exc.detail}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")
