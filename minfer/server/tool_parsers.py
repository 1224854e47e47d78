"""Tool calls out of a chat choice's text, fed incrementally: the same parser object serves a stream (one
``feed`` per delta) and a whole response (one ``feed``, then ``finish``), so the streamed deltas join to
exactly the non-streamed message by construction.

A parser returns, per call, the new content text and the new ``delta.tool_calls`` entries in OpenAI's
wire shape. Four kinds:

- ``hermes`` (Qwen, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; the text
  around them is content (a partial ``<tool_call`` at the end of the text so far is held back; whitespace
  is held until more content follows, so a call's surrounding whitespace does not leave content behind
  on its own); a block whose JSON is not a call stays content, tags and all.

Only a call a client can dispatch is a call: to a function of the request's ``tools`` (the auto parsers
are given their names), with arguments that are a JSON object (or left out). Anything else (a made-up
function, arguments that are no JSON or no object, JSON nested past Python's stack) stays content, as
in vLLM.
- ``llama3_json`` (Llama 3.x): the whole message is ``{"name": ..., "parameters": {...}}``, or several
  separated by ``;``, optionally after ``<|python_tag|>``; anything else is content. Emitted at the end.
- ``RequiredParser``: the output of ``tool_choice="required"``, a JSON array of ``{"name", "parameters"}``
  (constrained by its schema); each call is emitted as soon as its object is complete.
- ``NamedParser``: ``tool_choice`` naming one function; the whole output is that call's arguments,
  streamed as they are generated.
- ``gpt_oss`` (gpt-oss): harmony messages (``minfer.harmony``) addressed ``to=functions.NAME`` are calls, each
  emitted when its message ends (``<|call|>``, or the end of the output); final and commentary-preamble text is
  the content (a later message on a new line), the analysis channel is not (the reasoning parser's). The routing
  is in the headers, so this parser reads the choice's own text with its special-token markers kept
  (``needs_special_tokens``), not what a reasoning parser left of it.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

from minfer.harmony import HarmonyScanner, Joined, Piece

ToolDelta = dict[str, Any]  # one entry of a chunk's delta.tool_calls


def call_id() -> str:
    """OpenAI's shape of a tool-call id: ``call_`` and 24 random characters."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=call_id)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser:
    """The state of one choice: ``calls`` holds the calls begun so far (a ``NamedParser``'s one call keeps
    only its first piece of arguments: the rest go out as deltas). ``names``: the functions a call may
    name (None: any, where a grammar has already restricted them)."""

    needs_special_tokens = False  # reads the choice's text with its special-token markers (not the content)

    def __init__(self, names: Iterable[str] | None = None) -> None:
        self.calls: list[ToolCall] = []
        self.names = frozenset(names) if names is not None else None

    def feed(self, text: str) -> tuple[str, list[ToolDelta]]:
        """New content and tool-call deltas after ``text`` (the choice's next piece of output)."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolDelta]]:
        """What the end of the output releases (held-back text, calls that are only complete at the end)."""
        return "", []

    def _emit_call(self, name: str, arguments: str) -> ToolDelta:
        call = ToolCall(name, arguments)
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call.to_dict()}


def parse_whole(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A non-streamed choice: its content (None when empty) and its calls (whole: ``text`` is fed at once)."""
    content, _ = parser.feed(text)
    more, _ = parser.finish()
    return (content + more) or None, parser.calls


def _arguments(value: Any) -> str | None:
    """A call's arguments as JSON text: an object is serialised (non-ASCII kept), a string holding a JSON
    object is taken as the model wrote it, a missing value is ``{}``; anything else is not a call."""
    if value is None:
        return "{}"
    try:
        if isinstance(value, str):
            return value if isinstance(json.loads(value), dict) else None
        if isinstance(value, dict):
            return json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None
    return None


