"""Every request field is honoured or refused by name: bad unicode anywhere, nested fields of the wrong
shape, fields not implemented, max_tokens past the context; and the cheap ones work (prompt_logprobs,
max_completion_tokens, the chat-template fields, continuous usage stats). No 500 shows internals, the
engine keeps serving and no KV block is held afterwards."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from minfer.server.request_fields import UNSUPPORTED

from .conftest import MODEL_NAME, LiveServer

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
BAD = "a\ud800b"  # a lone surrogate: valid JSON ("\ud800"), not valid unicode

UNICODE_CASES = [  # (path, body, param)
    (COMP, {"prompt": BAD}, "prompt"),
    (COMP, {"prompt": ["fine", BAD]}, "prompt"),
    (COMP, {"prompt": "x", "stop": BAD}, "stop"),
    (COMP, {"prompt": "x", "stop": ["ok", BAD]}, "stop"),
    (COMP, {"prompt": "x", "model": BAD}, "model"),
    (COMP, {"prompt": "x", "user": BAD}, "user"),
    (COMP, {"prompt": "x", "suffix": BAD}, "suffix"),
    (COMP, {"prompt": "x", "logit_bias": {BAD: 1.0}}, "logit_bias"),
    (CHAT, {"messages": [{"role": "user", "content": BAD}]}, "messages[0].content"),
    (CHAT, {"messages": [*MSGS, {"role": "user", "content": [{"type": "text", "text": BAD}]}]}, "messages[1].content"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": BAD}]}, "messages[0].name"),
    (CHAT, {"messages": MSGS, "stop": [BAD]}, "stop"),
    (CHAT, {"messages": MSGS, "chat_template": "{{ messages[0].content }}" + BAD}, "chat_template"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"x": BAD}}, "chat_template_kwargs"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {BAD: 1}}, "chat_template_kwargs"),
]

SHAPE_CASES = [  # nested fields of the wrong shape name the field, not "the body"
    (COMP, {"prompt": "x", "stream": True, "stream_options": ["include_usage"]}, "stream_options"),
    (COMP, {"prompt": "x", "stream": True, "stream_options": "yes"}, "stream_options"),
    (COMP, {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    (CHAT, {"messages": ["hi"]}, "messages[0]"),
    (CHAT, {"messages": [["user", "hi"]]}, "messages[0]"),
    (CHAT, {"messages": [{"role": "user", "content": {"text": "hi"}}]}, "messages[0].content"),
    (CHAT, {"messages": [*MSGS, {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                             {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[1].content"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
]

# A value each unsupported field would act on, were it implemented.
MEANINGFUL: dict[str, Any] = {
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto", "functions": [{"name": "f"}], "function_call": "auto", "parallel_tool_calls": True,
    "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "length_penalty": 2.0, "logits_processors": ["x"],
    "bad_words": ["x"], "truncate_prompt_tokens": 4, "return_tokens_as_token_ids": True,
    "prompt_embeds": "AAAA", "audio": {"voice": "x"}, "modalities": ["text", "audio"], "prediction": {"type": "content"},
    "web_search_options": {}, "documents": [{"text": "x"}], "mm_processor_kwargs": {},
    "spaces_between_special_tokens": False, "guided_anything_new": 1,
}
assert set(UNSUPPORTED) <= set(MEANINGFUL)


def _check_error(resp: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    if param:
        assert param.split(".")[0].split("[")[0] in err["message"], err
    return err


def _post(client: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    # httpx's json= encoder refuses lone surrogates; json.dumps escapes them as \ud800, as any client may send
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def _assert_clean(server: LiveServer, client: httpx.Client) -> None:
    idle = server.wait_idle()
    assert idle["healthy"] and idle["kv_blocks_used"] == 0, idle
    ok = client.post(COMP, json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_bad_unicode_in_every_text_field(client: httpx.Client, server: LiveServer) -> None:
    for path, body, param in UNICODE_CASES:
        body = {"model": MODEL_NAME, **body} if "model" not in body else body
        err = _check_error(_post(client, path, body), 400, param)
        assert "unicode" in err["message"] or "string" in err["message"], err
    _assert_clean(server, client)


def test_tokenizer_and_template_failures_are_400s(client: httpx.Client, server: LiveServer,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever else a tokenizer or template refuses is the caller's 400, without the exception's text."""
    for p in server.ctx.worker_processors:
        monkeypatch.setattr(p.tokenizer, "encode", _raise_secret, raising=False)
    _check_error(client.post(COMP, json={"prompt": "hello"}), 400, "prompt")
    resp = client.post(CHAT, json={"messages": MSGS, "chat_template": "{{ raise_exception('roles must alternate') }}"})
    assert "roles must alternate" in _check_error(resp, 400, "chat_template")["message"]
    resp = client.post(CHAT, json={"messages": MSGS, "chat_template": "{{ messages[0].content.nope() }}"})
    assert "secret" not in _check_error(resp, 400, "chat_template")["message"]
    _check_error(client.post(CHAT, json={"messages": MSGS}), 400, "messages")
    for resp in [client.post(COMP, json={"prompt": "hello"})]:
        assert "secret" not in resp.text
    monkeypatch.undo()
    _assert_clean(server, client)


def _raise_secret(*_: Any, **__: Any) -> Any:
    raise RuntimeError("secret internal state 0xdeadbeef")


