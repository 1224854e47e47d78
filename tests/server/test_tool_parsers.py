"""The tool-call parsers on their own: calls, several calls, content around them, malformed JSON left as
content, and the same result whether the text arrives whole or a few characters at a time (a stream)."""
from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from minfer.server.tool_parsers import (HermesParser, Llama3JsonParser, NamedParser, RequiredParser, ToolParser,
                                        check_tool_flags, parse_whole)

Make = Callable[[], ToolParser]


def _whole(make: Make, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    content, calls = parse_whole(make(), text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(make: Make, text: str, step: int) -> tuple[str | None, list[tuple[str, Any]]]:
    """Feed ``text`` ``step`` characters at a time and join the deltas as the openai client does."""
    parser, content, calls = make(), "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    for text_delta, deltas in outs:
        content += text_delta
        for d in deltas:
            entry = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            entry["name"] += d.get("function", {}).get("name", "")
            entry["arguments"] += d.get("function", {}).get("arguments", "")
            if "id" in d:
                assert d["id"].startswith("call_") and d["type"] == "function"
    assert len(parser.calls) == len(calls)  # every call begun was sent, under its own index
    return content or None, [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]


def _check(make: Make, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    whole = _whole(make, text)
    for step in (1, 2, 3, 7, len(text) or 1):
        assert _streamed(make, text, step) == whole, step
    return whole


HERMES = [  # (text, content, calls)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}'
     '</tool_call>', None, [("a", {"x": 1}), ("b", {})]),
    ('Let me check.\n\n<tool_call>{"name": "a", "arguments": {"q": "<tool_call>"}}</tool_call>\nDone.',
     "Let me check.\n\nDone.", [("a", {"q": "<tool_call>"})]),
    ('<tool_call>{"name": "a", "arguments": {"x": [1, 2]}}', None, [("a", {"x": [1, 2]})]),  # unclosed at the end
    ('<tool_call>{"name": "a", "parameters": {"k": "v"}}</tool_call>', None, [("a", {"k": "v"})]),
    ('<tool_call>{"name": "a", "arguments": "{\\"k\\": 2}"}</tool_call>', None, [("a", {"k": 2})]),
    ("Just an answer, no tools.\n", "Just an answer, no tools.\n", []),
    ("a < b and <tool but not a call <tool_cal", "a < b and <tool but not a call <tool_cal", []),
    ('<tool_call>{"name": "a", "arguments": {"x": 1</tool_call> after', '<tool_call>{"name": "a", "arguments": '
     '{"x": 1</tool_call> after', []),  # malformed JSON: content, tags and all
    ('<tool_call>["not", "a", "call"]</tool_call>', '<tool_call>["not", "a", "call"]</tool_call>', []),
    ('ok <tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{bad}</tool_call>',
     'ok <tool_call>{bad}</tool_call>', [("a", {})]),
    ('<tool_call>{"name": "a", "arguments": {"x": 1', '<tool_call>{"name": "a", "arguments": {"x": 1', []),
]


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_hermes(text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    assert _check(HermesParser, text) == (content, calls)


def test_hermes_holds_back_only_a_partial_tag() -> None:
    p = HermesParser()
    assert p.feed("Hello <tool") == ("Hello", [])  # the space waits for what follows
    assert p.feed("s are fun") == (" <tools are fun", [])
    assert p.feed(" <tool_ca") == ("", [])
    content, calls = p.feed('ll>{"name": "f", "arguments": {}}</tool_call>')
    assert content == "" and calls[0]["function"] == {"name": "f", "arguments": "{}"} and calls[0]["index"] == 0
    assert p.finish() == ("", [])


LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', None, [("get_weather", {"city": "Rome"})]),
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}', None, [("a", {"x": 1})]),
    ('  {"name": "a", "parameters": {}}; {"name": "b", "arguments": {"y": "z"}}\n', None,
     [("a", {}), ("b", {"y": "z"})]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "a", "parameters": {"x": 1}', '{"name": "a", "parameters": {"x": 1}', []),  # malformed
    ('{"name": "a", "parameters": {}} and then prose', '{"name": "a", "parameters": {}} and then prose', []),
    ('{"not_a_call": 1}', '{"not_a_call": 1}', []),
    ("<|python_ta", "<|python_ta", []),
    ("", None, []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA3)
def test_llama3_json(text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    assert _check(Llama3JsonParser, text) == (content, calls)


def test_llama3_json_streams_plain_content_at_once() -> None:
    p = Llama3JsonParser()
    assert p.feed("  ") == ("", [])
    assert p.feed("Hi") == ("  Hi", [])
    assert p.feed(" there") == (" there", [])


def test_required_array() -> None:
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"s": "}"}}]'
    assert _check(RequiredParser, text) == (None, [("a", {"x": 1}), ("b", {"s": "}"})])
    p = RequiredParser()
    assert p.feed('[{"name": "a", "parameters": {"x": 1}') == ("", [])
    _, calls = p.feed("}, ")  # the first call is out as soon as its object closes
    assert [c["function"]["name"] for c in calls] == ["a"]
    assert _check(RequiredParser, '[{"name": "a", "param') == ('[{"name": "a", "param', [])  # cut: content
    assert _check(RequiredParser, '[{"name": "a", "parameters": {}}, {"na') == (None, [("a", {})])


def test_named_streams_arguments() -> None:
    make = lambda: NamedParser("f")  # noqa: E731
    assert _check(make, '{"x": [1, 2], "y": "z"}') == (None, [("f", {"x": [1, 2], "y": "z"})])
    p = make()
    first = p.feed('{"x"')[1]
    assert first[0]["function"] == {"name": "f", "arguments": '{"x"'} and first[0]["id"].startswith("call_")
    assert p.feed(": 1}") == ("", [{"index": 0, "function": {"arguments": ": 1}"}}])
    assert p.finish() == ("", []) and [c.name for c in p.calls] == ["f"]
    content, calls = parse_whole(make(), '{"x": 1}')  # not streamed: the one call has all the arguments
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]
    empty = make()
    assert empty.finish()[1][0]["function"] == {"name": "f", "arguments": ""}


def test_call_ids_are_unique() -> None:
    _, calls = parse_whole(HermesParser(), '<tool_call>{"name": "a"}</tool_call>' * 3)
    assert len({c.id for c in calls}) == 3 and all(len(c.id) == 29 for c in calls)
    assert [c.arguments for c in calls] == ["{}"] * 3


def test_tool_flags() -> None:
    check_tool_flags(True, "hermes")
    check_tool_flags(False, None)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        check_tool_flags(True, None)
    with pytest.raises(ValueError, match="mistral"):
        check_tool_flags(False, "mistral")


def test_required_schema_hoists_each_tools_defs() -> None:
    """pydantic-style tools reference ``#/$defs/...``: in the combined array schema those must resolve, and
    outputs valid for a tool validate against it."""
    import jsonschema

    from minfer.server.errors import APIError
    from minfer.server.protocol import ChatTool
    from minfer.server.tools import required_schema
    from minfer.structured_outputs import StructuredOutputsParams

    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tool = ChatTool.model_validate({"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}}, "required": ["to"],
        "$defs": {"Point": point}}}})
    plain = ChatTool.model_validate({"type": "function", "function": {"name": "stop"}})
    schema = required_schema([tool, plain], parallel=True)
    StructuredOutputsParams(json=schema)  # compiles: the reference resolves at the root
    jsonschema.validate([{"name": "move", "parameters": {"to": {"x": 3}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "move", "parameters": {"to": {"y": 3}}}], schema)
    clash = ChatTool.model_validate({"type": "function", "function": {"name": "jump", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "$defs": {"Point": {"type": "string"}}}}})
    with pytest.raises(APIError):
        required_schema([tool, clash], parallel=True)


