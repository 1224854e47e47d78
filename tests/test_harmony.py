"""gpt-oss's harmony format read out of a completion's text (``minfer.harmony``), through the ``gpt_oss`` reasoning
parser and the ``gpt_oss`` tool-call parser: whole, streamed at every split point (the markers' insides included)
and a character at a time, the results equal; no marker ever comes out. Then the real gpt-oss chat template
(``tests/templates/gpt-oss.jinja``) renders with tools, a tool-call history and its template variables."""
from __future__ import annotations

import json
from typing import Any

import pytest

from harmony_fixtures import gpt_oss_template
from minfer.harmony import MARKERS, HarmonyScanner, Route, route_of
from minfer.reasoning import REASONING_PARSERS, GptOssReasoningParser, parse_whole
from minfer.server.tool_parsers import TOOL_PARSERS, GptOssParser, check_tool_flags
from minfer.server.tool_parsers import parse_whole as parse_tools

A, F = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"
NEXT = "<|end|><|start|>assistant"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
TOOLS = ["get_weather", "get_time"]

Split = tuple[str | None, str | None]
Calls = tuple[str | None, list[tuple[str, Any]]]

# (output text, (reasoning, content) of the reasoning parser, (content, calls) of the tool parser)
CASES: list[tuple[str, Split, Calls]] = [
    (f"{A}User asks 2+2. Simple.<|end|>{F}2 + 2 = 4.<|return|>", ("User asks 2+2. Simple.", "2 + 2 = 4."),
     ("2 + 2 = 4.", [])),
    (f"{A}Think.{NEXT}<|channel|>final<|message|>Answer.", ("Think.", "Answer."), ("Answer.", [])),  # EOS not in text
    (f"{A}Need the weather.<|end|>{CALL}<|call|>", ("Need the weather.", None),
     (None, [("get_weather", {"city": "Paris"})])),
    (' to=functions.get_time<|channel|>commentary json<|message|>{"tz": 3}', (None, None),  # recipient first
     (None, [("get_time", {"tz": 3})])),
    (f"{A}Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
     f"{CALL}<|call|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{{}}<|call|>",
     ("Plan.", "Checking both."), ("Checking both.", [("get_weather", {"city": "Paris"}), ("get_time", {})])),
    (f"{A}One.<|end|>{A}Two.<|end|>{F}Yes.<|end|><|start|>assistant<|channel|>final<|message|>More.",
     ("One.\nTwo.", "Yes.\nMore."), ("Yes.\nMore.", [])),  # messages of one field join on a new line
    ("A plain answer, no harmony.", (None, "A plain answer, no harmony."), ("A plain answer, no harmony.", [])),
    ("  \n", (None, "  \n"), ("  \n", [])),
    (f"{A}cut by max_tokens while thin", ("cut by max_tokens while thin", None), (None, [])),
    (f"{A}Done.{NEXT}<|channel|>fin", ("Done.", None), (None, [])),  # cut inside a header: dropped
    (f"{A}x.<|end|>{CALL[:-5]}", ("x.", None), ('{"city":"Pa', [])),  # a call cut short: its text as content
    (f"{A}Oops.<|end|><|start|>assistant<|channel|>commentary to=functions.rm_rf json<|message|>{{}}<|call|>",
     ("Oops.", None), ("{}", [])),  # a function not in tools: content
    ('<|channel|>commentary to=functions.get_time json<|message|>[1, 2]<|call|>', (None, None), ("[1, 2]", [])),
    (f"{A}Run code.<|end|><|start|>assistant<|channel|>analysis to=python code<|message|>print(1)<|call|>",
     ("Run code.\nprint(1)", None), (None, [])),  # a built-in tool's call is reasoning
    (f"{F}a <| b <|en d|> <|constrain|>c<|message|>", (None, "a <| b <|en d|> c"), ("a <| b <|en d|> c", [])),
    (f"{A}é ∑ 😀<|end|>{F}ünïcode", ("é ∑ 😀", "ünïcode"), ("ünïcode", [])),
    (f"{A}t.<|end|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"sunny\"<|end|>"
     f"{F}ok", ("t.", "ok"), ("ok", [])),  # a tool's answer the model wrote itself: nobody's
    ("", (None, None), (None, [])),
]


def _stream_reasoning(pieces: list[str]) -> Split:
    parser, reasoning, content = GptOssReasoningParser(), "", ""
    for r, c in [parser.feed(p) for p in pieces] + [parser.finish()]:
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


def _stream_tools(pieces: list[str]) -> Calls:
    parser, content, calls = GptOssParser(TOOLS), "", []
    for text, deltas in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += text
        for d in deltas:
            assert d["index"] == len(calls) and d["id"].startswith("call_") and d["type"] == "function"
            calls.append((d["function"]["name"], json.loads(d["function"]["arguments"])))
    return content or None, calls


