"""The background engine loop: it sleeps when idle, survives a step that fails on bad values, its death is loud,
and its queue is bounded."""
from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from .conftest import MODEL_NAME, LiveServer

BODY = {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 400, "ignore_eos": True}


@pytest.fixture()
def own_server(tiny_model: Path) -> Iterator[Any]:
    """A server of the test's own, for tests that break or stall its engine."""
    servers: list[LiveServer] = []

    def start(**kwargs: Any) -> LiveServer:
        servers.append(LiveServer(tiny_model, **kwargs))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def test_idle_loop_sleeps_and_wakes(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    steps = []
    real = server.engine.step
    monkeypatch.setattr(server.engine, "step", lambda: steps.append(1) or real())
    server.wait_idle()
    steps.clear()
    time.sleep(0.5)
    assert steps == [], "the idle engine loop must block, not call step()"
    resp = httpx.post(server.base_url + "/v1/completions", json=dict(BODY, max_tokens=4), timeout=30)
    assert resp.status_code == 200
    assert 4 <= len(steps) <= 6  # prefill + decodes, and nothing after the request finished
    time.sleep(0.3)
    assert len(steps) <= 6


def test_engine_death_fails_requests_and_health(own_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    live = own_server()
    boom = threading.Event()
    real = live.engine.step

    def step() -> Any:
        if boom.is_set():
            raise RuntimeError("boom: simulated device failure at /build/src/kernel.cu:12")
        return real()

    live.engine.step = step  # the engine thread looks the method up on the instance every step
    url = live.base_url
    with httpx.Client(base_url=url, timeout=30) as c, ThreadPoolExecutor(1) as pool, \
            caplog.at_level(logging.ERROR, logger="minfer.async_engine"):
        whole = pool.submit(c.post, "/v1/completions", json=BODY)  # in flight, not streamed
        with c.stream("POST", "/v1/completions", json=dict(BODY, stream=True)) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            for line in lines:  # some tokens arrive...
                if line.startswith("data:"):
                    break
            deadline = time.monotonic() + 10
            while c.get("/stats").json()["num_running"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            boom.set()  # ...then the engine dies with both requests running
            rest = [line for line in lines if line.startswith("data:")]
        # clients read what failed, not the error's text (which can hold paths): that goes to the log
        failure = "the engine step raised RuntimeError"
        assert any('"error"' in line and failure in line for line in rest), rest[-3:]
        assert not any("boom" in line or "/build" in line for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]"
        resp = whole.result(timeout=30)
        assert resp.status_code == 500 and failure in resp.json()["error"]["message"], resp.json()
        assert "boom" not in resp.text and resp.json()["error"]["code"] == "engine_dead"
        health = c.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "engine_dead", "error": failure}
        late = c.post("/v1/completions", json=BODY)  # (a hang would end in the client's timeout)
        assert late.status_code == 500
        assert late.json()["error"]["code"] == "engine_dead" and "boom" not in late.text
        late_stream = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "stream": True})
        assert late_stream.status_code == 500
        assert "minfer_engine_healthy 0.0" in c.get("/metrics").text
    died = [r for r in caplog.records if "engine loop died" in r.getMessage()]
    assert died and died[0].exc_info and "boom" in str(died[0].exc_info[1])  # the full error, in the log


def test_a_tensor_parallel_failure_is_named_without_its_text(own_server: Any) -> None:
    """/health and the requests name a failed rank as the error's summary says, never its text (gloo's names a
    source file of the build); and the app's ``on_engine_dead`` hook hears of it once."""
    from minfer.engine.tp_workers import TensorParallelError

    live = own_server()
    heard: list[str] = []
    live.async_engine.on_dead = heard.append
    summary = "a tensor-parallel worker died (rank 1, signal SIGKILL)"

    def step() -> Any:
        raise TensorParallelError("tensor-parallel worker rank 1 (pid 4242) exited with signal SIGKILL: "
                                  "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed", summary)

    live.engine.step = step
    with httpx.Client(base_url=live.base_url, timeout=30) as c:
        resp = c.post("/v1/completions", json=BODY)
        assert resp.status_code == 500 and summary in resp.json()["error"]["message"], resp.json()
        assert "pair.cc" not in resp.text and "4242" not in resp.text
        assert c.get("/health").json() == {"status": "engine_dead", "error": summary}
    assert heard == [summary]


