"""Issue 33: no request may wedge or starve the server. A request's own chat template needs
--trust-request-chat-template, and a render is bounded (a deadline, the client leaving, the server stopping);
a request's template, its constraint checks and its body's parsing each have their own threads, so a plain
request never waits behind them; nothing that grows with a request runs on the event loop (/health answers
while a large body is parsed and its grammar checked).

Ordering, not timing: hostile work is held in flight (a long deadline, or a gate the test opens) while the plain
requests must complete; HTTP timeouts only bound how long a failing test takes."""
from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from minfer.server import serving

from .conftest import LiveServer

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
         "{{ messages[0].content }}")  # 150 bytes, 10^10 iterations
SHORT = 30  # seconds: how long a failing test waits for what never comes


@pytest.fixture()
def live(tiny_model: Path) -> Iterator[LiveServer]:
    server = LiveServer(tiny_model)
    yield server
    server.stop()


def _post(live: LiveServer, path: str, body: dict[str, Any], timeout: float = SHORT) -> httpx.Response:
    return httpx.post(live.base_url + path, json=body, timeout=timeout)


def _plain_requests_complete(live: LiveServer) -> None:
    for path, body in ((COMP, {"prompt": "hello there", "max_tokens": 6}), (CHAT, {"messages": MSGS, "max_tokens": 6})):
        resp = _post(live, path, body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 6


def _open_request(live: LiveServer, path: str, body: dict[str, Any]) -> socket.socket:
    """A request sent on a raw socket, so the test can leave (close it) with the request in flight."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", live.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _wait_for(what: Callable[[], bool], message: str) -> None:
    deadline = time.monotonic() + SHORT
    while not what():
        assert time.monotonic() < deadline, message
        time.sleep(0.02)


def test_request_chat_template_needs_the_trust_flag(tiny_model: Path) -> None:
    server = LiveServer(tiny_model, trust_request_chat_template=False)
    try:
        resp = _post(server, CHAT, {"messages": MSGS, "chat_template": "{{ messages[0].content }}", "max_tokens": 2})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"], err
        resp = _post(server, CHAT, {"messages": MSGS, "max_tokens": 2})  # the server's own template still serves
        assert resp.status_code == 200, resp.text
    finally:
        server.stop()


def test_a_render_past_its_time_is_a_400_and_frees_its_thread(live: LiveServer) -> None:
    live.ctx.render_timeout_s = 0.5
    for _ in range(serving.TEMPLATE_WORKERS + 1):  # more renders than threads: each thread is free again
        resp = _post(live, CHAT, {"messages": MSGS, "chat_template": LOOPS, "max_tokens": 2})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "chat_template" and err["code"] == "chat_template_timeout", err
    resp = _post(live, CHAT, {"messages": MSGS, "chat_template": "{{ messages[0].content }}", "max_tokens": 2})
    assert resp.status_code == 200, resp.text


def test_plain_requests_flow_past_looping_templates_which_stop_when_their_clients_leave(live: LiveServer) -> None:
    live.ctx.render_timeout_s = 3600.0  # held in flight until their clients leave
    hostile = [_open_request(live, CHAT, {"messages": MSGS, "chat_template": LOOPS, "max_tokens": 2})
               for _ in range(serving.TEMPLATE_WORKERS)]  # every template thread busy
    try:
        _wait_for(lambda: len(live.ctx._renders) == len(hostile), "the looping renders did not start")
        _plain_requests_complete(live)
        assert len(live.ctx._renders) == len(hostile)  # ... while the looping renders were still running
    finally:
        for sock in hostile:
            sock.close()
    # Their clients gone, the renders stop: every template thread hands its processor back, and renders again.
    pool = live.ctx._template
    _wait_for(lambda: pool._processors.qsize() == serving.TEMPLATE_WORKERS, "the looping renders went on")
    resp = _post(live, CHAT, {"messages": MSGS, "chat_template": "{{ messages[0].content }}", "max_tokens": 2})
    assert resp.status_code == 200, resp.text


class Gate:
    """Holds every call of a wrapped function until ``open``; counts the calls waiting."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.waiting, self._open = fn, 0, threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.waiting += 1
        assert self._open.wait(SHORT), "the gate was never opened"
        return self.fn(*args, **kwargs)

    def open(self) -> None:
        self._open.set()


def test_constraint_checks_do_not_hold_up_tokenizing(live: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three schema checks held in flight (more than the tokenizer pool's threads): plain requests complete."""
    gate = Gate(serving.build)
    monkeypatch.setattr(serving, "build", gate)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    results: list[httpx.Response] = []
    senders = [threading.Thread(target=lambda: results.append(_post(live, COMP, {
        "prompt": "x", "max_tokens": 4, "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "s", "schema": schema}}})))
        for _ in range(3)]
    for t in senders:
        t.start()
    try:
        _wait_for(lambda: gate.waiting >= 2, "the schema checks did not start")
        _plain_requests_complete(live)
        assert not results  # ... while the schema checks were held
    finally:
        gate.open()
        for t in senders:
            t.join()
    assert [r.status_code for r in results] == [200] * 3, [r.text for r in results]


def test_health_answers_while_a_large_grammar_is_parsed_and_checked(live: LiveServer,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A ~900 KB grammar of 50,000 rules; its body's decoding and its grammar check are each held until /health
    has answered three more times: run on the event loop, either would hold /health too, and never finish."""
    probes: list[int] = []
    released_by_probes: list[bool] = []  # per hold: /health answered (not the test's deadline) let it go on
    big = "root ::= r0\n" + "\n".join(f'r{i}::="a" r{i + 1}' for i in range(49_999)) + '\nr49999::="z"'
    body = json.dumps({"prompt": "x", "max_tokens": 2, "guided_grammar": big})

    def after_probes(fn: Callable[..., Any], big_enough: Callable[..., bool]) -> Callable[..., Any]:
        def held(*args: Any, **kwargs: Any) -> Any:
            if big_enough(*args, **kwargs):
                start = len(probes)
                deadline = time.monotonic() + SHORT
                while len(probes) < start + 3 and time.monotonic() < deadline:
                    time.sleep(0.01)
                released_by_probes.append(len(probes) >= start + 3)
            return fn(*args, **kwargs)
        return held

    monkeypatch.setattr(json, "loads", after_probes(json.loads, lambda s, *a, **k: len(s) > 500_000))
    monkeypatch.setattr(serving, "build", after_probes(serving.build, lambda kw, field: len(kw.get("grammar", "")) > 500_000))
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=live.base_url, timeout=SHORT) as client:
            while not stop.is_set():
                probes.append(client.get("/health").status_code)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        _wait_for(lambda: len(probes) > 0, "/health did not answer")
        resp = httpx.post(live.base_url + COMP, content=body, headers={"Content-Type": "application/json"},
                          timeout=2 * SHORT + 30)
    finally:
        stop.set()
        prober.join()
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "guided_grammar", resp.text
    assert released_by_probes == [True, True]  # the body's decoding, then its grammar check
    assert set(probes) == {200}
