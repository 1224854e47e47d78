"""Bad requests get a 4xx in OpenAI's error shape naming the field, never reach the engine, and
leave the server serving."""
from __future__ import annotations

from typing import Any

import httpx
import pytest

from .conftest import MODEL_NAME

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]

CASES = [  # (path, body, status, param)
    (COMP, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    (COMP, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (COMP, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (COMP, {"prompt": "x", "top_k": -2}, 400, "top_k"),
    (COMP, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    (COMP, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (COMP, {"prompt": "x", "frequency_penalty": "high"}, 400, "frequency_penalty"),
    (COMP, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (COMP, {"prompt": "x", "n": 0}, 400, "n"),
    (COMP, {"prompt": "x", "seed": -1}, 400, "seed"),
    (COMP, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (COMP, {"prompt": "x", "stop": ""}, 400, "stop"),
    (COMP, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (COMP, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (COMP, {"prompt": "x", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    (COMP, {"prompt": "x", "echo": True, "stream": True}, 400, "echo"),
    (COMP, {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "logit_bias": {"5": 101.0}}, 400, "logit_bias"),
    (COMP, {"prompt": "x", "logit_bias": {"99999": 1.0}}, 400, "logit_bias"),
    (COMP, {"max_tokens": 4}, 400, "prompt"),
    (COMP, {"prompt": 5}, 400, "prompt"),
    (COMP, {"prompt": []}, 400, "prompt"),
    (COMP, {"prompt": ""}, 400, "prompt"),
    (COMP, {"prompt": [1, "a"]}, 400, "prompt"),
    (COMP, {"prompt": [5, 99999]}, 400, "prompt"),
    (COMP, {"prompt": [-1]}, 400, "prompt"),
    (COMP, {"prompt": "word " * 600}, 400, "prompt"),
    (COMP, {"prompt": list(range(1, 300)) * 2}, 400, "prompt"),
    (COMP, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": MSGS, "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSGS, "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs"),
    (CHAT, {"messages": MSGS, "temperature": None, "top_p": -1}, 400, "top_p"),
    (CHAT, {"messages": [{"role": "user", "content": "long " * 600}]}, 400, "messages"),
    (CHAT, {"messages": [*MSGS, {"role": "assistant", "content": "", "tool_calls": [  # nested past the stack
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 3000 + "]" * 3000}}]}]},
     400, "messages[1].tool_calls[0].function.arguments"),
]


@pytest.fixture()
def engine_add_calls(server: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every request that reaches the engine thread's ``add_processed_request``."""
    calls: list[str] = []
    real = server.engine.add_processed_request

    def spy(request: Any) -> None:
        calls.append(request.request_id)
        real(request)

    monkeypatch.setattr(server.engine, "add_processed_request", spy)
    return calls


def _check_error(resp: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    if param:
        assert param.split(".")[0].split("[")[0] in err["message"] or status == 404
    return err


def test_bad_requests(client: httpx.Client, engine_add_calls: list[str]) -> None:
    for path, body, status, param in CASES:
        streamed = [] if "stream" in body or "stream_options" in body else [{**body, "stream": True}]
        for variant in [body, *streamed]:
            _check_error(client.post(path, json=variant), status, param)
    assert engine_add_calls == [], "no bad request may reach the engine"
    ok = client.post(COMP, json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert len(engine_add_calls) == 1


@pytest.mark.parametrize("content, ctype", [
    (b"{not json", "application/json"),
    (b'{"prompt": "x",}', "application/json"),
    (b"[1, 2, 3]", "application/json"),
    (b'"just a string"', "application/json"),
    (b"", "application/json"),
    (b'{"prompt": "x", "chat_template_kwargs": {"a": ' + b"[" * 3000 + b"]" * 3000 + b"}}", "application/json"),
])
def test_malformed_bodies(client: httpx.Client, content: bytes, ctype: str) -> None:
    for path in (COMP, CHAT):
        err = _check_error(client.post(path, content=content, headers={"Content-Type": ctype}), 400, None)
        assert "JSON" in err["message"] or "body" in err["message"]


def test_wrong_method_and_path(client: httpx.Client) -> None:
    assert client.get(COMP).status_code == 405
    assert client.get(COMP).json()["error"]["message"]
    resp = client.post("/v1/nothing", json={})
    assert resp.status_code == 404 and resp.json()["error"]["type"]


def test_health_models_metrics(client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == MODEL_NAME and card["max_model_len"] == 512
    text = client.get("/metrics").text
    for name in ("minfer_num_requests_running", "minfer_num_requests_waiting", "minfer_kv_cache_usage_ratio",
                 "minfer_prefix_cache_hit_rate", "minfer_num_preemptions_total", "minfer_prompt_tokens_total",
                 "minfer_generation_tokens_total", "minfer_time_to_first_token_seconds_bucket",
                 "minfer_inter_token_latency_seconds_bucket", "minfer_e2e_request_latency_seconds_bucket"):
        assert name in text, name


@pytest.mark.parametrize("extra", [
    {"top_k": 10**9}, {"top_k": -1}, {"temperature": 1e-6}, {"temperature": 100.0}, {"top_p": 1e-9},
    {"seed": 2**63 - 1}, {"stop_token_ids": [10**9, 0]}, {"min_tokens": 10**6, "max_tokens": None},
    {"repetition_penalty": 100.0, "presence_penalty": -2, "frequency_penalty": 2}, {"min_p": 1.0},
    {"logprobs": 20, "n": 3}, {"stop": ["a", "b", "c", "d", "e"]},
])
def test_extreme_but_valid_values_are_served(client: httpx.Client, extra: dict[str, Any]) -> None:
    body = {"model": MODEL_NAME, "prompt": "x" * 400, "max_tokens": 4, **extra}
    resp = client.post(COMP, json=body)
    assert resp.status_code == 200, resp.text
    assert client.get("/health").status_code == 200