def test_step_failure_on_bad_values_fails_only_the_requests_in_flight(own_server: Any,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A step that raises on the host from a value no check caught (like the int64 overflow the fuzz test once
    found in top_k) fails the requests it was serving with a 500; the engine stays up, holds no KV block, and
    later requests get the tokens a fresh engine gives."""
    live = own_server()
    short = dict(BODY, max_tokens=8, temperature=0)
    url = live.base_url
    with httpx.Client(base_url=url, timeout=30) as c:
        before = c.post("/v1/completions", json=short)
        assert before.status_code == 200
        fail_once = threading.Event()
        real = live.engine.step

        def step() -> Any:
            if fail_once.is_set():
                fail_once.clear()
                raise OverflowError("simulated: a value too large for int64")
            return real()

        live.engine.step = step
        with caplog.at_level(logging.ERROR, logger="minfer.async_engine"), \
                c.stream("POST", "/v1/completions", json=dict(BODY, stream=True)) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            for line in lines:
                if line.startswith("data:"):
                    break
            fail_once.set()
            rest = [line for line in lines if line.startswith("data:")]
        assert any('"error"' in line and "too large for int64" in line for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]"
        assert any("a step failed" in r.getMessage() for r in caplog.records)
        assert c.get("/health").status_code == 200
        idle = live.wait_idle()
        assert idle["kv_blocks_used"] == 0 and idle["num_running"] == 0
        after = c.post("/v1/completions", json=short)
        assert after.status_code == 200
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        assert "minfer_engine_healthy 1.0" in c.get("/metrics").text


def test_steps_failing_in_a_row_end_the_loop(own_server: Any) -> None:
    """A failure that repeats (MAX_FAILED_STEPS steps in a row, here one per request) is not recovered from."""
    from minfer.engine.async_engine import MAX_FAILED_STEPS

    live = own_server()

    def step() -> Any:
        raise ValueError("simulated: always")

    live.engine.step = step
    with httpx.Client(base_url=live.base_url, timeout=30) as c:
        for _ in range(MAX_FAILED_STEPS - 1):
            resp = c.post("/v1/completions", json=BODY)
            assert resp.status_code == 500 and "simulated: always" in resp.json()["error"]["message"]
            assert c.get("/health").status_code == 200
        last = c.post("/v1/completions", json=BODY)
        assert last.status_code == 500 and last.json()["error"]["code"] == "engine_dead"
        assert "the engine step raised ValueError" in last.json()["error"]["message"]
        assert c.get("/health").status_code == 503
        assert c.post("/v1/completions", json=BODY).json()["error"]["code"] == "engine_dead"


def test_queue_limit_returns_503_with_retry_after(own_server: Any) -> None:
    live = own_server(max_waiting_requests=2)
    gate = threading.Event()
    real = live.engine.step

    def gated_step() -> Any:
        gate.wait(30)
        return real()

    live.engine.step = gated_step
    body = dict(BODY, max_tokens=3)
    with httpx.Client(base_url=live.base_url, timeout=30) as c, ThreadPoolExecutor(2) as pool:
        admitted = [pool.submit(c.post, "/v1/completions", json=body) for _ in range(2)]
        deadline = time.monotonic() + 10
        while c.get("/stats").json()["num_waiting_requests"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        refused = c.post("/v1/completions", json=body)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        err = refused.json()["error"]
        assert err["code"] == "queue_full" and "retry" in err["message"]
        gate.set()
        assert [f.result(timeout=30).status_code for f in admitted] == [200, 200]
        assert c.post("/v1/completions", json=body).status_code == 200


def test_stream_closed_before_its_first_token(own_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    live = own_server()
    gate = threading.Event()
    real = live.engine.step

    def gated_step() -> Any:
        gate.wait(30)
        return real()

    live.engine.step = gated_step
    body = b'{"prompt": "def f():", "max_tokens": 300, "ignore_eos": true, "stream": true}'
    with caplog.at_level(logging.ERROR):
        sock = socket.create_connection(("127.0.0.1", live.port), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while live.async_engine.stats()["num_waiting_requests"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        sock.close()  # gone while its request waits for the stalled engine
        while live.async_engine.stats()["num_waiting_requests"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert live.async_engine.stats()["num_waiting_requests"] == 0, "the server should notice the disconnect"
        gate.set()
        after = live.wait_idle(timeout=10)
    assert after["kv_blocks_used"] == 0 and after["num_running"] == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records
