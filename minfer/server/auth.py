"""``--api-key``: every route but a short open list needs ``Authorization: Bearer <key>``.

Protected by default, open by name: a route added later is guarded without anyone remembering to
guard it, and a path no route matches (``/v1/../tokenize``, say) is refused before routing looks at
it. Open are the probes and the pages that carry no model output (``/health``, ``/metrics``,
``/version``, the demo page and its stats, the API docs), as vLLM leaves ``/health`` and ``/metrics``
open for load balancers and scrapers. A pure ASGI middleware, not Starlette's ``BaseHTTPMiddleware``:
it reads only the headers and passes streamed responses through untouched.
"""
from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable, Iterable

from minfer.server.errors import error_body

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/", "/stats", "/favicon.ico",
                        "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
ENV_VAR = "MINFER_API_KEY"


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first ``Authorization: Bearer ...`` header (the scheme is case-insensitive)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class APIKeyMiddleware:
    """Answer 401 in OpenAI's error shape to a protected request without the key.

    ``open_prefixes``: folders served without a key (static assets of the pages in ``OPEN_PATHS``).
    The comparison takes the same time whatever the sent key shares with the real one.
    """

    def __init__(self, app: ASGIApp, api_key: str, open_prefixes: tuple[str, ...] = ()) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.app, self.key, self.open_prefixes = app, api_key.encode(), open_prefixes

    def is_open(self, path: str) -> bool:
        return path in OPEN_PATHS or any(path.startswith(prefix) for prefix in self.open_prefixes)

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":  # CORS preflights carry no credentials
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        token = bearer_token(scope.get("headers", ()))
        if self.is_open(path) or (token is not None and hmac.compare_digest(token, self.key)):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send the header 'Authorization: Bearer <key>'" if token is None
                   else "incorrect API key")
        body = json.dumps(error_body(401, message, code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
