"""ASGI middlewares that stand in front of every route: API-key auth and a body-size limit.

Both answer in OpenAI's error shape (:mod:`smcspec.server.api_errors`) before any handler runs.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from smcspec.server.api_errors import error_response


class ApiKeyAuth:
    """Requests must carry ``Authorization: Bearer <key>``, else 401; ``open_paths`` are exempt.

    The scheme name is matched in any case (``bearer``, ``BEARER``: RFC 7235 section 2.1
    makes it case-insensitive); the key itself is compared exactly, in constant time
    (``hmac.compare_digest``).
    """

    def __init__(self, app: ASGIApp, key: str, open_paths: frozenset[str]) -> None:
        self.app, self.expected, self.open_paths = app, key.encode(), open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.strip().partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
            return await self.app(scope, receive, send)
        message = (
            "missing API key: send 'Authorization: Bearer <key>'"
            if not given
            else "invalid API key"
        )
        response = error_response(
            401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
        await response(scope, receive, send)


class BodySizeLimit:
    """Refuse request bodies over ``max_bytes`` with 413, without buffering them.

    A ``Content-Length`` over the limit is answered at once, before any of the body is read.
    A body without one (chunked) is counted as it arrives: once over the limit, the app is
    told the body ended, and whatever it answers is replaced by the 413.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self):
        return error_response(
            413, f"the request body is larger than the limit of {self.max_bytes} bytes"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                response = error_response(400, "the Content-Length header is not a number")
                return await response(scope, receive, send)
            if int(length) > self.max_bytes:
                return await self._too_large()(scope, receive, send)
        received, over, answered = 0, False, False

        async def counted_receive() -> Message:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal answered
            if not over:
                return await send(message)
            if not answered:
                answered = True
                await self._too_large()(scope, receive, send)

        await self.app(scope, counted_receive, guarded_send)
