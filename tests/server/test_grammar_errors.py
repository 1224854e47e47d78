"""A constraint whose grammar does not compile in time is a 400 naming the limit's flag, streamed or not (the
error comes before any token, so the status line carries it), and the server goes on serving. On the built-in
model, where a 9,000-entry enum compiles for seconds: far past ``--structured-outputs-compile-timeout 0.05``."""
from __future__ import annotations

import uuid
from typing import Iterator

import httpx
import pytest

from minfer.llm import builtin_model_path

from .conftest import MODEL_NAME, LiveServer


@pytest.fixture(scope="module")
def slow_limit_server() -> Iterator[LiveServer]:
    live = LiveServer(builtin_model_path(), structured_outputs_compile_timeout=0.05)
    yield live
    live.stop()


def big_enum_body(stream: bool) -> dict:
    tag = uuid.uuid4().hex[:8]  # a key compiled by no other request
    schema = {"enum": [f"{tag} value number {i}" for i in range(9000)]}
    return {"model": MODEL_NAME, "prompt": "data = ", "max_tokens": 8, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_compile_past_the_limit_is_a_400_naming_the_flag(slow_limit_server: LiveServer, stream: bool) -> None:
    with httpx.Client(base_url=slow_limit_server.base_url, timeout=180) as http:
        r = http.post("/v1/completions", json=big_enum_body(stream))
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "within the limit of 0.05 s" in message and "--structured-outputs-compile-timeout" in message

        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 5,
                                               "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
    stats = slow_limit_server.wait_idle()
    assert stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0
