"""The routes vLLM clients expect beyond the two completions: /v1/models/{id}, /tokenize, /detokenize,
/version, the offline API docs; unknown routes answer 404 in the OpenAI shape."""
from __future__ import annotations

import json
import re
import threading
from typing import Any

import httpx
import pytest

import minfer

from .conftest import MODEL_NAME, LiveServer

MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A stack class"}]


def _error(resp: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    return err


def test_models_retrieve(openai_client: Any, client: httpx.Client) -> None:
    card = openai_client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    assert client.get(f"/v1/models/{MODEL_NAME}").json()["max_model_len"] == 512
    for missing in ("gpt-4", "org/name", "tiny-llama3/extra"):
        err = _error(client.get(f"/v1/models/{missing}"), 404, "model")
        assert err["code"] == "model_not_found" and missing in err["message"]


def test_version(client: httpx.Client) -> None:
    assert client.get("/version").json() == {"version": minfer.__version__}


def test_tokenize_a_prompt(client: httpx.Client, server: LiveServer) -> None:
    tok = server.ctx.tokenizer
    text = "def fibonacci(n):\n    return n"
    out = client.post("/tokenize", json={"model": MODEL_NAME, "prompt": text}).json()
    assert out["tokens"] == tok.encode(text) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 512 and out["token_strs"] is None
    bare = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                          "return_token_strs": True}).json()
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False)
    assert bare["token_strs"] == tok.convert_ids_to_tokens(bare["tokens"])
    assert client.post("/detokenize", json={"tokens": bare["tokens"]}).json() == {"prompt": text}


def test_tokenize_messages_counts_what_chat_prefills(client: httpx.Client, openai_client: Any) -> None:
    out = client.post("/tokenize", json={"messages": MESSAGES}).json()
    chat = openai_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1)
    assert out["count"] == chat.usage.prompt_tokens
    no_prompt = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < out["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages[0].content"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens[0]"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, "model"),
])
def test_tokenize_errors_name_the_field(client: httpx.Client, server: LiveServer, path: str, body: Any,
                                        param: str | None) -> None:
    status = 404 if body.get("model") == "gpt-4" else 400
    # json.dumps escapes lone surrogates as \udXXX, as a JavaScript client sends them
    resp = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    err = _error(resp, status, param)
    assert "Traceback" not in err["message"]
    assert client.post("/tokenize", json={"prompt": "still serving"}).status_code == 200


def test_long_tokenize_leaves_the_event_loop_free(client: httpx.Client, server: LiveServer,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of megabytes is tokenized on the worker thread while /health keeps answering: the
    tokenization is held until a probe has been answered, which would never happen on the event loop."""
    from minfer.server import routes_tokenize

    started, release, real = threading.Event(), threading.Event(), routes_tokenize._tokenize

    def held(*args: Any) -> Any:
        started.set()
        release.wait(60)  # only a guard: the test releases it at once
        return real(*args)

    monkeypatch.setattr(routes_tokenize, "_tokenize", held)
    text = "hello world, this is text " * 40000  # ~1 MB
    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.update(
        resp=httpx.post(server.base_url + "/tokenize", json={"prompt": text}, timeout=120)))
    worker.start()
    assert started.wait(60), "the tokenize request never reached its tokenizer"
    try:
        probes = [client.get("/health", timeout=30).status_code for _ in range(3)]
        assert not release.is_set() and worker.is_alive()  # answered while the tokenization was held
    finally:
        release.set()
        worker.join()
    assert probes == [200] * 3
    assert result["resp"].status_code == 200 and result["resp"].json()["count"] > 40000


def test_unknown_routes_are_404_in_openai_shape(client: httpx.Client) -> None:
    for path in ("/v1/nothing", "/nothing", "/v2/completions", "/tokenize/extra"):
        resp = client.get(path)
        assert resp.status_code == 404 and set(resp.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_load_only_local_assets(client: httpx.Client, page: str) -> None:
    """Swagger UI and ReDoc from the packaged copy: the pages work with no network."""
    html = client.get(page).text
    urls = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']|url:\s*["']([^"']+)["']""", html)
    urls = [a or b for a, b in urls]
    assert urls and not [u for u in urls if not u.startswith("/")], urls
    assert "http://" not in html and "https://" not in html and "//cdn" not in html
    for url in urls:
        assert client.get(url).status_code == 200, url
