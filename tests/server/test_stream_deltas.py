"""Streamed chunks, joined, are exactly the non-streamed response: the engine's delta outputs
(``RequestOutputKind.DELTA``) lose, repeat and reorder nothing, with n=2, logprobs and a stop string."""
from __future__ import annotations

import json
from typing import Any

import httpx

from .conftest import MODEL_NAME

BODY: dict[str, Any] = {"model": MODEL_NAME, "prompt": "def fibonacci(n):", "max_tokens": 40, "n": 2,
                        "temperature": 1.0, "seed": 13, "logprobs": 2, "ignore_eos": True}


def _streamed(client: httpx.Client, body: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], dict[str, int]]:
    """Per choice: text, finish/stop reason and the logprob fields, joined over the chunks; and usage."""
    choices: dict[int, dict[str, Any]] = {}
    usage: dict[str, int] = {}
    with client.stream("POST", "/v1/completions", json=dict(body, stream=True,
                                                            stream_options={"include_usage": True})) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk["usage"] or usage
            for ch in chunk["choices"]:
                c = choices.setdefault(ch["index"], {"text": "", "tokens": [], "token_logprobs": [],
                                                     "top_logprobs": [], "text_offset": []})
                c["text"] += ch["text"]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    c[key] += ch["logprobs"][key]
                if ch["finish_reason"] is not None:
                    assert "finish_reason" not in c, "a choice finished twice"
                    c["finish_reason"], c["stop_reason"] = ch["finish_reason"], ch["stop_reason"]
    return choices, usage


def test_streamed_chunks_join_to_the_whole_response(client: httpx.Client) -> None:
    free = client.post("/v1/completions", json=BODY).json()["choices"][1]["text"]
    stop = next(free[i:i + 2] for i in range(4, len(free) - 2) if free[i:i + 2].strip())
    body = dict(BODY, stop=[stop])
    whole = client.post("/v1/completions", json=body).json()
    streamed, usage = _streamed(client, body)
    assert whole["choices"][1]["finish_reason"] == "stop" and whole["choices"][1]["stop_reason"] == stop
    assert sorted(streamed) == [0, 1]
    for ch in whole["choices"]:
        s = streamed[ch["index"]]
        assert (s["text"], s["finish_reason"], s["stop_reason"]) == (ch["text"], ch["finish_reason"], ch["stop_reason"])
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert s[key] == ch["logprobs"][key], key
    assert usage == whole["usage"]
