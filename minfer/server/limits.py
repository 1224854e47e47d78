"""A cap on request bodies, checked before anything parses them: a 413 in OpenAI's error shape.

Parsing and validating JSON runs on the event loop, so an unbounded body is an unbounded stall of
every client; the cap bounds it (16 MiB parse in well under a second). A declared
``Content-Length`` past the cap is refused before a byte of the body is read; a chunked body is
counted as it arrives and refused as soon as it passes the cap. The body is then handed on whole,
and later ``receive`` calls go to the client again, so a disconnect is still seen.
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from minfer.server.errors import error_body

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodySizeLimitMiddleware:
    """ASGI middleware: HTTP request bodies over ``max_request_bytes`` get a 413 (``None`` disables it)."""

    def __init__(self, app: ASGIApp, max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.max_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.max_bytes is None:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, declared)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the body ended
                await self.app(scope, _replay([], message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, size, at_least=True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], None, receive), send)

    async def _refuse(self, send: Send, size: int, at_least: bool = False) -> None:
        message = (f"the request body is {'over ' if at_least else ''}{size} bytes, more than this server accepts "
                   f"({self.max_bytes} bytes, --max-request-bytes)")
        payload = json.dumps(error_body(413, message, None, "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(messages: list[Message], last: Message | None, receive: Receive) -> Receive:
    """A ``receive`` that returns ``messages`` (then ``last``) first, then the client's own."""
    pending = list(messages) + ([last] if last is not None else [])

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
