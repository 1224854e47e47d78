"""``--api-key``: the official client with no, a wrong and the right key; the open routes stay open."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from .conftest import MODEL_NAME, LiveServer

openai = pytest.importorskip("openai")

KEY = "sk-minfer-test-key"
PROTECTED = [("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL_NAME}", None),
             ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
             ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
             ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
             ("GET", "/v1/nothing", None), ("POST", "/v1/../tokenize", {"prompt": "x"})]


@pytest.fixture(scope="module")
def keyed(tiny_model: Path) -> Iterator[LiveServer]:
    live = LiveServer(tiny_model, api_key=KEY)
    yield live
    live.stop()


def _client(live: LiveServer, key: str) -> Any:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_openai_client_needs_the_key(keyed: LiveServer) -> None:
    for wrong in ("wrong", KEY + "x", KEY[:-1], "unused"):
        with pytest.raises(openai.AuthenticationError) as info:
            _client(keyed, wrong).completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
        assert info.value.status_code == 401
        assert info.value.body["code"] == "invalid_api_key"  # the client hands over body["error"]
    good = _client(keyed, KEY)
    out = good.completions.create(model=MODEL_NAME, prompt="def f(", max_tokens=4, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    chunks = list(good.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert good.models.retrieve(MODEL_NAME).id == MODEL_NAME
    idle = keyed.wait_idle()
    assert idle["healthy"] and idle["kv_blocks_used"] == 0


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"X-API-Key": KEY}])
@pytest.mark.parametrize("method, path, body", PROTECTED)
def test_protected_routes_answer_401_in_openai_shape(keyed: LiveServer, method: str, path: str, body: Any,
                                                     headers: dict[str, str]) -> None:
    resp = httpx.request(method, keyed.base_url + path, json=body, headers=headers, timeout=30)
    assert resp.status_code == 401, (path, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert "API key" in err["message"] and resp.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_right_key_opens_every_route(keyed: LiveServer, scheme: str) -> None:
    headers = {"Authorization": f"{scheme} {KEY}"}
    with httpx.Client(base_url=keyed.base_url, headers=headers, timeout=60) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == MODEL_NAME
        assert c.post("/tokenize", json={"prompt": "def"}).json()["count"] > 0
        assert c.post("/detokenize", json={"tokens": [5, 6]}).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        missing = c.get("/v1/nothing")  # past the key, routing answers as usual
        assert missing.status_code == 404 and missing.json()["error"]["type"]


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version", "/stats", "/", "/docs", "/redoc",
                                  "/openapi.json", "/static/app.js"])
def test_probes_and_pages_stay_open(keyed: LiveServer, path: str) -> None:
    assert httpx.get(keyed.base_url + path, timeout=30).status_code == 200, path


def test_no_key_means_no_check(client: httpx.Client) -> None:
    """The shared server runs without --api-key: any or no Authorization header passes."""
    assert client.get("/v1/models").status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer whatever"}).status_code == 200
