"""Reasoning parsers (``--reasoning-parser``): the parser alone (whole text, every split of a text into two deltas,
tags split across deltas, unterminated reasoning, none at all, deepseek_r1 without an opening tag), then through
the server with the openai client, the tiny random model's output forced by a regex (as the tool-call tests do):
``reasoning_content`` whole and streamed, tool calls read from the content only, and the flag's checks."""
from __future__ import annotations

from typing import Any, Iterator

import pytest

from minfer.cli import main
from minfer.reasoning import (REASONING_PARSERS, DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser,
                              parse_whole, reasoning_parser_class)

from .conftest import MODEL_NAME, LiveServer

Split = tuple[str | None, str | None]

CASES: list[tuple[type[ReasoningParser], str, Split]] = [  # (parser, output, (reasoning, content))
    (Qwen3ReasoningParser, "<think>I should add.</think>\n\n4", ("I should add.", "\n\n4")),
    (Qwen3ReasoningParser, "4, with no thinking", (None, "4, with no thinking")),
    (Qwen3ReasoningParser, "<think>cut off while thin", ("cut off while thin", None)),
    (Qwen3ReasoningParser, "\n<think>a < b </thin k</think>x</think>y", ("a < b </thin k", "x</think>y")),
    (Qwen3ReasoningParser, "an answer that says <think> later", (None, "an answer that says <think> later")),
    (Qwen3ReasoningParser, "<think></think>only the answer", (None, "only the answer")),
    (Qwen3ReasoningParser, "<thin", (None, "<thin")),
    (Qwen3ReasoningParser, "", (None, None)),
    (DeepSeekR1ReasoningParser, "the prompt opened it.</think>The answer.", ("the prompt opened it.", "The answer.")),
    (DeepSeekR1ReasoningParser, "<think>tag written anyway</think>ok", ("tag written anyway", "ok")),
    (DeepSeekR1ReasoningParser, "never closed, cut by max_tokens", ("never closed, cut by max_tokens", None)),
    (DeepSeekR1ReasoningParser, "</think>", (None, None)),
]


def _streamed(make: type[ReasoningParser], pieces: list[str]) -> Split:
    parser, reasoning, content = make(), "", ""
    for r, c in [parser.feed(p) for p in pieces] + [parser.finish()]:
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


@pytest.mark.parametrize("make,text,expected", CASES)
def test_whole_and_every_split_into_two_deltas(make: type[ReasoningParser], text: str, expected: Split) -> None:
    assert parse_whole(make(), text) == expected
    for i in range(len(text) + 1):  # every split point, the tags' insides included
        assert _streamed(make, [text[:i], text[i:]]) == expected, i
    assert _streamed(make, list(text)) == expected  # a character at a time


def test_a_closing_tag_split_across_deltas_is_held_back() -> None:
    p = Qwen3ReasoningParser()
    assert p.feed("<thi") == ("", "")
    assert p.feed("nk>Hmm </thi") == ("Hmm ", "")
    assert p.feed("s is not it</thi") == ("</this is not it", "")
    assert p.feed("nk>\n\nYes") == ("", "\n\nYes")
    assert p.feed(" <think>") == ("", " <think>")  # in the answer, a tag is text
    assert p.finish() == ("", "")


def test_unterminated_reasoning_releases_its_partial_tag_as_reasoning() -> None:
    for make in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser):  # the <think> parsers (gpt_oss: test_harmony.py)
        p = make()
        assert p.feed("<think>still going </thi") == ("still going ", "")
        assert p.finish() == ("</thi", "")


def test_plain_answer_streams_at_once() -> None:
    p = Qwen3ReasoningParser()
    assert p.feed("  ") == ("", "")  # whitespace: the opening tag may still follow
    assert p.feed("Hi") == ("", "  Hi")
    assert p.feed(" there") == ("", " there")
    d = DeepSeekR1ReasoningParser()
    assert d.feed("Hmm") == ("Hmm", "")


def test_registry_names_the_choices() -> None:
    assert set(REASONING_PARSERS) >= {"qwen3", "deepseek_r1"}
    with pytest.raises(ValueError, match=r"--reasoning-parser: 'granite' is not one of qwen3, deepseek_r1"):
        reasoning_parser_class("granite", "--reasoning-parser")


# ---- through the server -------------------------------------------------------------------------------------
openai = pytest.importorskip("openai")
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402

