"""Issue 44: the Host allow-list against DNS rebinding, the Origin check, and malformed HTTP answered in OpenAI's
error shape. A refused request reaches neither the body parser nor the engine (the web-page test drives the same
checks from a real browser)."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from minfer.server.hosts import (HostAllowList, HostOriginMiddleware, check_origins, default_allowed_hosts,
                                 parse_flag_list, split_host_header)
from minfer.server.http_protocol import http_protocol

from .conftest import MODEL_NAME, LiveServer

COMP = "/v1/completions"
BODY = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
# uvicorn's parsers: h11 always comes with uvicorn; httptools (uvicorn[standard]) where it is installed
PROTOCOLS = ["h11"] + (["httptools"] if importlib.util.find_spec("httptools") else [])


def spy(live: LiveServer, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """'parse' for each body the parse pool decodes, 'engine' for each request the engine thread takes."""
    seen: list[str] = []
    real_parse, real_add = live.ctx.parse_body, live.engine.add_processed_request

    async def parse_body(request: Any, model: Any) -> Any:
        seen.append("parse")
        return await real_parse(request, model)

    monkeypatch.setattr(live.ctx, "parse_body", parse_body)
    monkeypatch.setattr(live.engine, "add_processed_request", lambda r: seen.append("engine") or real_add(r))
    return seen


def error_of(resp: httpx.Response, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
    assert code is None or err["code"] == code, err
    return err


# ---- the rules -------------------------------------------------------------------------------------------

def test_host_header_parsing() -> None:
    assert split_host_header("localhost:8000") == ("localhost", "8000")
    assert split_host_header("LocalHost") == ("localhost", "")
    assert split_host_header("localhost.") == ("localhost", "")  # the root-anchored spelling of the same name
    assert split_host_header("127.0.0.1:1") == ("127.0.0.1", "1")
    assert split_host_header("[::1]:8000") == ("[::1]", "8000")
    assert split_host_header("[0:0:0:0:0:0:0:1]") == ("[::1]", "")
    for bad in ("a:b", "[::1", "[::1]8000", "::1", "a b", "[zz]", "a/b", "a@b"):
        assert split_host_header(bad) is None, bad


def test_allow_list_patterns() -> None:
    hosts = HostAllowList(["localhost", ".localhost", "127.0.0.1", "::1", "Models.LAN", ".example.com", "*.corp"])
    for name in ("localhost", "app.localhost", "127.0.0.1", "[::1]", "models.lan", "example.com", "a.b.example.com",
                 "corp", "x.corp"):
        assert hosts.allows(name), name
    for name in ("attacker.example", "badexample.com", "example.com.attacker.example", "localhost.attacker.example",
                 "127.0.0.2", "[::2]", "models.lan.evil", ""):
        assert not hosts.allows(name), name
    assert HostAllowList(["*"]).allows("attacker.example")
    for bad in ("localhost:8000", "a b", ".[::1]", "*x", "", "[::1]:80"):
        with pytest.raises(ValueError, match="--allowed-hosts"):
            HostAllowList([bad])


def test_defaults_and_flag_lists() -> None:
    # beside the loopback names, which are always allowed: nothing on loopback, anything elsewhere
    for bind, extra in (("127.0.0.1", []), ("localhost", []), ("::1", []), ("127.0.0.2", ["127.0.0.2"]),
                        ("0.0.0.0", ["*"]), ("::", ["*"]), ("192.168.1.7", ["*"]), ("myhost", ["*"])):
        assert default_allowed_hosts(bind) == extra, bind
    assert parse_flag_list(None) is None
    assert parse_flag_list(["a.lan,b.lan", " c ", '["d", "*"]', "[::1],[::2]"]) == \
        ["a.lan", "b.lan", "c", "d", "*", "[::1]", "[::2]"]
    with pytest.raises(ValueError, match="JSON list"):
        parse_flag_list(['["a", 1]'])
    assert check_origins(["HTTP://UI.lan:3000/", "*"]) == ["http://ui.lan:3000", "*"]
    with pytest.raises(ValueError, match="--allowed-origins"):
        check_origins(["ui.lan:3000"])


def test_middleware_answers_before_the_app() -> None:
    """The ASGI layer alone, for what h11 never lets through (an HTTP/1.1 request without a Host: httptools does)."""
    served: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        served.append(scope["path"])

    def refusal(middleware: HostOriginMiddleware, headers: list[tuple[bytes, bytes]], version: str = "1.1") -> str:
        """The error code of the answer; '' when the request went on to the app."""
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "http_version": version, "path": "/v1/completions", "headers": headers}
        asyncio.run(middleware(scope, None, send))  # type: ignore[arg-type]
        if not sent:
            return ""
        assert sent[0]["status"] == 400 and (b"content-type", b"application/json") in sent[0]["headers"]
        return json.loads(sent[1]["body"])["error"]["code"]

    loopback = HostOriginMiddleware(app)
    assert refusal(loopback, []) == "missing_host"
    assert refusal(loopback, [(b"host", b"localhost"), (b"host", b"localhost")]) == "invalid_host"
    assert refusal(loopback, [(b"host", b"a b")]) == "invalid_host"
    assert refusal(loopback, [(b"host", b"attacker.example")]) == "host_not_allowed"
    assert served == []
    assert refusal(loopback, [], version="1.0") == ""  # HTTP/1.0 has no Host to check
    assert refusal(loopback, [(b"host", b"localhost:8000"), (b"origin", b"http://localhost:8000")]) == ""
    anywhere = HostOriginMiddleware(app, allowed_hosts=["*"], allowed_origins=["*"])
    assert refusal(anywhere, [(b"host", b"attacker.example"), (b"origin", b"http://elsewhere.example")]) == ""
    assert refusal(anywhere, []) == "missing_host"
    assert len(served) == 3


# ---- a live server ----------------------------------------------------------------------------------------

def test_a_rebinding_host_is_refused_before_any_work(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """No API key (the default): a page whose name was made to resolve to 127.0.0.1 sends its own name as Host."""
    seen = spy(server, monkeypatch)
    port = server.port
    for host in ("attacker.example", f"attacker.example:{port}", "ATTACKER.example", "localhost.attacker.example",
                 f"127.0.0.1.nip.io:{port}"):
        err = error_of(httpx.post(server.base_url + COMP, json=BODY, headers={"Host": host}, timeout=30),
                       "host_not_allowed")
        assert "--allowed-hosts" in err["message"]
        for path in ("/v1/models", "/stats", "/health", "/"):  # nothing is read through a rebound name
            error_of(httpx.get(server.base_url + path, headers={"Host": host}, timeout=30), "host_not_allowed")
    assert seen == []
    for host in (f"localhost:{port}", "LocalHost", f"127.0.0.1:{port}", f"[::1]:{port}", "[::1]",
                 f"app.localhost:{port}"):
        resp = httpx.post(server.base_url + COMP, json=BODY, headers={"Host": host}, timeout=30)
        assert resp.status_code == 200, (host, resp.text)
    assert seen.count("engine") == 6


def test_a_page_on_another_origin_is_refused(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = spy(server, monkeypatch)
    own = server.base_url  # http://127.0.0.1:PORT
    for origin, host in (("http://attacker.example", None), ("null", None), ("http://127.0.0.1", None),
                         (f"http://localhost:{server.port}", None),  # loopback, but another origin than the Host's
                         (own, f"localhost:{server.port}")):
        headers = {"Origin": origin, **({"Host": host} if host else {})}
        err = error_of(httpx.post(own + COMP, json=BODY, headers=headers, timeout=30), "origin_not_allowed")
        assert "--allowed-origins" in err["message"]
        preflight = httpx.options(own + COMP, headers={**headers, "Access-Control-Request-Method": "POST"}, timeout=30)
        error_of(preflight, "origin_not_allowed")
    assert seen == []
    for origin, host in ((own, None), (f"http://localhost:{server.port}", f"localhost:{server.port}"),
                         (f"https://127.0.0.1:{server.port}", None)):  # its authority: a proxy may end TLS before it
        headers = {"Origin": origin, **({"Host": host} if host else {})}
        resp = httpx.post(own + COMP, json=BODY, headers=headers, timeout=30)  # the server's own pages
        assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers, resp.text
    assert seen.count("engine") == 3


def test_configured_hosts_and_origins(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    live = LiveServer(tiny_model, allowed_hosts=("models.lan", ".example.com"), allowed_origins=("http://ui.lan:3000",))
    try:
        seen = spy(live, monkeypatch)
        for host in ("models.lan:8000", "a.b.example.com", "example.com", "localhost", "127.0.0.1", "[::1]:8000"):
            resp = httpx.post(live.base_url + COMP, json=BODY, headers={"Host": host}, timeout=30)
            assert resp.status_code == 200, (host, resp.text)
        for host in ("attacker.example", "example.com.attacker.example", "models.lan.attacker.example"):
            error_of(httpx.post(live.base_url + COMP, json=BODY, headers={"Host": host}, timeout=30),
                     "host_not_allowed")
        ui = {"Origin": "http://ui.lan:3000"}  # an allowed origin: CORS headers, its preflight answered
        resp = httpx.post(live.base_url + COMP, json=BODY, headers=ui, timeout=30)
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "http://ui.lan:3000"
        preflight = httpx.options(live.base_url + COMP, timeout=30, headers={
            **ui, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ui["Origin"]
        error_of(httpx.post(live.base_url + COMP, json=BODY, headers={"Origin": "http://ui.lan:3001"}, timeout=30),
                 "origin_not_allowed")
        assert seen.count("engine") == 7 and seen.count("parse") == 7
    finally:
        live.stop()


# ---- raw HTTP: what the parser refuses, and what reaches the app malformed ----------------------------------

@pytest.fixture(scope="module", params=PROTOCOLS)
def raw_server(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[LiveServer]:
    live = LiveServer(tiny_model, http=request.param)
    yield live
    live.stop()


def raw(live: LiveServer, head: bytes, body: bytes = b"") -> tuple[int, dict[str, Any]]:
    """Send ``head`` (request line and headers, without the blank line) and ``body`` on a socket; the status and
    the JSON body of the answer (every request asks to close, so the answer ends with the connection)."""
    with socket.create_connection(("127.0.0.1", live.port), timeout=30) as sock:
        sock.sendall(head + b"\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head_out, _, payload = data.partition(b"\r\n\r\n")
    lines = head_out.split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    assert headers[b"content-type"] == b"application/json", data
    return int(lines[0].split()[1]), json.loads(payload)


def test_malformed_http_is_a_400_in_the_error_shape(raw_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = spy(raw_server, monkeypatch)
    body = json.dumps(BODY).encode()
    status, answer = raw(raw_server, b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json", body)
    assert status == 400 and "Host" in answer["error"]["message"], answer  # h11's parser or our middleware
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    status, answer = raw(raw_server, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nHost: localhost", body)
    assert status == 400 and "Host" in answer["error"]["message"], answer
    # Content-Type bytes HTTP forbids (the parser refuses them) or that name no JSON (the app refuses them)
    for garbage in (b"\x00", b"\x0b", b"a\rb", b"\x01", b"\x7f", b"\xff\xfe", b"application/\xffjson"):
        status, answer = raw(raw_server, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                                         b"Content-Type: " + garbage, body)
        assert status == 400 and set(answer["error"]) == {"message", "type", "param", "code"}, (garbage, answer)
    assert "engine" not in seen
    status, answer = raw(raw_server, b"GET /health HTTP/1.0")  # HTTP/1.0 needs no Host
    assert status == 200 and answer == {"status": "ok"}
    status, answer = raw(raw_server, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                                     b"Content-Type: application/json", body)
    assert status == 200 and seen.count("engine") == 1


@pytest.mark.parametrize("name", PROTOCOLS)
def test_the_protocols_400_alone(name: str) -> None:
    """``send_400_response`` as uvicorn calls it, inside its ``except`` for the parser's error; mid-response (no
    status line can be sent) it only closes the connection."""
    from types import SimpleNamespace

    class Transport:
        def __init__(self) -> None:
            self.data, self.closed = b"", False

        def write(self, data: bytes) -> None:
            self.data += data

        def close(self) -> None:
            self.closed = True

    protocol_class = http_protocol(name)
    for started, complete in ((False, False), (True, True), (True, False)):
        protocol: Any = protocol_class.__new__(protocol_class)
        protocol.transport = Transport()
        protocol.server_state = SimpleNamespace(default_headers=[(b"server", b"uvicorn")])
        protocol.cycle = SimpleNamespace(response_started=started, response_complete=complete)
        try:
            raise ValueError("a reason from the parser")
        except ValueError:
            protocol.send_400_response("Invalid HTTP request received.")
        assert protocol.transport.closed
        if started and not complete:
            assert protocol.transport.data == b""
            continue
        head, _, body = protocol.transport.data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and b"\r\nserver: uvicorn\r\n" in head
        assert f"content-length: {len(body)}".encode() in head and b"connection: close" in head
        assert json.loads(body)["error"] == {"message": "the request is not valid HTTP: a reason from the parser",
                                             "type": "invalid_request_error", "param": None,
                                             "code": "malformed_http_request"}
