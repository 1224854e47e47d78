"""``--reasoning-parser``: a chat choice's reasoning (``message.reasoning_content``, streamed as
``delta.reasoning_content``) apart from its answer (``content``), as vLLM serves them.

The parsers themselves are ``minfer.reasoning``'s (shared with the offline ``LLM.chat``); this module is the
server's side: the flag's check at start, and the per-choice split a chat response runs before anything else
reads the text, so that the tool-call parser sees the content only and a ``<tool_call>`` the model wrote while
thinking stays reasoning (a tool-call parser that reads special-token markers, ``gpt_oss``, reads the choice's own
text instead: harmony's headers say which message is a call).
"""
from __future__ import annotations

from minfer.reasoning import REASONING_PARSERS, ReasoningParser, parse_whole, reasoning_parser_class


def check_reasoning_flag(reasoning_parser: str | None) -> None:
    """At start (before the model loads): a parser that exists, in one line naming the choices."""
    if reasoning_parser is not None:
        reasoning_parser_class(reasoning_parser, "--reasoning-parser")


def needs_special_tokens(reasoning_parser: str | None) -> bool:
    """Whether the parser reads special-token markers (``gpt_oss``): its choices are decoded with them kept."""
    return reasoning_parser is not None and REASONING_PARSERS[reasoning_parser].needs_special_tokens


def split_whole(reasoning_parser: str | None, text: str) -> tuple[str | None, str]:
    """A whole choice's (reasoning, content text): without a parser, (None, the text). Content that is empty
    comes back as "" (the message's own rule decides whether that is null)."""
    if reasoning_parser is None:
        return None, text
    reasoning, content = parse_whole(REASONING_PARSERS[reasoning_parser](), text)
    return reasoning, content or ""


class StreamSplitter:
    """A stream's per-choice parsers (None: no reasoning parser, every delta is content)."""

    def __init__(self, reasoning_parser: str | None) -> None:
        self._make = REASONING_PARSERS[reasoning_parser] if reasoning_parser is not None else None
        self._parsers: dict[int, ReasoningParser] = {}

    @property
    def active(self) -> bool:
        return self._make is not None

    def split(self, index: int, text: str, last: bool) -> tuple[str, str]:
        """(reasoning, content) of choice ``index``'s next delta; ``last``: the choice finishes with it, so
        whatever was held back (a partial tag) is released too."""
        if self._make is None:
            return "", text
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self._make()
        reasoning, content = parser.feed(text)
        if last:
            more_reasoning, more_content = parser.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content