TEMPLATE = ("{% if tools %}<s>system: you may call{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
            "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "user", "content": "What time is it?"}]
CLOCK = {"type": "object", "properties": {"tz": {"type": "integer"}}, "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
THOUGHT = 'I could call <tool_call>{"name": "get_time", "arguments": {"tz": 1}}</tool_call> here.'
CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": 3}}</tool_call>'


def _regex(text: str) -> str:
    """A regex matching exactly ``text`` (the forced output)."""
    return "".join("\\" + ch if ch in r".^$*+?{}[]\|()/" else ch for ch in text)


@pytest.fixture(scope="module")
def reasoning_server(tiny_model: Any) -> Iterator[LiveServer]:
    """The tiny model with ``--reasoning-parser qwen3`` and hermes auto tool choice, through ``LiveServer``'s ``app_args``."""
    live = LiveServer(tiny_model, chat_template=TEMPLATE, app_args=dict(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"))
    yield live
    live.stop()


@pytest.fixture()
def oai(reasoning_server: LiveServer) -> Any:
    return openai.OpenAI(base_url=reasoning_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _chat(oai: Any, forced: str, **kw: Any) -> Any:
    body = {"structured_outputs": {"regex": _regex(forced)}}
    return oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, seed=3, max_tokens=kw.pop("max_tokens", 400),
                                       extra_body=body, **kw)


def _stream_choices(oai: Any, forced: str, **kw: Any) -> tuple[Any, dict[int, str]]:
    """The stream as the openai client accumulates it, and each choice's reasoning joined from its deltas."""
    state, reasoning = ChatCompletionStreamState(), {}
    for chunk in _chat(oai, forced, stream=True, **kw):
        for choice in chunk.choices:
            piece = (choice.delta.model_extra or {}).get("reasoning_content")
            assert piece != ""  # a delta carries reasoning only when there is some
            if piece:
                reasoning[choice.index] = reasoning.get(choice.index, "") + piece
        state.handle_chunk(chunk)
    return state.current_completion_snapshot, reasoning


def _stream(oai: Any, forced: str, **kw: Any) -> tuple[Any, str | None]:
    completion, reasoning = _stream_choices(oai, forced, **kw)
    return completion, reasoning.get(0)


def _reasoning(choice: Any) -> Any:
    return (choice.message.model_extra or {}).get("reasoning_content", "absent")


def test_reasoning_whole_and_streamed(oai: Any) -> None:
    forced = "<think>Two and two.</think>\n\nFour."
    whole = _chat(oai, forced).choices[0]
    assert (_reasoning(whole), whole.message.content, whole.finish_reason) == ("Two and two.", "\n\nFour.", "stop")
    streamed, reasoning = _stream(oai, forced)
    assert (reasoning, streamed.choices[0].message.content) == ("Two and two.", "\n\nFour.")
    plain = _chat(oai, "Four, without thinking.").choices[0]  # qwen3 with thinking disabled
    assert (_reasoning(plain), plain.message.content) == (None, "Four, without thinking.")


def test_each_choice_has_its_own_parser(oai: Any) -> None:
    forced = "<think>Two and two.</think>Four."
    completion, reasoning = _stream_choices(oai, forced, n=3, temperature=1.0)
    assert reasoning == {i: "Two and two." for i in range(3)}
    assert [c.message.content for c in completion.choices] == ["Four."] * 3


def test_unterminated_reasoning_has_no_content(oai: Any) -> None:
    forced = "<think>" + "a" * 200
    whole = _chat(oai, forced, max_tokens=12).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    assert _reasoning(whole) and set(_reasoning(whole)) == {"a"}
    streamed, reasoning = _stream(oai, forced, max_tokens=12)
    assert reasoning == _reasoning(whole) and not streamed.choices[0].message.content


def test_tool_calls_come_from_the_content_only(oai: Any) -> None:
    forced = f"<think>{THOUGHT}</think>\n\nSure. {CALL}"
    for choice, reasoning in [(_chat(oai, forced, tools=TOOLS, tool_choice="auto").choices[0], None),
                              _first(_stream(oai, forced, tools=TOOLS, tool_choice="auto"))]:
        assert (reasoning or _reasoning(choice)) == THOUGHT  # the call written while thinking stays reasoning
        assert choice.message.content == "\n\nSure."  # the hermes parser keeps the leading newlines
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
            [("get_time", '{"tz": 3}')]
        assert choice.finish_reason == "tool_calls"
    only_thought = _chat(oai, f"<think>{THOUGHT}</think>No call.", tools=TOOLS, tool_choice="auto").choices[0]
    assert only_thought.message.tool_calls is None and only_thought.finish_reason == "stop"
    assert (_reasoning(only_thought), only_thought.message.content) == (THOUGHT, "No call.")


def _first(streamed: tuple[Any, str | None]) -> tuple[Any, str | None]:
    return streamed[0].choices[0], streamed[1]


def test_deepseek_r1_and_no_parser(oai: Any, reasoning_server: LiveServer) -> None:
    ctx = reasoning_server.ctx
    try:
        ctx.reasoning_parser = "deepseek_r1"  # as with --reasoning-parser deepseek_r1
        forced = "The prompt opened it.</think>Done."
        whole = _chat(oai, forced).choices[0]
        assert (_reasoning(whole), whole.message.content) == ("The prompt opened it.", "Done.")
        streamed, reasoning = _stream(oai, forced)
        assert (reasoning, streamed.choices[0].message.content) == ("The prompt opened it.", "Done.")
        ctx.reasoning_parser = None  # as without the flag: the text is the content, no reasoning_content key
        forced = "<think>x</think>y"
        whole = _chat(oai, forced).choices[0]
        assert (_reasoning(whole), whole.message.content) == ("absent", forced)
        streamed, reasoning = _stream(oai, forced)
        assert (reasoning, streamed.choices[0].message.content) == (None, forced)
    finally:
        ctx.reasoning_parser = "qwen3"


def test_reasoning_parser_flag(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import minfer.cli.serve as serve_cli
    from minfer.config import EngineConfig
    from minfer.server.run import run_server

    seen: dict[str, Any] = {}
    monkeypatch.setattr(serve_cli, "run_server", lambda model, engine_kwargs, **kw: seen.update(kw))
    assert main(["serve", "m", "--reasoning-parser", "deepseek_r1"]) == 0 and seen["reasoning_parser"] == "deepseek_r1"
    assert main(["serve", "m"]) == 0 and seen["reasoning_parser"] is None
    with pytest.raises(SystemExit):
        main(["serve", "m", "--reasoning-parser", "granite"])
    assert "qwen3" in capsys.readouterr().err
    monkeypatch.setattr(EngineConfig, "from_kwargs", lambda **kw: pytest.fail("the model began to load"))
    with pytest.raises(ValueError, match="--reasoning-parser: 'granite' is not one of qwen3, deepseek_r1"):
        run_server("m", {}, reasoning_parser="granite")  # the benchmark's --launch path: checked before loading
