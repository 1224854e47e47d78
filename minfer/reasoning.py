"""Reasoning out of a choice's text: a reasoning model's ``<think>…</think>`` text apart from its answer (vLLM's
``--reasoning-parser``). A leaf module (over ``minfer.harmony``), so that the offline ``LLM.chat`` and the server
share one parser.

One ``ReasoningParser`` per choice takes the text as it arrives (one ``feed`` per delta, then ``finish``) and
returns (reasoning, content) pieces; a whole response is fed at once (``parse_whole``), so the streamed pieces
join to exactly the whole response by construction, and a tag split across deltas (``</thi`` + ``nk>``) is held
back until it is known. Two conventions, by name:

- ``qwen3``: the model writes both tags, and an output that opens with ``<think>`` (after whitespace) reasons
  until ``</think>``; any other output is all answer (thinking disabled: the template put an empty think block
  in the prompt). A ``<think>`` later in the answer is answer text.
- ``deepseek_r1``: the template opens ``<think>`` in the prompt, so the output starts inside the reasoning (an
  opening tag the model writes anyway is dropped) and only ``</think>`` ends it.

An output that never closes its reasoning (cut by ``max_tokens`` while thinking) is all reasoning and has no
content, as in vLLM. The text after ``</think>`` is the content as written (leading newlines included).

- ``gpt_oss``: gpt-oss's harmony messages (``minfer.harmony``): the analysis channel is the reasoning, the final
  channel and commentary preambles are the content (a later message on a new line), function calls are neither
  (the server's ``gpt_oss`` tool-call parser reads them). Its markers are special tokens, so it reads text
  decoded with them kept (``needs_special_tokens``: the caller decodes the choice with
  ``skip_special_tokens=False``) and no marker reaches either side.
"""
from __future__ import annotations

from minfer.harmony import CHANNEL, MESSAGE, HarmonyScanner, Joined, Piece

START, END = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag`` (held back: it may be the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """The state of one choice: undecided at the head of the output, then in the reasoning, then in the content.
    ``starts_inside``: the prompt opened the reasoning (deepseek_r1), so an output that does not open with
    ``<think>`` is reasoning too, not content."""

    starts_inside = False
    needs_special_tokens = False  # reads special-token markers: the choice is decoded with them kept

    def __init__(self) -> None:
        self._state = "head"  # "head" (undecided), "reasoning" or "content"
        self._buf = ""  # held back: the head so far, or a partial END at the end of the reasoning
        self.thought = False  # whether the output has entered its reasoning

    def feed(self, text: str) -> tuple[str, str]:
        """(new reasoning, new content) after ``text``, the choice's next piece of output."""
        if self._state == "content":
            return "", text
        self._buf += text
        if self._state == "head":
            head = self._buf.lstrip()
            if head.startswith(START):
                self._enter_reasoning(head[len(START):])
            elif not head or START.startswith(head):
                return "", ""  # whitespace or a partial opening tag: wait
            elif self.starts_inside:
                self._enter_reasoning(self._buf)
            else:
                self._state, text, self._buf = "content", self._buf, ""
                return "", text
        return self._reasoning()

    def finish(self) -> tuple[str, str]:
        """What the end of the output releases: held-back text, on the side it was on."""
        text, self._buf = self._buf, ""
        if self._state == "reasoning" or (self._state == "head" and self.starts_inside and text):
            self.thought = True
            return text, ""
        return "", text

    def _enter_reasoning(self, rest: str) -> None:
        self._state, self._buf, self.thought = "reasoning", rest, True

    def _reasoning(self) -> tuple[str, str]:
        """Inside the reasoning: up to ``</think>`` (the rest is content), or all but a partial ``</think>``."""
        i = self._buf.find(END)
        if i >= 0:
            reasoning, content = self._buf[:i], self._buf[i + len(END):]
            self._state, self._buf = "content", ""
            return reasoning, content
        keep = _partial_suffix(self._buf, END)
        reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return reasoning, ""


class Qwen3ReasoningParser(ReasoningParser):
    """Both tags in the output; none at all when thinking is disabled."""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """The prompt opened ``<think>``: the output is reasoning until ``</think>``."""

    starts_inside = True


class GptOssReasoningParser(ReasoningParser):
    """Harmony messages: analysis to the reasoning, final and preambles to the content, calls dropped."""

    needs_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._scanner = HarmonyScanner()
        self._reasoning, self._content = Joined(), Joined()

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self._scanner.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._split(self._scanner.finish())

    def _split(self, pieces: list[Piece]) -> tuple[str, str]:
        reasoning, content = [], []
        for p in pieces:
            if p.route.kind == "reasoning":
                reasoning.append(self._reasoning.add(p.index, p.text))
            elif p.route.kind == "content":
                content.append(self._content.add(p.index, p.text))
        self.thought = self.thought or any(reasoning)
        return "".join(reasoning), "".join(content)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"qwen3": Qwen3ReasoningParser,
                                                       "deepseek_r1": DeepSeekR1ReasoningParser,
                                                       "gpt_oss": GptOssReasoningParser}


def reasoning_parser_class(name: str, what: str = "reasoning_parser") -> type[ReasoningParser]:
    """The parser registered as ``name``; an unknown name is a ValueError naming ``what`` and the choices."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"{what}: {name!r} is not one of {', '.join(REASONING_PARSERS)}") from None


def parse_whole(parser: ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """A whole choice's (reasoning, content), each None when empty (``text`` is fed at once)."""
    reasoning, content = parser.feed(text)
    more_reasoning, more_content = parser.finish()
    return (reasoning + more_reasoning) or None, (content + more_content) or None


def grammar_gate(tokenizer: object, prompt_ids: list[int], parser: str = "qwen3") -> tuple[int, ...] | None:
    """The tokens after which a reasoning request's structured output applies (vLLM's rule), or None when it
    applies from the first token.

    ``<think>`` parsers: ``</think>``'s id while the prompt leaves the reasoning open (no ``</think>`` after its
    last ``<think>``, or neither yet: the model is to reason first); None when the prompt already closed it
    (thinking disabled by the template) or the tags are not single tokens of this tokenizer. ``gpt_oss``: the
    final channel's header, ``<|channel|>final<|message|>`` (harmony's reasoning ends with no token of its own:
    the answer starts after that header); None when the prompt itself ends with it."""
    unk = getattr(tokenizer, "unk_token_id", None)

    def single(tag: str) -> int | None:
        i = tokenizer.convert_tokens_to_ids(tag)  # type: ignore[attr-defined]
        return i if isinstance(i, int) and i != unk else None

    if parser == "gpt_oss":
        channel, message = single(CHANNEL), single(MESSAGE)
        if channel is None or message is None:
            return None
        gate = (channel, *tokenizer.encode("final", add_special_tokens=False), message)  # type: ignore[attr-defined]
        return None if tuple(prompt_ids[-len(gate):]) == gate else gate
    start, end = single(START), single(END)
    if start is None or end is None:
        return None
    last_start = max((i for i, t in enumerate(prompt_ids) if t == start), default=-1)
    closed = any(t == end for t in prompt_ids[last_start + 1:])
    return None if closed else (end,)