def _as_call(obj: Any, names: frozenset[str] | None, *keys: str) -> tuple[str, str] | None:
    """(name, arguments) of a decoded ``{"name": <one of names>, <one of keys>: ...}``, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = next((obj[k] for k in keys if k in obj), None)
    arguments = _arguments(args)
    return None if arguments is None else (obj["name"], arguments)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag`` (to hold back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesParser(ToolParser):
    """``<tool_call>`` JSON ``</tool_call>`` blocks among content. A block still open at the end is a call
    if its JSON is one (a model may stop right after the object). Whitespace after content is held until
    more content follows (dropped if none does and there were calls), and content right after a call drops
    its leading whitespace: a message of calls alone has no content, and text on both sides of a call
    keeps the whitespace that separated it."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: Iterable[str] | None = None) -> None:
        super().__init__(names)
        self._buf = ""  # outside a block: the held-back tail; inside: the block's text so far
        self._inside = False
        self._scanned = 0  # inside: how far the buffer has been searched for CLOSE
        self._space = ""  # trailing whitespace of the content, not sent yet
        self._after_call = False  # content right after a call drops its leading whitespace

    def feed(self, text: str) -> tuple[str, list[ToolDelta]]:
        self._buf += text
        out, calls = [], []
        while True:
            if not self._inside:
                i = self._buf.find(self.OPEN)
                if i < 0:
                    keep = _partial_suffix(self._buf, self.OPEN)
                    out.append(self._text(self._buf[:len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                out.append(self._text(self._buf[:i]))
                self._buf, self._inside, self._scanned = self._buf[i + len(self.OPEN):], True, 0
            else:
                j = self._buf.find(self.CLOSE, self._scanned)
                if j < 0:
                    self._scanned = max(0, len(self._buf) - len(self.CLOSE) + 1)
                    break
                body, self._buf, self._inside = self._buf[:j], self._buf[j + len(self.CLOSE):], False
                delta = self._block(body, closed=True)
                if isinstance(delta, str):
                    out.append(delta)
                else:
                    calls.append(delta)
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolDelta]]:
        out, calls = [], []
        if self._inside:
            delta = self._block(self._buf, closed=False)
            if isinstance(delta, str):
                out.append(delta)
            else:
                calls.append(delta)
        else:
            out.append(self._text(self._buf))
        self._buf, self._inside = "", False
        if not self.calls and self._space:  # a plain answer keeps its trailing whitespace
            out.append(self._space)
        self._space = ""
        return "".join(out), calls

    def _text(self, text: str) -> str:
        """Content to send now: everything but trailing whitespace, which waits in ``_space``."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        sent, self._space = self._space + body, text[len(body):]
        return sent

    def _block(self, body: str, closed: bool) -> ToolDelta | str:
        """A block's call, or (its JSON is not a call) the block's text as content."""
        try:
            call = _as_call(json.loads(body), self.names, "arguments", "parameters")
        except (ValueError, RecursionError):
            call = None
        if call is not None:
            self._after_call = True
            return self._emit_call(*call)
        return self._text(self.OPEN + body + (self.CLOSE if closed else ""))


class Llama3JsonParser(ToolParser):
    """A message that starts (after whitespace and an optional ``<|python_tag|>``) with ``{`` is held to
    the end and is calls if it decodes as ``;``-separated call objects, content otherwise; any other
    message streams as content from its first characters."""

    TAG = "<|python_tag|>"

    def __init__(self, names: Iterable[str] | None = None) -> None:
        super().__init__(names)
        self._buf = ""
        self._mode: str | None = None  # None: undecided, "content", or "json"

    def feed(self, text: str) -> tuple[str, list[ToolDelta]]:
        if self._mode == "content":
            return text, []
        self._buf += text
        if self._mode is None:
            head = self._buf.lstrip()
            if head.startswith(self.TAG) or head.startswith("{"):
                self._mode = "json"
            elif head and not self.TAG.startswith(head):
                self._mode = "content"
                text, self._buf = self._buf, ""
                return text, []
        return "", []

    def finish(self) -> tuple[str, list[ToolDelta]]:
        text, self._buf = self._buf, ""
        if self._mode == "json":
            found = self._calls(text)
            if found:
                return "", [self._emit_call(*c) for c in found]
        return text, []

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        body = text.strip().removeprefix(self.TAG)
        decoder, pos, found = json.JSONDecoder(), 0, []
        while True:
            while pos < len(body) and body[pos].isspace():
                pos += 1
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):
                return None
            call = _as_call(obj, self.names, "parameters", "arguments")
            if call is None:
                return None
            found.append(call)
            rest = body[pos:].lstrip()
            if not rest:
                return found
            if rest[0] != ";":
                return None
            pos = len(body) - len(rest) + 1


class RequiredParser(ToolParser):
    """A JSON array of ``{"name", "parameters"}`` objects: each is a call once its closing brace has
    arrived (decoding is only tried on a delta holding a ``}``). An output with no complete call (cut
    by ``max_tokens`` early) is content."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._pos = 0  # after the '[' and every decoded element
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> tuple[str, list[ToolDelta]]:
        self._buf += text
        return "", self._drain() if "}" in text else []

    def finish(self) -> tuple[str, list[ToolDelta]]:
        calls = self._drain()
        if not self.calls:
            return self._buf, []
        return "", calls

    def _drain(self) -> list[ToolDelta]:
        buf, calls = self._buf, []
        while True:
            pos = self._pos
            while pos < len(buf) and (buf[pos].isspace() or buf[pos] in ",["):
                pos += 1
            if pos >= len(buf) or buf[pos] != "{":
                return calls
            try:
                obj, self._pos = self._decoder.raw_decode(buf, pos)
            except (ValueError, RecursionError):
                return calls
            call = _as_call(obj, self.names, "parameters", "arguments")
            if call is not None:
                calls.append(self._emit_call(*call))


class NamedParser(ToolParser):
    """The whole output is the arguments of one call to ``name``: its first delta carries the id and the
    name, every later one the next piece of the arguments (not added to ``calls``: a whole response is fed
    at once, so its one call has them all)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> tuple[str, list[ToolDelta]]:
        if not self.calls:
            return "", [self._emit_call(self.name, text)]
        return "", [{"index": 0, "function": {"arguments": text}}] if text else []

    def finish(self) -> tuple[str, list[ToolDelta]]:
        return self.feed("") if not self.calls else ("", [])


class GptOssParser(ToolParser):
    """Harmony messages: calls to ``functions.NAME`` (the arguments are the body, a JSON object; a call a client
    cannot dispatch is its body as content), final and preamble text as content, the rest dropped."""

    needs_special_tokens = True

    def __init__(self, names: Iterable[str] | None = None) -> None:
        super().__init__(names)
        self._scanner = HarmonyScanner()
        self._content = Joined()
        self._body = ""  # the arguments of the call being read

    def feed(self, text: str) -> tuple[str, list[ToolDelta]]:
        return self._read(self._scanner.feed(text))

    def finish(self) -> tuple[str, list[ToolDelta]]:
        return self._read(self._scanner.finish())

    def _read(self, pieces: list[Piece]) -> tuple[str, list[ToolDelta]]:
        out, calls = [], []
        for p in pieces:
            if p.route.kind == "content":
                out.append(self._content.add(p.index, p.text))
            elif p.route.kind == "call":
                self._body += p.text
                if p.end:
                    body, self._body = self._body, ""
                    call = _as_call({"name": p.route.function, "arguments": body.strip() or None}, self.names,
                                    "arguments")
                    if call is not None:
                        calls.append(self._emit_call(*call))
                    else:
                        out.append(self._content.add(p.index, body))
        return "".join(out), calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                             "gpt_oss": GptOssParser}


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """At start: a parser that exists, and one to read the answers whenever auto tool choice is on."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser: {tool_call_parser!r} is not one of {', '.join(TOOL_PARSERS)}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(TOOL_PARSERS)})")
