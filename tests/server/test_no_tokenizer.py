"""A server without a tokenizer (random-weight benchmark shapes): token-id prompts only."""
from __future__ import annotations

import json
from pathlib import Path

import httpx

from .conftest import MODEL_NAME, LiveServer


def test_token_id_prompts_without_a_tokenizer(tiny_model: Path) -> None:
    live = LiveServer(tiny_model, skip_tokenizer_init=True)
    try:
        with httpx.Client(base_url=live.base_url, timeout=30) as c:
            body = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True, "logprobs": 1}
            whole = c.post("/v1/completions", json=body).json()
            assert whole["usage"]["completion_tokens"] == 6
            assert all(t.startswith("token_id:") for t in whole["choices"][0]["logprobs"]["tokens"])
            with c.stream("POST", "/v1/completions", json=dict(body, stream=True)) as resp:
                events = [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]
            chunks = [json.loads(e) for e in events[:-1]]
            # every token reaches the client although none has text (a slow reader may get several per chunk)
            streamed = [t for ch in chunks for choice in ch["choices"] for t in choice["logprobs"]["tokens"]]
            assert events[-1] == "[DONE]" and len(streamed) == 6 and all(t.startswith("token_id:") for t in streamed)
            bad_requests = (("/v1/completions", {"prompt": "text"}), ("/v1/completions", {"prompt": [5], "stop": "x"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}))
            for path, bad in bad_requests:
                resp = c.post(path, json=bad)
                assert resp.status_code == 400 and "tokenizer" in resp.json()["error"]["message"]
    finally:
        live.stop()
