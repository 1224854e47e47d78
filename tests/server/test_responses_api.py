"""POST /v1/responses through the official ``openai`` client and the ``openai-agents`` package, on the tiny random
model: its text forced by a regex (vLLM's ``structured_outputs`` extra, as the chat tool and reasoning tests do) or
by a tool choice's grammar. One server for the module: hermes auto tool choice, the qwen3 reasoning parser, a
template that renders tools, calls and tool results.

Whole, items and instructions against chat's own prompt; the stream's events checked in order against the whole
response; ``.parse`` and ``.stream`` with a pydantic ``text_format``; a function call round trip through
``previous_response_id``; reasoning items; the store (GET, DELETE, ``store=false``, eviction); refusals named by
the Responses API's fields; an agent running one function tool."""
from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from minfer.server.errors import APIError
from minfer.server.responses_api import renamed
from minfer.server.responses_store import ResponseStore

from .conftest import MODEL_NAME, LiveServer

openai = pytest.importorskip("openai")
agents = pytest.importorskip("agents")

TEMPLATE = (
    "{% if tools %}<s>system: you may call{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<s>{{ m.role }}: {% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
QUESTION = "What is the weather in Paris?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather", "parameters": WEATHER,
          "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]


class Answer(BaseModel):
    ok: bool
    grade: Literal["a", "b", "c"]


def _regex(text: str) -> str:
    """A regex matching exactly ``text``."""
    return "".join("\\" + ch if ch in r".^$*+?{}[]\|()/" else ch for ch in text)


def _forced(text: str) -> dict[str, Any]:
    return {"structured_outputs": {"regex": _regex(text)}}


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The tiny model with a 1024-token context (its RoPE has no learned end), so that a turn's prompt (this
    tokenizer spends a token on every two characters or so) leaves room for a grammar's worst-case output."""
    model = tmp_path_factory.mktemp("responses") / "llama3"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    server = LiveServer(model, chat_template=TEMPLATE, app_args=dict(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"))
    yield server
    server.stop()


@pytest.fixture()
def oai(live: LiveServer) -> Any:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture()
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.base_url, timeout=60) as c:
        yield c


def _create(oai: Any, **kw: Any) -> Any:
    return oai.responses.create(model=MODEL_NAME, **kw)


def _prompt_tokens(oai: Any, messages: list[dict[str, Any]], **kw: Any) -> int:
    """What chat prefills for ``messages`` (the prompt a response must render too)."""
    return oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, **kw).usage.prompt_tokens


# ---- whole responses ----------------------------------------------------------------------------------------
def test_string_and_items_input_with_instructions(oai: Any) -> None:
    text = "Sunny, 21 degrees."
    resp = _create(oai, input=QUESTION, instructions="Answer briefly.", extra_body=_forced(text))
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL_NAME
    assert (resp.status, resp.incomplete_details, resp.output_text) == ("completed", None, text)
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and [p.type for p in message.content] == ["output_text"]
    asked = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    assert resp.usage.input_tokens == _prompt_tokens(oai, asked)
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens > resp.usage.input_tokens
    assert resp.instructions == "Answer briefly." and resp.store is True and resp.tools == []
    items = [{"role": "system", "content": "Answer briefly."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the "},
                                                             {"type": "input_text", "text": "weather in Paris?"}]}]
    same = _create(oai, input=items, extra_body=_forced(text))
    assert same.output_text == text and same.usage.input_tokens == resp.usage.input_tokens


def test_cut_output_is_incomplete(oai: Any) -> None:
    resp = _create(oai, input=QUESTION, max_output_tokens=3, extra_body=_forced("a" * 60))
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.output[0].status == "incomplete"
    assert resp.max_output_tokens == 3 and set(resp.output_text) == {"a"}


