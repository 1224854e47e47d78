"""gpt-oss's chat format through the HTTP server (``--reasoning-parser gpt_oss --tool-call-parser gpt_oss``): a
tiny checkpoint whose tokenizer has harmony's special tokens and gpt-oss's chat template, its output scripted as
token ids (``harmony_fixtures.ScriptedSampler``), so the markers arrive as the special tokens they are. Reasoning,
answers and tool calls whole and streamed, with no marker in what the client sees whatever the request's
``skip_special_tokens``; the server's rendering of the real template with tools, a call history and
``chat_template_kwargs``; a request without a parser as before."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from harmony_fixtures import MARKERS, ScriptedSampler, harmony_checkpoint
from minfer.server.chat import render_chat
from minfer.server.chat_template import RenderBudget
from minfer.server.protocol import ChatCompletionRequest

from .conftest import MODEL_NAME, LiveServer

openai = pytest.importorskip("openai")
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402

THOUGHT = "<|channel|>analysis<|message|>Two and two.<|end|>"
ANSWER = f"{THOUGHT}<|start|>assistant<|channel|>final<|message|>Four.<|return|>"
CALLING = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
           "Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
           '<|message|>{"city": "Paris"}<|call|>')
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
USER = [{"role": "user", "content": "2 + 2?"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = harmony_checkpoint(tmp_path_factory.mktemp("harmony") / "gpt-oss-like")
    server = LiveServer(path, app_args=dict(enable_auto_tool_choice=True, tool_call_parser="gpt_oss",
                                            reasoning_parser="gpt_oss"))
    server.engine.runner.sampler = ScriptedSampler(server.engine.runner.sampler)
    yield server
    server.stop()


@pytest.fixture()
def oai(live: LiveServer) -> Any:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _script(live: LiveServer, text: str) -> None:
    live.engine.runner.sampler.script = live.engine.tokenizer.encode(text, add_special_tokens=False)


def _chat(oai: Any, messages: list[dict[str, Any]] = USER, **kw: Any) -> Any:
    return oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=kw.pop("max_tokens", 200), **kw)


def _stream(oai: Any, messages: list[dict[str, Any]] = USER, **kw: Any) -> tuple[Any, dict[int, str]]:
    """The stream joined as the openai client does, and each choice's reasoning joined from its deltas."""
    state, reasoning = ChatCompletionStreamState(), {}
    for chunk in _chat(oai, messages, stream=True, **kw):
        for choice in chunk.choices:
            piece = (choice.delta.model_extra or {}).get("reasoning_content")
            for text in (piece, choice.delta.content):
                assert not any(m in (text or "") for m in MARKERS)
            if piece:
                reasoning[choice.index] = reasoning.get(choice.index, "") + piece
        state.handle_chunk(chunk)
    return state.current_completion_snapshot, reasoning


def _reasoning(message: Any) -> Any:
    return (message.model_extra or {}).get("reasoning_content", "absent")


@pytest.mark.parametrize("skip", [None, True, False])
def test_reasoning_and_answer(live: LiveServer, oai: Any, skip: bool | None) -> None:
    """The markers are kept for the parser whatever the request says, and none reaches the client."""
    _script(live, ANSWER)
    body = {} if skip is None else {"skip_special_tokens": skip}
    whole = _chat(oai, extra_body=body).choices[0]
    assert (_reasoning(whole.message), whole.message.content, whole.finish_reason) == ("Two and two.", "Four.", "stop")
    streamed, reasoning = _stream(oai, extra_body=body, n=2, temperature=1.0)  # each choice its own parser
    assert reasoning == {0: "Two and two.", 1: "Two and two."}
    assert [c.message.content for c in streamed.choices] == ["Four.", "Four."]


def test_tool_call_after_reasoning_and_a_preamble(live: LiveServer, oai: Any) -> None:
    _script(live, CALLING)
    for message, reason, thought in [(lambda c: (c.message, c.finish_reason, _reasoning(c.message)))(
            _chat(oai, tools=[WEATHER]).choices[0]),
            (lambda s: (s[0].choices[0].message, s[0].choices[0].finish_reason, s[1].get(0)))(
                _stream(oai, tools=[WEATHER]))]:
        assert (thought, message.content, reason) == ("Need the weather.", "Checking.", "tool_calls")
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == \
            [("get_weather", '{"city": "Paris"}')]
        assert message.tool_calls[0].id.startswith("call_") and message.tool_calls[0].type == "function"


