"""Structured outputs and tool calls through the official ``openai`` client, on a tiny random model: whatever
it would write, the constrained output parses and validates, streamed or not (a seeded stream joins, by
the client's own accumulation, to the non-streamed response); bad constraints and tool requests are 400s
naming the field, after which the server still serves."""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import jsonschema
import pytest

from minfer.cli import main

from .conftest import MODEL_NAME, LiveServer

openai = pytest.importorskip("openai")
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402

# A template that renders tools, earlier calls and tool results (the tiny model's own one renders none);
# transformers renders with trim_blocks, so a newline right after a tag is dropped.
TOOLS_TEMPLATE = (
    "{% if tools %}<s>system: you may call{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<s>{{ m.role }}: {% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"type": "integer", "minimum": 0, "maximum": 12}},
         "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "grade": {"enum": ["a", "b", "c"]}},
          "required": ["ok", "grade"], "additionalProperties": False}
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def tool_server(tiny_model: Any) -> Iterator[LiveServer]:
    """The tiny model with a tool-rendering template, auto tool choice on and the hermes parser, passed
    through ``LiveServer``'s ``app_args``."""
    live = LiveServer(tiny_model, chat_template=TOOLS_TEMPLATE,
                      app_args=dict(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    yield live
    live.stop()


@pytest.fixture()
def oai(tool_server: LiveServer) -> Any:
    return openai.OpenAI(base_url=tool_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture()
def http(tool_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tool_server.base_url, timeout=60) as c:
        yield c


def _chat(oai: Any, **kw: Any) -> Any:
    return oai.chat.completions.create(model=MODEL_NAME, messages=kw.pop("messages", MESSAGES), **kw)


def _streamed(oai: Any, **kw: Any) -> Any:
    """The stream as the openai client accumulates it into one completion."""
    state = ChatCompletionStreamState()
    for chunk in _chat(oai, stream=True, **kw):
        state.handle_chunk(chunk)
    return state.get_final_completion()


def _calls(choice: Any) -> list[tuple[str, Any]]:
    """(name, decoded arguments) of a choice's calls, each validated against its tool's parameters."""
    out = []
    for call in choice.message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, PARAMS[call.function.name])
        out.append((call.function.name, args))
    return out


def _summary(resp: Any) -> list[tuple[Any, ...]]:
    return [(c.index, c.finish_reason, c.message.content, _calls(c)) for c in resp.choices]


def test_response_format_json_schema(oai: Any) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    kw = dict(response_format=fmt, max_tokens=200, seed=5, n=2)
    whole = _chat(oai, **kw)
    for c in whole.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), ANSWER)
    assert _summary(_streamed(oai, **kw)) == _summary(whole)


def test_json_object_and_structured_outputs_extras(oai: Any) -> None:
    outs = _chat(oai, response_format={"type": "json_object"}, max_tokens=200, seed=1, n=4).choices
    for out in outs:  # an object with free keys may not close within max_tokens on random weights
        assert out.message.content.lstrip().startswith("{")
    done = [out for out in outs if out.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(out.message.content), dict) for out in done)
    for extra in ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, {"guided_regex": "[0-9]{3}-[a-z]{2}"}):
        text = oai.completions.create(model=MODEL_NAME, prompt="id:", max_tokens=20, extra_body=extra).choices[0].text
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha(), text
    for extra in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}):
        whole = _chat(oai, max_tokens=10, n=2, seed=3, extra_body=extra)
        assert [c.message.content for c in whole.choices] == [c.message.content for c in
                                                              _streamed(oai, max_tokens=10, n=2, seed=3,
                                                                        extra_body=extra).choices]
        assert {c.message.content for c in whole.choices} <= {"yes", "no"}
        assert {c.finish_reason for c in whole.choices} == {"stop"}
    schema = {"structured_outputs": {"json": ANSWER, "disable_any_whitespace": True}}
    text = oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=40, extra_body=schema).choices[0].text
    jsonschema.validate(json.loads(text), ANSWER)
    assert text == json.dumps(json.loads(text))  # one space after ',' and ':', no other whitespace