def test_unexpected_500_shows_no_internals(client: httpx.Client, server: LiveServer,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.ctx, "check_model", _raise_secret)
    resp = client.post(COMP, json={"prompt": "x"})
    assert resp.status_code == 500 and "secret" not in resp.text and "deadbeef" not in resp.text
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    monkeypatch.undo()
    _assert_clean(server, client)


def test_nested_fields_of_the_wrong_shape_are_named(client: httpx.Client) -> None:
    for path, body, param in SHAPE_CASES:
        _check_error(client.post(path, json=body), 400, param)


def test_an_image_part_is_refused_naming_it(client: httpx.Client) -> None:
    """A multimodal checkpoint is served as its text model: an image part is a 400 saying so, not dropped."""
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    r = client.post(CHAT, json=body)
    _check_error(r, 400, "messages[0].content")
    assert "'image_url' content part" in r.json()["error"]["message"] and "text model" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", [COMP, CHAT])
def test_unsupported_fields_are_refused_by_name(client: httpx.Client, server: LiveServer, path: str) -> None:
    base = {"prompt": "x"} if path == COMP else {"messages": MSGS}
    for name, value in MEANINGFUL.items():
        _check_error(client.post(path, json={**base, name: value}), 400, name)
    neutral = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "user": "u", "metadata": {},
               "store": False, "service_tier": "auto", "logit_bias": {}, "use_beam_search": False}
    resp = client.post(path, json={**base, **neutral, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    _assert_clean(server, client)


def test_max_tokens_past_the_context_names_the_numbers(client: httpx.Client, server: LiveServer) -> None:
    ids = list(range(5, 105))
    for path, body in [(COMP, {"prompt": ids, "max_tokens": 100_000}),
                       (COMP, {"prompt": ids, "max_completion_tokens": 413}),
                       (CHAT, {"messages": MSGS, "max_tokens": 600}),
                       (CHAT, {"messages": MSGS, "max_completion_tokens": 600})]:
        err = _check_error(client.post(path, json=body), 400, "max_tokens")
        assert "512" in err["message"] and ("100000" in err["message"] or "413" in err["message"]
                                            or "600" in err["message"])
        if path == COMP:
            assert "100 input tokens" in err["message"]
    ok = client.post(COMP, json={"prompt": ids, "max_tokens": 412, "ignore_eos": True})  # exactly the context
    assert ok.status_code == 200 and ok.json()["usage"]["total_tokens"] == 512
    _assert_clean(server, client)


def test_max_completion_tokens_on_completions(client: httpx.Client) -> None:
    resp = client.post(COMP, json={"prompt": "x", "max_completion_tokens": 5, "ignore_eos": True}).json()
    assert resp["usage"]["completion_tokens"] == 5
    _check_error(client.post(COMP, json={"prompt": "x", "max_completion_tokens": 5, "max_tokens": 6}), 400,
                 "max_completion_tokens")


def test_prompt_logprobs(client: httpx.Client, server: LiveServer) -> None:
    ids = server.ctx.tokenizer.encode("def fibonacci(n):")
    for path, base in [(COMP, {"prompt": ids}), (CHAT, {"messages": [{"role": "user", "content": "hello"}]})]:
        choice = client.post(path, json={**base, "max_tokens": 2, "prompt_logprobs": 2}).json()["choices"][0]
        lps = choice["prompt_logprobs"]
        assert lps[0] is None and all(2 <= len(e) <= 3 for e in lps[1:])
        if path == COMP:
            assert len(lps) == len(ids)
            for pos in range(1, len(ids)):
                assert str(ids[pos]) in lps[pos] and lps[pos][str(ids[pos])]["logprob"] <= 0
    _check_error(client.post(COMP, json={"prompt": "x", "prompt_logprobs": 1, "stream": True}), 400, "prompt_logprobs")
    _assert_clean(server, client)


def test_chat_template_fields(client: httpx.Client, server: LiveServer) -> None:
    def prompt_tokens(**extra: Any) -> int:
        resp = client.post(CHAT, json={"messages": MSGS, "max_tokens": 1, **extra})
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens"]

    tok = server.ctx.tokenizer
    with_prompt = prompt_tokens()
    assert prompt_tokens(add_generation_prompt=False) < with_prompt
    template = "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ flavour }}]{% endfor %}"
    expected = tok.encode("[user|hi|mint]", add_special_tokens=False)
    assert prompt_tokens(chat_template=template, chat_template_kwargs={"flavour": "mint"}) == len(expected)
    assert prompt_tokens(chat_template=template, chat_template_kwargs={"flavour": "mint"},
                         add_special_tokens=True) == len(tok.encode("[user|hi|mint]"))
    cont = [*MSGS, {"role": "assistant", "content": "Hello th"}]
    ends_open = prompt_tokens(messages=cont, add_generation_prompt=False, continue_final_message=True)
    assert ends_open < prompt_tokens(messages=cont, add_generation_prompt=False)
    _check_error(client.post(CHAT, json={"messages": MSGS, "continue_final_message": True,
                                         "add_generation_prompt": False}), 400, "continue_final_message")
    _check_error(client.post(CHAT, json={"messages": MSGS, "chat_template_kwargs": {"tokenize": True}}), 400,
                 "chat_template_kwargs")
    _assert_clean(server, client)


@pytest.mark.parametrize("path", [COMP, CHAT])
def test_continuous_usage_stats(client: httpx.Client, path: str) -> None:
    base = {"prompt": "def f():"} if path == COMP else {"messages": MSGS}
    body = {**base, "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with client.stream("POST", path, json=body) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == 6 and len(set(u["prompt_tokens"] for u in usages)) == 1
