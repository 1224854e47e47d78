"""uvicorn's HTTP protocol, with the one answer it writes itself in OpenAI's error shape: the 400 for a
request its parser refuses.

A request h11 or httptools cannot parse (a NUL or a bare CR in a header, a bad request line, and under h11 a
missing or repeated Host) never reaches the app: uvicorn answers it from the protocol with a plain-text
``Invalid HTTP request received.``. ``http_protocol()`` subclasses the protocol uvicorn would pick and writes
that 400 as ``{"error": {...}}`` with the parser's reason instead; pass it as ``uvicorn.Config(http=...)``.
Everything else, parsing included, is uvicorn's own.
"""
from __future__ import annotations

import asyncio
import json
import sys
from functools import lru_cache
from typing import Any

from minfer.server.errors import error_body

MALFORMED_CODE = "malformed_http_request"


def malformed_request_response(reason: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The whole 400 response, status line to body; the connection closes after it."""
    message = "the request is not valid HTTP" + (f": {reason[:200]}" if reason else "")
    body = json.dumps(error_body(400, message, None, MALFORMED_CODE)).encode()
    head = [b"HTTP/1.1 400 Bad Request"] + [name + b": " + value for name, value in default_headers] + [
        b"content-type: application/json", b"content-length: " + str(len(body)).encode(), b"connection: close"]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


@lru_cache(maxsize=None)
def http_protocol(name: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol ``name`` (``auto``: httptools when installed, else h11) answering unparsable
    requests in OpenAI's error shape."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    base: Any = import_from_string(HTTP_PROTOCOLS.get(name, name))

    class OpenAIErrorProtocol(base):  # type: ignore[misc, valid-type]
        def send_400_response(self, msg: str) -> None:
            """Called by uvicorn inside its ``except`` for the parser's error, so ``sys.exc_info`` holds it."""
            cycle = getattr(self, "cycle", None)
            if cycle is not None and cycle.response_started and not cycle.response_complete:
                self.transport.close()  # mid-response no status line can be sent: the client sees the body end
                return
            error = sys.exc_info()[1]
            self.transport.write(malformed_request_response(str(error or ""), self.server_state.default_headers))
            self.transport.close()

    OpenAIErrorProtocol.__name__ = OpenAIErrorProtocol.__qualname__ = f"OpenAIError{base.__name__}"
    return OpenAIErrorProtocol
