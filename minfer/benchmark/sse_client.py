"""A minimal HTTP/1.1 client for the benchmark: POST JSON, read the SSE reply event by event.

Why not httpx or aiohttp: the benchmark must run on the GPU machine with nothing installed
beyond torch, and at 256 concurrent streams the client's own per-event cost shows up in the
latencies it measures. This does only what the benchmark needs, on asyncio streams: one
connection per request, chunked or plain bodies, events stamped with their arrival time.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any, AsyncIterator
from urllib.parse import urlsplit


class HTTPStatusError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


def split_url(base_url: str) -> tuple[str, int, str]:
    """'http://host:port/prefix' -> (host, port, '/prefix'); only plain http is supported."""
    parts = urlsplit(base_url)
    if parts.scheme != "http":
        raise ValueError(f"only http:// URLs are supported, got {base_url!r}")
    return parts.hostname or "127.0.0.1", parts.port or 80, parts.path.rstrip("/")


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - a URL the user gave
        return json.loads(resp.read())


async def post_sse(host: str, port: int, path: str, payload: dict[str, Any]) -> AsyncIterator[tuple[float, str]]:
    """Yield (perf_counter time, data) for each ``data:`` event of the response, until it ends."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        body = json.dumps(payload).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                     .encode() + body)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        pieces = _chunks(reader) if headers.get("transfer-encoding") == "chunked" else _until_eof(reader)
        if status != 200:
            raise HTTPStatusError(status, b"".join([p async for p in pieces]).decode(errors="replace"))
        buf = b""
        async for piece in pieces:
            now = time.perf_counter()
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield now, line[5:].strip().decode()
    finally:
        writer.close()


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)
        yield data


async def _until_eof(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while data := await reader.read(65536):
        yield data