def _whole_tools(text: str) -> Calls:
    content, calls = parse_tools(GptOssParser(TOOLS), text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text,split,calls", CASES)
def test_whole_and_every_split(text: str, split: Split, calls: Calls) -> None:
    assert parse_whole(GptOssReasoningParser(), text) == split
    assert _whole_tools(text) == calls
    for i in range(len(text) + 1):  # every split point, the markers' insides included
        assert _stream_reasoning([text[:i], text[i:]]) == split, i
        assert _stream_tools([text[:i], text[i:]]) == calls, i
    assert _stream_reasoning(list(text)) == split  # a character at a time
    assert _stream_tools(list(text)) == calls
    for part in [*split, calls[0]]:
        assert not any(m in (part or "") for m in MARKERS)


def test_a_marker_split_across_deltas_is_held_back() -> None:
    p = GptOssReasoningParser()
    assert p.feed("<|chan") == ("", "")
    assert p.feed("nel|>analysis<|mess") == ("", "")
    assert p.feed("age|>Hmm <|e") == ("Hmm ", "")
    assert p.feed("nd|><|start|>assistant<|channel|>final<|message|>4 <") == ("", "4 ")
    assert p.feed("| b") == ("", "<| b")  # not a marker after all: text
    assert p.finish() == ("", "")


def test_a_call_is_sent_when_its_message_ends() -> None:
    p = GptOssParser(TOOLS)
    assert p.feed(f"{A}Need it.<|end|>{CALL}") == ("", [])  # the arguments may still grow
    content, calls = p.feed("<|call|>")
    assert content == "" and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("get_weather", '{"city":"Paris"}')]  # the arguments as the model wrote them
    assert p.finish() == ("", []) and len(p.calls) == 1


def test_routes() -> None:
    assert route_of("<|channel|>analysis", False) == Route("reasoning")
    assert route_of("assistant<|channel|>final", True) == Route("content")
    assert route_of("assistant<|channel|>commentary", True) == Route("content")  # a preamble
    assert route_of("assistant to=functions.f<|channel|>commentary json", True) == Route("call", "f")
    assert route_of("<|channel|>analysis to=functions.f <|constrain|>json", False) == Route("call", "f")
    assert route_of("assistant<|channel|>analysis to=browser.search", True) == Route("reasoning")
    assert route_of("functions.f to=assistant<|channel|>commentary", True) == Route("none")
    assert route_of("assistant", True) == Route("content")  # no channel: an answer


def test_scanner_pieces_carry_message_indices() -> None:
    s = HarmonyScanner()
    pieces = s.feed(f"{A}a<|end|>{F}b") + s.finish()
    assert [(p.index, p.route.kind, p.text, p.end) for p in pieces] == \
        [(0, "reasoning", "a", True), (1, "content", "b", False), (1, "content", "", True)]


def test_registries_and_flags() -> None:
    assert REASONING_PARSERS["gpt_oss"] is GptOssReasoningParser and GptOssReasoningParser.needs_special_tokens
    assert TOOL_PARSERS["gpt_oss"] is GptOssParser and GptOssParser.needs_special_tokens
    assert not any(p.needs_special_tokens for n, p in REASONING_PARSERS.items() if n != "gpt_oss")
    assert not any(p.needs_special_tokens for n, p in TOOL_PARSERS.items() if n != "gpt_oss")
    check_tool_flags(True, "gpt_oss")


# ---- the real chat template -----------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "required": ["city"], "properties": {
                                                "city": {"type": "string", "description": "The city."},
                                                "unit": {"type": "string", "enum": ["c", "f"]}}}}}
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
           {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]


def test_the_gpt_oss_template_renders_tools_and_a_call_history(tmp_path: Any) -> None:
    from harmony_fixtures import make_harmony_tokenizer
    from transformers import AutoTokenizer

    make_harmony_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.chat_template == gpt_oss_template()
    text = tok.apply_chat_template(HISTORY, tools=[WEATHER], tokenize=False, add_generation_prompt=True,
                                   reasoning_effort="high", builtin_tools=["python"])
    assert text.startswith("<|start|>system<|message|>You are ChatGPT") and "Reasoning: high\n" in text
    assert "## python\n" in text and "Calls to these tools must go to the commentary channel: 'functions'." in text
    assert "# Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n" \
           "// The weather in a city.\ntype get_weather = (_: {\n// The city.\ncity: string,\nunit?: \"c\" | \"f\",\n" \
           "}) => any;\n\n} // namespace functions<|end|>" in text
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' \
           '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>' \
           '<|start|>assistant' in text and text.endswith("<|start|>assistant")
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and tok.convert_tokens_to_ids("<|call|>") in ids  # the markers are single tokens
