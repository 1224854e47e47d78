"""gpt-oss's chat format (OpenAI's "harmony"), read out of a completion's text. A leaf module: the reasoning
parser (``minfer.reasoning``, ``gpt_oss``) and the server's tool-call parser (``gpt_oss``) share it.

A completion is a run of messages, each a header and a body between special-token markers::

    <|channel|>analysis<|message|>User asks 2+2.<|end|><|start|>assistant<|channel|>final<|message|>4.<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>

The generation prompt ends with ``<|start|>assistant``, so the output opens inside the first header. A header
names the author (after ``<|start|>``), the channel (``analysis``: the chain of thought; ``final``: the answer;
``commentary``: a preamble the user may see, or a function call), the recipient of a call (``to=functions.NAME``,
before or after the channel) and the arguments' type (``<|constrain|>json`` or a bare ``json``, ignored here:
arguments are read as JSON). ``<|end|>`` ends a message; ``<|return|>`` and ``<|call|>`` end the output (they
are EOS tokens, so the text usually stops before them).

The markers are special tokens: the text read here is decoded with them kept (``skip_special_tokens=False``;
a parser that reads them says so with ``needs_special_tokens``). ``HarmonyScanner`` takes that text as it
arrives (``feed`` per delta, then ``finish``) and gives back each message's body as ``Piece``s tagged with the
message's index and ``Route``; headers and markers never come out, and a delta that ends in part of a marker
(``<|en``) holds it back until the next delta tells. An output that does not open with a header (a grammar
forced it from the first token, or the model does not speak harmony) is one content message, as written.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, CONSTRAIN, MESSAGE, END, RETURN, CALL)
_STOPS = (END, RETURN, CALL)
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_LONGEST = max(map(len, MARKERS))
_OPENINGS = MARKERS + ("to=",)  # what an output in harmony starts with (after whitespace)
FUNCTIONS = "functions."  # the namespace of the request's tools


@dataclass(frozen=True, slots=True)
class Route:
    """Where a message's body goes: ``reasoning`` (the analysis channel, and messages to a built-in tool),
    ``content`` (the final channel, a commentary preamble), ``call`` (addressed to ``functions.NAME``:
    ``function`` is NAME) or ``none`` (a message written as another author)."""

    kind: str
    function: str | None = None


CONTENT, REASONING, NONE = Route("content"), Route("reasoning"), Route("none")


class Piece(NamedTuple):
    """Body text of message ``index``; ``end``: the message is over (its text, if any, is the last)."""

    index: int
    route: Route
    text: str
    end: bool = False


def route_of(header: str, has_author: bool) -> Route:
    """The route of a message from its header text (markers included; ``has_author``: it followed ``<|start|>``,
    so it opens with the author, else the author is the assistant)."""
    if has_author:
        author = re.match(r"\s*([^\s<]*)", header)
        assert author is not None
        if author.group(1) not in ("assistant", ""):
            return NONE  # a tool's answer or another role: not the model's own message
        header = header[author.end():]
    recipient = re.search(r"(?:^|\s|>)to=([^\s<]+)", header)
    target = recipient.group(1) if recipient else None
    if target is not None and target.startswith(FUNCTIONS):
        return Route("call", target[len(FUNCTIONS):])
    if target is not None and target != "assistant":
        return REASONING  # a built-in tool (python, browser.*): the model's own business
    channel = re.search(re.escape(CHANNEL) + r"\s*([^\s<]*)", header)
    return REASONING if channel is not None and channel.group(1) == "analysis" else CONTENT


def _partial_marker(text: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of a marker (held back)."""
    for i in range(max(0, len(text) - _LONGEST + 1), len(text)):
        tail = text[i:]
        if tail.startswith("<") and any(m.startswith(tail) for m in MARKERS):
            return len(text) - i
    return 0


class HarmonyScanner:
    """One completion's messages, read incrementally. States: ``head`` (harmony or not is undecided: only
    whitespace or the start of an opening so far), ``plain`` (no harmony: all content), ``header`` (collecting a
    header; text outside any message is header text too, and a header never finished is dropped) and ``body``."""

    def __init__(self) -> None:
        self._state = "head"
        self._buf = ""  # head: the output so far; header: the header so far; body: a held-back partial marker
        self._scanned = 0  # header: how far the buffer has been searched for markers
        self._has_author = False
        self._route = CONTENT
        self.index = -1  # the message being read

    def feed(self, text: str) -> list[Piece]:
        if self._state == "plain":
            return [Piece(0, CONTENT, text)] if text else []
        self._buf += text
        if self._state == "head":
            head = self._buf.lstrip()
            if not any(head.startswith(o) for o in _OPENINGS):
                if not head or any(o.startswith(head) for o in _OPENINGS):
                    return []  # whitespace or part of an opening: wait
                self._state, self.index, text, self._buf = "plain", 0, self._buf, ""
                return [Piece(0, CONTENT, text)]
            self._state = "header"
        return self._scan()

    def finish(self) -> list[Piece]:
        """What the end of the output releases: a held-back partial marker (it was text), and the end of the
        message it ends inside (a header cut short is dropped)."""
        text, self._buf = self._buf, ""
        if self._state == "head":
            self._state, self.index = "plain", 0
            return [Piece(0, CONTENT, text, True)]
        if self._state == "plain":
            return [Piece(0, CONTENT, "", True)]
        if self._state == "body":
            self._state = "header"
            return [Piece(self.index, self._route, text, True)]
        return []

    def _scan(self) -> list[Piece]:
        out: list[Piece] = []
        while True:
            if self._state == "header":
                m = _MARKER.search(self._buf, self._scanned)
                if m is None:
                    self._scanned = max(0, len(self._buf) - _LONGEST + 1)
                    return out
                marker = m.group()
                if marker == MESSAGE:
                    self.index += 1
                    self._route = route_of(self._buf[:m.start()], self._has_author)
                    self._state, self._buf = "body", self._buf[m.end():]
                elif marker == START or marker in _STOPS:  # a new header (the old one, if any, was junk)
                    self._has_author, self._buf, self._scanned = marker == START, self._buf[m.end():], 0
                else:  # <|channel|>, <|constrain|>: part of the header
                    self._scanned = m.end()
                continue
            m = _MARKER.search(self._buf)
            if m is None:
                keep = _partial_marker(self._buf)
                text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                if text:
                    out.append(Piece(self.index, self._route, text))
                return out
            marker, text, rest = m.group(), self._buf[:m.start()], self._buf[m.end():]
            if marker in (MESSAGE, CONSTRAIN):  # out of place in a body: dropped, never shown
                if text:
                    out.append(Piece(self.index, self._route, text))
                self._buf = rest
                continue
            out.append(Piece(self.index, self._route, text, True))
            # a stop or <|start|> ends the message; <|channel|> ends it and opens the next header
            self._state, self._scanned, self._has_author = "header", 0, marker == START
            self._buf = CHANNEL + rest if marker == CHANNEL else rest


class Joined:
    """One output field (reasoning, content) across messages: a later message's text starts on a new line
    (vLLM joins a whole response's messages with a newline; here a stream does too)."""

    def __init__(self) -> None:
        self._last: int | None = None  # the message that wrote last

    def add(self, index: int, text: str) -> str:
        if not text:
            return ""
        if self._last is not None and self._last != index:
            text = "\n" + text
        self._last = index
        return text
