"""``echo`` with ``logprobs`` on /v1/completions, in the shape lm-evaluation-harness reads: one
``token_logprobs`` entry per prompt token (the first None) then the generated ones, ``top_logprobs`` per
position, ``text_offset``, and the prompt's text before the completion's."""
from __future__ import annotations

import math
from typing import Any

import httpx

from .conftest import MODEL_NAME, LiveServer

COMP = "/v1/completions"


def _complete(client: httpx.Client, **body: Any) -> dict[str, Any]:
    resp = client.post(COMP, json={"model": MODEL_NAME, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_echo_loglikelihood_request(client: httpx.Client, server: LiveServer) -> None:
    tok = server.ctx.tokenizer
    ids = tok.encode("def fibonacci(n):\n    return")
    # the greedy next token's logprob after the prompt: the echo's top logprob at that position must match it
    gen = _complete(client, prompt=ids, max_tokens=1, logprobs=1, ignore_eos=True)["choices"][0]
    next_lp = gen["logprobs"]["token_logprobs"][0]
    full = ids + [ids[2]]  # a continuation to score, as lm-eval sends context + continuation

    out = _complete(client, prompt=[full], max_tokens=1, logprobs=1, echo=True)  # lm-eval's request
    choice = out["choices"][0]
    lp = choice["logprobs"]
    n = len(full) + 1
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["tokens"][:len(full)] == [tok.decode([t]) for t in full]
    assert math.isclose(max(lp["top_logprobs"][len(ids)].values()), next_lp, abs_tol=1e-4)
    for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert value in top.values() and 1 <= len(top) <= 2 and max(top.values()) >= value
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    plain = _complete(client, prompt=[full], max_tokens=1)["choices"][0]["text"]
    assert choice["text"] == tok.decode(full, skip_special_tokens=True) + plain
    assert out["usage"] == {"prompt_tokens": len(full), "completion_tokens": 1, "total_tokens": len(full) + 1}
    idle = server.wait_idle()
    assert idle["kv_blocks_used"] == 0


def test_echo_text_prompt_and_max_tokens_zero(client: httpx.Client, server: LiveServer) -> None:
    prompt = "import os\nimport sys"
    out = _complete(client, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    choice = out["choices"][0]
    n = len(server.ctx.tokenizer.encode(prompt))
    assert choice["text"] == prompt and len(choice["logprobs"]["token_logprobs"]) == n
    assert out["usage"]["completion_tokens"] == 0
    plain = _complete(client, prompt=[prompt, "x"], max_tokens=3, echo=True, n=2)  # no logprobs: text only
    texts = [c["text"] for c in plain["choices"]]
    assert texts[0].startswith(prompt) and texts[2].startswith("x") and plain["choices"][0]["logprobs"] is None
    assert client.post(COMP, json={"prompt": "x", "max_tokens": 0}).status_code == 400  # 0 only with echo
    assert server.wait_idle()["kv_blocks_used"] == 0