def test_tool_choice_required(oai: Any) -> None:
    kw = dict(tools=TOOLS, tool_choice="required", max_tokens=300, seed=2, n=2)
    whole = _chat(oai, **kw)
    for c in whole.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(_calls(c)) >= 1
    assert _summary(_streamed(oai, **kw)) == _summary(whole)
    one = _chat(oai, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=300, seed=4)
    assert len(_calls(one.choices[0])) == 1 and one.choices[0].finish_reason == "tool_calls"


def test_named_tool_choice(oai: Any) -> None:
    kw = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=200,
              seed=6, n=2)
    whole = _chat(oai, **kw)
    for c in whole.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert [name for name, _ in _calls(c)] == ["get_weather"]
    assert _summary(_streamed(oai, **kw)) == _summary(whole)
    deltas = [ch.choices[0].delta for ch in _chat(oai, stream=True, **{**kw, "n": 1})]
    pieces = [d.tool_calls[0].function.arguments for d in deltas if d.tool_calls]
    assert len(pieces) > 3  # the arguments stream as they are generated
    assert deltas[0].tool_calls[0].function.name == "get_weather" and deltas[0].tool_calls[0].id


def test_auto_tool_choice_parses_hermes(oai: Any) -> None:
    """The random model is steered by a regex into a hermes block; auto tool choice turns it into a call."""
    regex = r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"tz": (3|7)\}\}</tool_call>'
    kw = dict(tools=TOOLS, max_tokens=150, seed=8, extra_body={"structured_outputs": {"regex": regex}})
    whole = _chat(oai, **kw)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    assert [name for name, _ in _calls(choice)] == ["get_time"]
    assert _summary(_streamed(oai, **kw)) == _summary(whole)
    plain = _chat(oai, tools=TOOLS, tool_choice="auto", max_tokens=8, seed=1).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason == "length"
    none = _chat(oai, tools=TOOLS, tool_choice="none", max_tokens=8, seed=1).choices[0]
    assert none.message.tool_calls is None and none.message.content