# ---- streams ------------------------------------------------------------------------------------------------
def _check_order(events: list[Any]) -> None:
    """The Responses API's event grammar: numbered from 0; created and in_progress first, the terminal event last;
    every item added at the next output index, its parts, deltas and .done events between its added and done."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    state: dict[int, str] = {}  # output index -> the item's last event
    allowed = {"added": {"response.content_part.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done"},
               "response.content_part.added": {"response.output_text.delta", "response.reasoning_text.delta",
                                               "response.output_text.done", "response.reasoning_text.done"},
               "response.output_text.delta": {"response.output_text.delta", "response.output_text.done"},
               "response.reasoning_text.delta": {"response.reasoning_text.delta", "response.reasoning_text.done"},
               "response.output_text.done": {"response.content_part.done"},
               "response.reasoning_text.done": {"response.content_part.done"},
               "response.content_part.done": {"response.output_item.done"},
               "response.function_call_arguments.delta": {"response.function_call_arguments.delta",
                                                          "response.function_call_arguments.done"},
               "response.function_call_arguments.done": {"response.output_item.done"}}
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert e.output_index == len(state) and e.item.status == "in_progress"
            state[e.output_index] = "added"
        else:
            assert e.type in allowed[state[e.output_index]], (state[e.output_index], e.type)
            state[e.output_index] = e.type
    assert set(state.values()) <= {"response.output_item.done"}


def _streamed(oai: Any, **kw: Any) -> tuple[list[Any], Any]:
    with oai.responses.stream(model=MODEL_NAME, **kw) as stream:
        events = list(stream)
        final = stream.get_final_response() if events[-1].type == "response.completed" else None
    _check_order(events)
    return events, final


def test_stream_events_in_order_join_to_the_whole_response(oai: Any) -> None:
    text = "Sunny, with a light breeze over the river."
    whole = _create(oai, input=QUESTION, extra_body={**_forced(text), "seed": 3})
    events, final = _streamed(oai, input=QUESTION, extra_body={**_forced(text), "seed": 3})
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert kinds.count("response.output_text.delta") > 1  # it did stream
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert final.output_text == whole.output_text == text and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id == events[0].response.id
    cut, _ = _streamed(oai, input=QUESTION, max_output_tokens=4, extra_body=_forced("b" * 40))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert cut[-1].response.output[0].status == "incomplete"


def test_parse_and_stream_with_a_text_format(oai: Any) -> None:
    parsed = oai.responses.parse(model=MODEL_NAME, input="Grade it.", text_format=Answer, max_output_tokens=300,
                                 temperature=1.0, extra_body={"seed": 7})
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Answer)
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Answer"
    _, final = _streamed(oai, input="Grade it.", text_format=Answer, max_output_tokens=300, temperature=1.0,
                         extra_body={"seed": 7})
    assert final.output_parsed == parsed.output_parsed  # seeded: the same draws streamed or not
    loose = _create(oai, input="An object.", text={"format": {"type": "json_object"}}, max_output_tokens=60,
                    extra_body={"seed": 1})
    assert loose.output_text.lstrip().startswith("{")


# ---- tools --------------------------------------------------------------------------------------------------
def _call(resp: Any) -> Any:
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1, resp.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    return call


def test_function_call_round_trip_through_previous_response_id(oai: Any) -> None:
    first = _create(oai, input=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                    max_output_tokens=300, extra_body={"seed": 2})
    call = _call(first)
    assert first.status == "completed" and first.tool_choice == "required" and first.tools[0].name == "get_weather"
    answer = "It is sunny in Paris."
    second = _create(oai, previous_response_id=first.id, tools=TOOLS, extra_body=_forced(answer),
                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert second.output_text == answer and second.previous_response_id == first.id
    conversation = [{"role": "user", "content": QUESTION},
                    {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                        "name": call.name, "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    assert second.usage.input_tokens == _prompt_tokens(oai, conversation, tools=CHAT_TOOLS)
    # the same turn sent whole, as the agents SDK sends it (the earlier items back, no previous_response_id)
    items = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    again = _create(oai, input=items, tools=TOOLS, extra_body=_forced(answer))
    assert again.usage.input_tokens == second.usage.input_tokens


def test_auto_and_named_tool_calls_whole_and_streamed(oai: Any) -> None:
    written = 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    auto = _create(oai, input=QUESTION, tools=TOOLS, extra_body=_forced(written))
    assert [item.type for item in auto.output] == ["message", "function_call"]
    assert auto.output_text == "Let me look." and json.loads(_call(auto).arguments) == {"city": "Rome"}
    events, final = _streamed(oai, input=QUESTION, tools=TOOLS, extra_body=_forced(written))
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert json.loads(_call(final).arguments) == {"city": "Rome"}
    named = {"type": "function", "name": "get_weather"}
    events, final = _streamed(oai, input=QUESTION, tools=TOOLS, tool_choice=named, max_output_tokens=300,
                             extra_body={"seed": 2})
    assert [item.type for item in final.output] == ["function_call"]  # no message: the output is the call
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(pieces) > 1 and "".join(pieces) == done.arguments == _call(final).arguments


# ---- reasoning ----------------------------------------------------------------------------------------------
def test_reasoning_items_whole_and_streamed(oai: Any) -> None:
    forced = "<think>Two and two.</think>Four."
    whole = _create(oai, input="2+2?", extra_body=_forced(forced))
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "Two and two.")]
    assert message.type == "message" and whole.output_text == "Four."
    events, final = _streamed(oai, input="2+2?", extra_body=_forced(forced))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Two and two."
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == "Four."
    first_text = next(i for i, e in enumerate(events) if e.type == "response.output_text.delta")
    reasoning_done = next(i for i, e in enumerate(events) if e.type == "response.output_item.done")
    assert reasoning_done < first_text  # the reasoning item closes when the answer starts


# ---- the store and errors -----------------------------------------------------------------------------------
def test_retrieve_delete_and_store_false(oai: Any, http: httpx.Client) -> None:
    resp = _create(oai, input="Hi", extra_body=_forced("Hello."))
    assert oai.responses.retrieve(resp.id).output_text == "Hello."
    assert http.get(f"/v1/responses/{resp.id}").json() == resp.model_dump(mode="json", exclude_unset=True)
    assert http.delete(f"/v1/responses/{resp.id}").json() == {"id": resp.id, "object": "response", "deleted": True}
    for gone in (lambda: oai.responses.retrieve(resp.id), lambda: oai.responses.delete(resp.id)):
        with pytest.raises(openai.NotFoundError):
            gone()
    unstored = _create(oai, input="Hi", store=False, extra_body=_forced("Hello."))
    with pytest.raises(openai.NotFoundError) as err:
        _create(oai, input="and?", previous_response_id=unstored.id)
    assert err.value.body["param"] == "previous_response_id" and err.value.body["code"] == "previous_response_not_found"


REFUSED = [  # (body beyond the model, the param named, a word of the message)
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "reasoning.encrypted_content"),
    ({"input": "x", "truncation": "auto"}, "truncation", "truncation"),
    ({"input": "x", "use_beam_search": True}, "use_beam_search", "use_beam_search"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning", "summar"),
    ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens is too large"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nonsense"}}}},
     "text.format.schema", "text.format.schema"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"input": "x", "tools": [{**TOOLS[0], "parameters": {"type": "object", "properties": {"a": {"type": "nah"}}}}],
      "tool_choice": "required"}, "tools[0].parameters", "tools[0].parameters"),
]


@pytest.mark.parametrize("body,param,word", REFUSED)
def test_unsupported_and_bad_fields_are_400s_naming_them(http: httpx.Client, body: dict[str, Any], param: str | None,
                                                         word: str) -> None:
    resp = http.post("/v1/responses", json={"model": MODEL_NAME, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and word in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_errors_through_the_client(oai: Any) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        _create(oai, input="x", previous_response_id="resp_unknown")
    assert "resp_unknown" in missing.value.message
    with pytest.raises(openai.BadRequestError) as builtin:
        _create(oai, input="x", tools=[{"type": "web_search"}])
    assert builtin.value.body["param"] == "tools"
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(input="x", model="gpt-5")


def test_key_and_body_cap_guard_the_route(tiny_model: Path) -> None:
    """The route sits behind the app's middlewares, as chat does: the API key, then the body cap."""
    keyed = LiveServer(tiny_model, api_key="sesame", max_request_bytes=4096)
    try:
        url = keyed.base_url + "/v1/responses"
        assert httpx.post(url, json={"input": "hi"}, timeout=30).status_code == 401
        headers = {"Authorization": "Bearer sesame"}
        assert httpx.post(url, json={"input": "x" * 5000}, headers=headers, timeout=30).status_code == 413
        good = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="sesame", max_retries=0, timeout=60)
        resp = good.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2)
        assert resp.usage.output_tokens <= 2 and good.responses.retrieve(resp.id).id == resp.id
    finally:
        keyed.stop()


