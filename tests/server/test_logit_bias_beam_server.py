"""logit_bias and allowed_token_ids over HTTP (through the official client: OpenAI's token ids as strings), their
bad values as 400s naming the field; beam search (``use_beam_search``) on completions and chat."""
from __future__ import annotations

from typing import Any

import httpx
import pytest

from .conftest import MODEL_NAME, LiveServer

openai = pytest.importorskip("openai")

PROMPT_IDS = [(i * 7) % 300 + 2 for i in range(20)]


def _decode(server: LiveServer, ids: list[int]) -> str:
    return server.ctx.tokenizer.decode(ids, skip_special_tokens=True)


def test_logit_bias_through_the_official_client(openai_client: Any, server: LiveServer) -> None:
    forced = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=4, temperature=0,
                                              logit_bias={"99": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == _decode(server, [99] * 4)
    chat = openai_client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, temperature=0, logit_bias={"120": 100.0},
                                                 extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == _decode(server, [120] * 3)
    plain = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=4, temperature=0,
                                             extra_body={"ignore_eos": True})
    first = server.ctx.tokenizer.encode(plain.choices[0].text)[0]
    banned = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=1, temperature=0,
                                              logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
    assert banned.choices[0].text != _decode(server, [first])


def test_allowed_token_ids_restrict_the_draw(openai_client: Any, server: LiveServer) -> None:
    out = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=5, temperature=0.8, seed=1,
                                           extra_body={"allowed_token_ids": [77], "ignore_eos": True})
    assert out.choices[0].text == _decode(server, [77] * 5)
    both = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=3, temperature=0,
                                            logit_bias={"78": 100},
                                            extra_body={"allowed_token_ids": [77, 78], "ignore_eos": True})
    assert both.choices[0].text == _decode(server, [78] * 3)


@pytest.mark.parametrize("body,param,words", [
    ({"logit_bias": {"320": 1.0}}, "logit_bias", "outside the vocabulary [0, 320)"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias", "token ids"),
    ({"logit_bias": {"five": 1.0}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias", "[-100, 100]"),
    ({"allowed_token_ids": [5, 10**6]}, "allowed_token_ids", "outside the vocabulary"),
    ({"allowed_token_ids": [-3]}, "allowed_token_ids[0]", "greater than or equal to 0"),
    ({"allowed_token_ids": []}, "allowed_token_ids", ""),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_ids_are_a_400_naming_the_field(client: httpx.Client, server: LiveServer, body: dict, param: str,
                                            words: str, path: str) -> None:
    base = {"prompt": PROMPT_IDS} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = client.post(path, json={**base, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert server.wait_idle()["kv_blocks_used"] == 0


def test_the_official_client_raises_on_a_bad_id(openai_client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=2, logit_bias={"4000": 5})
