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


def _hf_beam_texts(server: LiveServer, model_dir: Any, prompt: list[int], width: int, max_tokens: int,
                   length_penalty: float = 1.0) -> list[str]:
    """HF generate's beams (best first), decoded as the server decodes a choice."""
    import torch

    from .conftest import _root_conftest

    hf = _root_conftest()._hf_model(model_dir)
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                      length_penalty=length_penalty, return_dict_in_generate=True, pad_token_id=0)
    lengths = (out.beam_indices >= 0).sum(1).tolist()
    return [_decode(server, out.sequences[i, len(prompt):len(prompt) + n].tolist()) for i, n in enumerate(lengths)]


def test_beam_search_completions_equal_hf(openai_client: Any, server: LiveServer, tiny_model: Any) -> None:
    prompts = [PROMPT_IDS, [5, 9, 17, 33]]
    out = openai_client.completions.create(model=MODEL_NAME, prompt=prompts, n=3, max_tokens=8,
                                           extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.index for c in out.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        texts = [c.text for c in out.choices[3 * i:3 * i + 3]]
        assert texts == _hf_beam_texts(server, tiny_model, prompt, 3, 8, 0.5)
    assert all(c.finish_reason == "length" for c in out.choices)  # this model's EOS never makes the top beams
    assert out.usage.completion_tokens == 6 * 8 and out.usage.prompt_tokens == len(PROMPT_IDS) + 4
    assert server.wait_idle()["kv_blocks_used"] == 0


def test_beam_search_chat_equals_hf(openai_client: Any, server: LiveServer, tiny_model: Any) -> None:
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    out = openai_client.chat.completions.create(model=MODEL_NAME, messages=messages, n=2, max_tokens=6,
                                                extra_body={"use_beam_search": True, "early_stopping": True})
    tok = server.ctx.tokenizer
    prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    assert [c.message.content for c in out.choices] == _hf_beam_texts(server, tiny_model, prompt, 2, 6)
    assert [c.index for c in out.choices] == [0, 1]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"use_beam_search": True, "stream": True}, "stream"),
    ("/v1/completions", {"use_beam_search": True, "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"use_beam_search": True, "top_p": 0.5}, "top_p"),
    ("/v1/completions", {"use_beam_search": True, "logit_bias": {"5": 1}}, "logit_bias"),
    ("/v1/completions", {"length_penalty": 2.0}, "length_penalty"),
    ("/v1/completions", {"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
    ("/v1/chat/completions", {"use_beam_search": True, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("/v1/chat/completions", {"use_beam_search": True, "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_beam_search_refuses_what_it_does_not_honour(client: httpx.Client, path: str, body: dict, param: str) -> None:
    base = {"prompt": PROMPT_IDS} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = client.post(path, json={**base, "n": 2, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
