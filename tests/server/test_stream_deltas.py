"""Streamed chunks, joined, are exactly the non-streamed response: the engine's delta outputs
(``RequestOutputKind.DELTA``) lose, repeat and reorder nothing, with n=2, logprobs and a stop string."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

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


TEXTS = ["", " def", 'quote " and \\ backslash', "line\nbreak\ttab", "\x00\x1f control", "é ✓ 🙂",
         "\ue000minfer-text\ue001"]


def test_text_chunks_are_the_generic_encoding_byte_for_byte() -> None:
    """``stream.TextChunks`` splices the text's JSON between pieces encoded once: for any text (escapes, control
    characters, non-ASCII, the splice marker itself) the bytes are ``sse`` of the whole chunk."""
    from minfer.server.stream import TextChunks, sse

    def build(index: int, text: str) -> dict[str, Any]:
        return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": None}], "usage": None}

    chunks = TextChunks(build)
    for index in (0, 3):
        for text in TEXTS:
            assert chunks(index, text) == sse(build(index, text))
    marked = TextChunks(lambda index, text: dict(build(index, text), model="\ue000minfer-text\ue001"))
    assert marked(0, "x") == sse(dict(build(0, "x"), model="\ue000minfer-text\ue001"))  # the generic path then


def test_plain_streams_take_the_pre_encoded_chunks(client: httpx.Client, monkeypatch) -> None:
    """A stream with no logprobs sends its text chunks through ``TextChunks`` (the fast path is taken), and they join
    to the non-streamed text, for both routes."""
    from minfer.server import stream

    calls: list[int] = []
    real = stream.TextChunks.__call__
    monkeypatch.setattr(stream.TextChunks, "__call__", lambda self, i, t: calls.append(i) or real(self, i, t))
    body = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    for route, request, text_of in (
            ("/v1/completions", {"prompt": "def f(x):"}, lambda ch: ch["text"]),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
             lambda ch: ch["delta"].get("content") or "")):
        calls.clear()
        whole = client.post(route, json={**body, **request}).json()["choices"][0]
        want = whole["text"] if "text" in whole else whole["message"]["content"]
        with client.stream("POST", route, json={**body, **request, "stream": True}) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(text_of(c["choices"][0]) for c in chunks if c["choices"]) == want
        assert len(calls) >= 5, (route, len(calls))


def test_stream_interval_sends_n_tokens_a_chunk(tiny_model) -> None:
    """A server with ``stream_interval=4`` sends each choice's tokens four (or more) a chunk (the first and the last
    chunk excepted), and the chunks still join to the non-streamed response, logprobs and stop string included; for chat
    too. A bad interval fails at construction, naming the flag."""
    from .conftest import LiveServer

    with pytest.raises(ValueError, match=r"stream_interval \(--stream-interval\) must be an integer in \[1, "):
        LiveServer(tiny_model, app_args={"stream_interval": 0})
    live = LiveServer(tiny_model, app_args={"stream_interval": 4})
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as client:
            body = dict(BODY, max_tokens=23)
            free = client.post("/v1/completions", json=body).json()["choices"][1]["text"]
            stop = next(free[i:i + 2] for i in range(len(free) // 2, len(free) - 2) if free[i:i + 2].strip())
            for b in (body, dict(body, stop=[stop])):
                whole = client.post("/v1/completions", json=b).json()
                counts: dict[int, list[int]] = {0: [], 1: []}
                texts = {0: "", 1: ""}
                with client.stream("POST", "/v1/completions", json=dict(b, stream=True)) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            for ch in json.loads(line[6:])["choices"]:
                                counts[ch["index"]].append(len(ch["logprobs"]["tokens"]))
                                texts[ch["index"]] += ch["text"]
                for ch in whole["choices"]:
                    got = counts[ch["index"]]
                    assert texts[ch["index"]] == ch["text"] and sum(got) == len(ch["logprobs"]["tokens"])
                    # four a chunk, or more where the reader fell behind (the test shares the machine)
                    assert 3 <= len(got) <= 2 + 23 // 4 and all(c >= 4 for c in got[1:-1]), got
            chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 17,
                    "temperature": 0.0, "ignore_eos": True}
            want = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
            with client.stream("POST", "/v1/chat/completions", json=dict(chat, stream=True)) as resp:
                deltas = [json.loads(line[6:])["choices"] for line in resp.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            assert "".join(c[0]["delta"].get("content") or "" for c in deltas if c) == want
            assert len(deltas) <= 2 + 17 // 4 + 2, len(deltas)  # role, content every 4 tokens, finish, usage
    finally:
        live.stop()


def test_a_response_sent_whole_reads_its_stream_twice(client: httpx.Client, monkeypatch) -> None:
    """A non-streamed request's reader wakes for its first and its last output only, not for each token."""
    from minfer.engine.request_stream import RequestStream

    reads: list[bool] = []
    real = RequestStream.__anext__

    async def counted(self: RequestStream) -> Any:
        out = await real(self)
        reads.append(out.finished)
        return out

    monkeypatch.setattr(RequestStream, "__anext__", counted)
    body = {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 12, "ignore_eos": True}
    assert len(client.post("/v1/completions", json=body).json()["choices"][0]["text"]) > 0
    assert reads in ([False, True], [True]), reads