def test_a_call_without_tools_or_cut_short(live: LiveServer, oai: Any) -> None:
    """No tools: the reasoning parser alone, a call is not content. Cut inside the call's arguments (max_tokens):
    the partial arguments are content, the finish stays "length"."""
    _script(live, CALLING)
    plain = _chat(oai).choices[0]
    assert (_reasoning(plain.message), plain.message.content, plain.message.tool_calls) == \
        ("Need the weather.", "Checking.", None)
    cut = len(live.engine.tokenizer.encode(CALLING, add_special_tokens=False)) - 3
    for choice in (_chat(oai, tools=[WEATHER], max_tokens=cut).choices[0],
                   _stream(oai, tools=[WEATHER], max_tokens=cut)[0].choices[0]):
        assert choice.finish_reason == "length" and not choice.message.tool_calls
        assert choice.message.content.startswith("Checking.\n{\"city\"")


def test_the_template_renders_tools_history_and_kwargs(live: LiveServer, oai: Any) -> None:
    """The server's own rendering (traced under a RenderBudget, as with chat_template_kwargs) of gpt-oss's
    template equals transformers' with the same messages, arguments decoded as templates expect."""
    req = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [WEATHER],
                                                "chat_template_kwargs": {"reasoning_effort": "low"}})
    tok = live.engine.tokenizer
    text = render_chat(tok, req, [WEATHER], RenderBudget())
    history = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": {"city": "Paris"}}}
                                    for c in m["tool_calls"]]} if "tool_calls" in m else m for m in HISTORY]
    assert text == tok.apply_chat_template(history, tools=[WEATHER], tokenize=False, add_generation_prompt=True,
                                           reasoning_effort="low")
    assert "Reasoning: low" in text and "type get_weather = (_: {\ncity: string,\n}) => any;" in text
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' \
           in text and text.endswith('"sunny"<|end|><|start|>assistant')
    _script(live, f"{THOUGHT}<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>")
    answer = _chat(oai, HISTORY, tools=[WEATHER], extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}})
    assert answer.choices[0].message.content == "Sunny." and answer.usage.prompt_tokens == \
        len(tok.encode(text, add_special_tokens=False))


def test_reasoning_effort_is_a_template_variable(live: LiveServer, oai: Any) -> None:
    """OpenAI's top-level ``reasoning_effort`` reaches the template (a chat_template_kwargs entry wins); on
    /v1/completions, which has no template, it is refused by name."""
    tok = live.engine.tokenizer
    for body, effort in [({"reasoning_effort": "low"}, "low"), ({}, "medium"),
                         ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}, "high")]:
        req = ChatCompletionRequest.model_validate({"messages": USER, **body})
        assert f"Reasoning: {effort}\n" in render_chat(tok, req)
    _script(live, ANSWER)
    assert _chat(oai, reasoning_effort="low").choices[0].message.content == "Four."
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={"reasoning_effort": "low"})
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        _chat(oai, extra_body={"reasoning_effort": "extreme"})


def test_without_a_parser_as_before(live: LiveServer, oai: Any) -> None:
    """No parser: the text is the content, decoded as the request says (markers skipped by default)."""
    ctx = live.ctx
    _script(live, ANSWER)
    try:
        ctx.reasoning_parser = None
        default = _chat(oai).choices[0].message
        assert (_reasoning(default), default.content) == ("absent", "analysisTwo and two.assistantfinalFour.")
        kept = _chat(oai, extra_body={"skip_special_tokens": False}).choices[0].message
        assert kept.content.removesuffix("<|return|>") == ANSWER.removesuffix("<|return|>")  # markers and all
    finally:
        ctx.reasoning_parser = "gpt_oss"


def test_serve_flags_accept_gpt_oss(monkeypatch: pytest.MonkeyPatch) -> None:
    import minfer.cli.serve as serve_cli
    from minfer.cli import main

    seen: dict[str, Any] = {}
    monkeypatch.setattr(serve_cli, "run_server", lambda model, engine_kwargs, **kw: seen.update(kw))
    assert main(["serve", "m", "--reasoning-parser", "gpt_oss", "--enable-auto-tool-choice",
                 "--tool-call-parser", "gpt_oss"]) == 0
    assert (seen["reasoning_parser"], seen["tool_call_parser"]) == ("gpt_oss", "gpt_oss")


def test_fixture_checkpoint_is_harmony(live: LiveServer) -> None:
    tok = live.engine.tokenizer
    assert set(live.engine.eos_token_ids) >= {tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>")}
    assert Path(live.engine.model_dir).name == "gpt-oss-like"