DEEP = "[" * 3000 + "]" * 3000  # JSON nested past Python's stack: RecursionError, not ValueError, from json
UNDISPATCHABLE = [  # (text, content, calls) with tools ["a"]: calls a client cannot dispatch stay content
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', '<tool_call>{"name": "rm_rf", "arguments": {}}'
     '</tool_call>', []),
    ('<tool_call>{"name": "a", "arguments": "not json"}</tool_call>', '<tool_call>{"name": "a", "arguments": '
     '"not json"}</tool_call>', []),
    ('<tool_call>{"name": "a", "arguments": "[1, 2]"}</tool_call>', '<tool_call>{"name": "a", "arguments": '
     '"[1, 2]"}</tool_call>', []),  # JSON, but no object: no keyword arguments
    ('x <tool_call>{"name": "b", "arguments": {}}</tool_call> <tool_call>{"name": "a", "arguments": {"k": 1}}'
     '</tool_call>', 'x <tool_call>{"name": "b", "arguments": {}}</tool_call>', [("a", {"k": 1})]),
    (f'<tool_call>{{"name": "a", "arguments": {DEEP}}}</tool_call>',
     f'<tool_call>{{"name": "a", "arguments": {DEEP}}}</tool_call>', []),
]


@pytest.mark.parametrize("text,content,calls", UNDISPATCHABLE)
def test_hermes_returns_undispatchable_calls_as_content(text: str, content: str | None,
                                                        calls: list[tuple[str, Any]]) -> None:
    assert _check(lambda: HermesParser(["a"]), text) == (content, calls)


def test_llama3_json_returns_undispatchable_calls_as_content() -> None:
    for text in ('{"name": "b", "parameters": {}}', '{"name": "a", "parameters": "nope"}', DEEP,
                 '{"name": "a", "parameters": ' + DEEP + '}'):
        assert _check(lambda: Llama3JsonParser(["a"]), text) == (text, []), text[:40]
    assert _check(lambda: Llama3JsonParser(["a"]), '{"name": "a", "parameters": {"x": 1}}') == (None, [("a", {"x": 1})])


def test_required_output_nested_past_the_stack_is_no_call() -> None:
    text = '[{"name": "a", "parameters": ' + DEEP + '}]'
    assert _check(RequiredParser, text) == (text, [])
