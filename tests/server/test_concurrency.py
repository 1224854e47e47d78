"""Many clients at once: all complete correctly; clients that leave free their KV blocks at once."""
from __future__ import annotations

import asyncio
import re
import socket
import time
from typing import Any

import httpx
import pytest

from .conftest import MODEL_NAME

openai = pytest.importorskip("openai")

PROMPTS = [f"def f{i}(x):\n    return x * {i}" for i in range(32)]


def _metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_32_concurrent_streams_complete_correctly(server: Any, openai_client: Any) -> None:
    # The reference: each prompt alone, greedy, not streamed.
    expected = [openai_client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=20, temperature=0)
                .choices[0].text for p in PROMPTS]
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    max_running = 0

    async def one(prompt: str) -> tuple[str, str | None]:
        text, reason = "", None
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0,
                                                 stream=True)
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def watch(task: asyncio.Future) -> None:
        nonlocal max_running
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            while not task.done():
                max_running = max(max_running, (await http.get("/stats")).json()["num_running"])
                await asyncio.sleep(0.02)

    async def main() -> list[tuple[str, str | None]]:
        task = asyncio.ensure_future(asyncio.gather(*(one(p) for p in PROMPTS)))
        await watch(task)
        await client.close()
        return await task

    results = asyncio.run(asyncio.wait_for(main(), 120))
    assert [text for text, _ in results] == expected
    assert all(reason in ("stop", "length") for _, reason in results)
    assert max_running > 1, "the streams should have shared the engine's batch"
    assert server.wait_idle()["kv_blocks_used"] == 0


def _open_stream(server: Any, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def test_disconnected_clients_free_their_kv_blocks(server: Any) -> None:
    aborted_before = _metric(httpx.get(server.base_url + "/metrics").text, "minfer_requests_total",
                             '{finish_reason="abort"}')
    body = (b'{"model": "%s", "prompt": "def main():", "max_tokens": 400, "ignore_eos": true, "stream": true}'
            % MODEL_NAME.encode())
    socks = [_open_stream(server, body) for _ in range(8)]
    for sock in socks:  # wait until every stream has produced some tokens
        received = b""
        while received.count(b"data:") < 3:
            received += sock.recv(65536)
    during = server.stats()
    assert during["num_running"] == 8 and during["kv_blocks_used"] > 0
    for sock in socks:
        sock.close()
    after = server.wait_idle(timeout=60)
    assert after["kv_blocks_used"] == 0 and after["num_running"] == 0, after
    metrics = httpx.get(server.base_url + "/metrics").text
    assert _metric(metrics, "minfer_kv_blocks_used") == 0
    # aborted, not run to their 400 tokens
    assert _metric(metrics, "minfer_requests_total", '{finish_reason="abort"}') == aborted_before + 8


def test_disconnect_while_waiting_for_a_whole_response(server: Any) -> None:
    body = b'{"model": "%s", "prompt": "import os", "max_tokens": 450, "ignore_eos": true}' % MODEL_NAME.encode()
    sock = _open_stream(server, body)
    deadline = time.monotonic() + 10
    while server.stats()["num_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.stats()["kv_blocks_used"] > 0
    sock.close()
    after = server.wait_idle(timeout=10)
    assert after["kv_blocks_used"] == 0 and after["num_running"] == 0, after