def test_renamed_params() -> None:
    cases = {"messages": "input", "messages[3].tool_calls[0].function.arguments": "input",
             "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
             "response_format.json_schema.schema": "text.format.schema", "tools[2].function.parameters":
             "tools[2].parameters", "reasoning_effort": "reasoning.effort", "seed": "seed"}
    for chat, responses in cases.items():
        exc = renamed(APIError(400, f"{chat}: why", chat))
        assert (exc.param, exc.message) == (responses, f"{responses}: why")


def test_store_evicts_least_recently_used_by_count_and_size() -> None:
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for name in "abc":
        assert store.put({"id": name}, [{"role": "user", "content": name}])
        if name == "b":
            assert store.get("a") is not None  # a is now the most recently used
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert not store.put({"id": "huge"}, [{"role": "user", "content": "x" * 20_000}])  # alone over the bound
    store.put({"id": "big"}, [{"role": "user", "content": "x" * 9_900}])  # both others must go
    assert len(store) == 1 and store.get("big") is not None and store.bytes <= store.max_bytes
    assert store.delete("big") and store.bytes == 0 and not store.delete("big")


# ---- the agents SDK -----------------------------------------------------------------------------------------
class Forecast(BaseModel):
    sky: Literal["sunny", "rainy"]


def test_an_agent_runs_a_function_tool(live: LiveServer) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return "sunny"

    async def run(streamed: bool) -> Any:
        client = openai.AsyncOpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = OpenAIResponsesModel(model=MODEL_NAME, openai_client=client)
        # first turn: one call is required; then the SDK resets tool_choice and the typed answer comes (text.format).
        # Each turn's grammar bounds its output (whitespace runs included) well within max_tokens, whatever the draws.
        settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=300)
        agent = Agent(name="forecaster", instructions="Use the tool, then answer.", tools=[get_weather], model=model,
                      output_type=Forecast, model_settings=settings)
        if not streamed:
            return await Runner.run(agent, QUESTION, max_turns=4)
        result = Runner.run_streamed(agent, QUESTION, max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    for streamed in (False, True):
        result = asyncio.run(run(streamed))
        assert len(asked) == 1 and asked.pop() in ("Paris", "Rome")
        assert isinstance(result.final_output, Forecast)
        kinds = [item.type for item in result.new_items]
        assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
