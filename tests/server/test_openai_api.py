"""The official ``openai`` client against the server: the API works unchanged."""
from __future__ import annotations

import math
from typing import Any

import pytest

from .conftest import MODEL_NAME

openai = pytest.importorskip("openai")

PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A stack class"}]


def _stream_completion(client: Any, **kw: Any) -> tuple[dict[int, str], dict[int, str | None], Any]:
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    usage = None
    for chunk in client.completions.create(model=MODEL_NAME, stream=True,
                                           stream_options={"include_usage": True}, **kw):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
        usage = chunk.usage or usage
    return texts, reasons, usage


def _stream_chat(client: Any, **kw: Any) -> tuple[dict[int, str], dict[int, str | None], Any]:
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    usage = None
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
        usage = chunk.usage or usage
    return texts, reasons, usage


def test_models_list(openai_client: Any) -> None:
    assert [m.id for m in openai_client.models.list().data] == [MODEL_NAME]


def test_completion_streamed_equals_whole(openai_client: Any, server: Any) -> None:
    kw = dict(prompt=PROMPT, max_tokens=24, temperature=0.9, top_p=0.95, seed=7,
              extra_body={"top_k": 50, "min_p": 0.01, "ignore_eos": True})
    whole = openai_client.completions.create(model=MODEL_NAME, **kw)
    texts, reasons, usage = _stream_completion(openai_client, **kw)
    assert whole.object == "text_completion" and whole.model == MODEL_NAME
    assert texts == {0: whole.choices[0].text} and whole.choices[0].text
    assert reasons == {0: "length"} and whole.choices[0].finish_reason == "length"
    n_prompt = len(server.ctx.tokenizer.encode(PROMPT))
    assert whole.usage.prompt_tokens == usage.prompt_tokens == n_prompt
    assert whole.usage.completion_tokens == usage.completion_tokens == 24
    assert whole.usage.total_tokens == n_prompt + 24


def test_chat_streamed_equals_whole(openai_client: Any) -> None:
    kw = dict(messages=MESSAGES, max_completion_tokens=20, temperature=0.7, seed=3,
              presence_penalty=0.5, frequency_penalty=0.3, extra_body={"repetition_penalty": 1.1})
    whole = openai_client.chat.completions.create(model=MODEL_NAME, **kw)
    texts, reasons, usage = _stream_chat(openai_client, **kw)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert texts == {0: whole.choices[0].message.content}
    assert reasons[0] == whole.choices[0].finish_reason in ("stop", "length")
    assert usage.completion_tokens == whole.usage.completion_tokens <= 20
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 0


def test_n_samples(openai_client: Any) -> None:
    kw = dict(prompt=PROMPT, max_tokens=16, temperature=1.0, seed=11, n=2, extra_body={"ignore_eos": True})
    whole = openai_client.completions.create(model=MODEL_NAME, **kw)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].text != whole.choices[1].text  # two seeds derived from one
    assert whole.usage.completion_tokens == 32
    texts, _, usage = _stream_completion(openai_client, **kw)
    assert texts == {c.index: c.text for c in whole.choices}
    chat = openai_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, max_tokens=8, seed=5)
    assert [c.index for c in chat.choices] == [0, 1]


def test_stop_string(openai_client: Any) -> None:
    base = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text
    # A two-character stop string that first occurs a few characters in.
    at = next(i for i in range(4, len(base) - 2) if base[i:i + 2].isascii() and base[i:i + 2].isprintable())
    stop = base[at:at + 2]
    expected = base[:base.find(stop)]
    kw = dict(prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "@@never@@"], extra_body={"ignore_eos": True})
    whole = openai_client.completions.create(model=MODEL_NAME, **kw)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "stop"
    texts, reasons, _ = _stream_completion(openai_client, **kw)
    assert texts[0] == expected and reasons[0] == "stop"


def test_completion_logprobs(openai_client: Any) -> None:
    out = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 4
        assert all(v <= chosen + 1e-5 for v in top.values())  # greedy picks the top token
        assert tok in top  # (byte tokens may share a string such as U+FFFD, so compare no more)


def test_chat_logprobs_streamed(openai_client: Any) -> None:
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    whole = openai_client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(whole) == 5
    for entry in whole:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-5)
        assert entry.bytes == list(entry.token.encode())
    streamed = [e for chunk in openai_client.chat.completions.create(stream=True, **kw)
                for ch in chunk.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in whole]


def test_token_id_and_batched_prompts(openai_client: Any, server: Any) -> None:
    ids = server.ctx.tokenizer.encode(PROMPT)
    by_ids = openai_client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
    by_text = openai_client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = openai_client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "import os"], max_tokens=8,
                                             temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == by_text.choices[0].text
    streamed, _, _ = _stream_completion(openai_client, prompt=[PROMPT, "import os"], max_tokens=8, temperature=0, n=2)
    assert streamed == {c.index: c.text for c in batch.choices}


def test_max_tokens_and_ignore_eos(openai_client: Any) -> None:
    out = openai_client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=33, temperature=1.0, seed=1,
                                           extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 33 and out.choices[0].finish_reason == "length"