def test_tool_history_reaches_the_template(http: httpx.Client, tool_server: LiveServer) -> None:
    history = [*MESSAGES,
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    resp = http.post(CHAT, json={"messages": history, "max_tokens": 1, "tools": TOOLS, "tool_choice": "none"})
    assert resp.status_code == 200, resp.text
    expected = ('<s>user: What is the weather in Paris?<s>assistant: <tool_call>{"name": "get_weather", '
                '"arguments": {"city": "Paris", "unit": "c"}}</tool_call><s>tool: sunny [call_1]assistant:')
    tok = tool_server.ctx.tokenizer
    assert resp.json()["usage"]["prompt_tokens"] == len(tok.encode(expected, add_special_tokens=False))
    history[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    _check_400(http.post(CHAT, json={"messages": history}), "messages[1].tool_calls[0].function.arguments")


BAD_REQUESTS = [  # (path, body, param)
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    (CHAT, {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "", "schema": {}}}},
     "response_format.json_schema.name"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}}}},
     "response_format.json_schema.schema"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(100)} | {"d100": {"type": "integer"}},
        "$ref": "#/$defs/d0"}}}}, "response_format.json_schema.schema"),  # past --structured-outputs-max-depth
    (COMP, {"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs.grammar"),
    (CHAT, {"response_format": {"type": "yaml"}}, "response_format.type"),
    (COMP, {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    (COMP, {"guided_regex": "a(b"}, "guided_regex"),
    (COMP, {"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    (COMP, {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    (COMP, {"structured_outputs": {}}, "structured_outputs"),
    (COMP, {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
    (COMP, {"tools": TOOLS}, "tools"),
    (CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
    (CHAT, {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"parallel_tool_calls": False}, "parallel_tool_calls"),
    (CHAT, {"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                    "not": {}}}}],
            "tool_choice": "required"}, "tools[0].function.parameters"),
    (CHAT, {"tools": TOOLS, "tool_choice": "required", "chat_template": "{{ messages[0].content }}"}, "tools"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0]"),
]


def _check_400(resp: httpx.Response, param: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert param.split(".")[0].split("[")[0] in err["message"], err


def test_bad_requests_name_the_field(http: httpx.Client, tool_server: LiveServer) -> None:
    for path, body, param in BAD_REQUESTS:
        base = {"prompt": "x"} if path == COMP else {"messages": MESSAGES}
        _check_400(http.post(path, json={**base, **body, "max_tokens": 4}), param)
    tool_server.ctx.auto_tool_parser = None  # as without --enable-auto-tool-choice
    try:
        _check_400(http.post(CHAT, json={"messages": MESSAGES, "tools": TOOLS}), "tool_choice")  # auto by default
        _check_400(http.post(CHAT, json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"}), "tool_choice")
    finally:
        tool_server.ctx.auto_tool_parser = "hermes"
    idle = tool_server.wait_idle()
    assert idle["healthy"] and idle["kv_blocks_used"] == 0, idle
    ok = http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_metrics(http: httpx.Client, oai: Any) -> None:
    oai.completions.create(model=MODEL_NAME, prompt="m", max_tokens=5, extra_body={"guided_regex": "[ab]{4}z"})
    text = http.get("/metrics").text
    assert "# TYPE minfer_num_requests_constrained gauge" in text and "\nminfer_num_requests_constrained " in text
    assert "# TYPE minfer_grammar_compile_seconds histogram" in text
    count = next(line for line in text.splitlines() if line.startswith("minfer_grammar_compile_seconds_count"))
    assert float(count.split()[-1]) >= 1
    assert 'minfer_grammar_compile_seconds_bucket{le="+Inf"}' in text


def test_serve_flags(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import minfer.cli.serve as serve_cli

    seen: dict[str, Any] = {}
    monkeypatch.setattr(serve_cli, "run_server", lambda model, engine_kwargs, **kw: seen.update(kw))
    assert main(["serve", "m", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]) == 0
    assert seen["enable_auto_tool_choice"] is True and seen["tool_call_parser"] == "llama3_json"
    assert main(["serve", "m"]) == 0
    assert seen["enable_auto_tool_choice"] is False and seen["tool_call_parser"] is None
    from minfer.config import EngineConfig
    from minfer.server.run import run_server

    monkeypatch.setattr(serve_cli, "run_server", run_server)  # the real one: it checks before the model loads
    monkeypatch.setattr(EngineConfig, "from_kwargs", lambda **kw: pytest.fail("the model began to load"))
    assert main(["serve", "m", "--enable-auto-tool-choice"]) == 2
    assert "--tool-call-parser" in capsys.readouterr().err


def test_parse_with_a_pydantic_model_of_bounded_strings(oai: Any) -> None:
    """The openai client's ``parse()`` sends the model's schema (bounded strings: the grammar xgrammar writes
    for them admitted raw control characters) and parses every answer back into the model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(min_length=1, max_length=8)
        nickname: str = Field(max_length=4)
        role: Literal["admin", "user\tx"]

    parse = getattr(oai.chat.completions, "parse", None) or oai.beta.chat.completions.parse
    finished = 0
    for seed in range(8):
        try:
            completion = parse(model=MODEL_NAME, messages=MESSAGES, response_format=Person, temperature=1.0,
                               seed=seed, max_tokens=300)
        except openai.LengthFinishReasonError:  # unfinished at max_tokens: nothing to parse
            continue
        finished += 1
        choice = completion.choices[0]
        json.loads(choice.message.content)  # strict
        assert isinstance(choice.message.parsed, Person), choice.message.content
    assert finished >= 3
