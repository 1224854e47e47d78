"""Turning cumulative engine outputs into streamed deltas, and the SSE framing around them.

The engine reports each request's whole text so far, and its tokens either whole or, in delta
outputs (``RequestOutputKind.DELTA``), from ``token_offset`` on; a stream sends only what is new.
With stop strings, the last ``len(longest stop) - 1`` characters are held back until the request
ends: they might be the start of a stop string, which the final text cuts off, and text already
sent cannot be taken back. That keeps the streamed text equal to the non-streamed text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from minfer.outputs import CompletionOutput

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


_MARK = "\ue000minfer-text\ue001"  # private-use characters: no header or choice holds them
_MARK_JSON = json.dumps(_MARK, ensure_ascii=False).encode()


class TextChunks:
    """A stream's most common event, one choice whose only news is text, as bytes: the text's JSON string spliced
    between two pieces encoded once per choice index. Encoding the whole chunk dict costs several times encoding
    the string alone, once per streamed token of every stream, on the event loop. ``build(index, text)`` is the
    chunk dict the generic path sends; the bytes are ``sse`` of it, exactly."""

    def __init__(self, build: Callable[[int, str], dict[str, Any]]) -> None:
        self.build = build
        self._pieces: dict[int, tuple[bytes, bytes] | None] = {}

    def __call__(self, index: int, text: str) -> bytes:
        if index not in self._pieces:
            parts = sse(self.build(index, _MARK)).split(_MARK_JSON)
            self._pieces[index] = (parts[0], parts[1]) if len(parts) == 2 else None
        pieces = self._pieces[index]
        if pieces is None:  # the marker was not where the text goes: the generic encoding
            return sse(self.build(index, text))
        return pieces[0] + json.dumps(text, ensure_ascii=False).encode() + pieces[1]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool  # the first delta of this choice


class DeltaTracker:
    """Per-choice state of what has been sent so far."""

    def __init__(self, holdback: int) -> None:
        self.holdback = holdback
        self.sent_chars: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.done: set[int] = set()

    def delta(self, key: int, c: CompletionOutput) -> Delta | None:
        """What choice ``key`` gained since the last call, or None if nothing is new."""
        if key in self.done:
            return None
        first = key not in self.sent_chars
        chars, toks = self.sent_chars.get(key, 0), self.sent_tokens.get(key, 0)
        skip = toks - c.token_offset  # of c's tokens, those already sent
        if skip < 0:
            raise RuntimeError(f"choice {key}: an output starts at token {c.token_offset}, but {toks} were sent")
        finished = c.finish_reason is not None
        end = len(c.text) if finished else max(chars, len(c.text) - self.holdback)
        text = c.text[chars:end]
        new_ids = c.token_ids[skip:]
        if not text and not new_ids and not finished:
            return None
        self.sent_chars[key], self.sent_tokens[key] = max(chars, end), c.token_offset + len(c.token_ids)
        if finished:
            self.done.add(key)
        lps = c.logprobs[skip:len(c.token_ids)] if c.logprobs is not None else None
        return Delta(text, new_ids, lps, c.finish_reason, c.stop_reason, first)


def holdback_for(stop: str | list[str] | None) -> int:
    stops = [stop] if isinstance(stop, str) else (stop or [])
    return max((len(s) for s in stops), default=1) - 1


class TokenText:
    """Token ids to the strings logprobs report, via the event loop's tokenizer (or 'token_id:N')."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
            if len(self._cache) < 65536:
                self._cache[token_id] = s
        return s


def completion_logprobs(lps: list[dict[int, float]], ids: list[int], tok: TokenText, offset: int) -> dict[str, Any]:
    """The legacy completions shape; ``top_logprobs`` holds the chosen token and the top k, as vLLM does."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(ids, lps):
        s = tok(tid)
        tokens.append(s)
        token_lps.append(_finite(entry[tid]))
        tops.append({tok(t): _finite(v) for t, v in entry.items()})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(prompt_ids: list[int], prompt_lps: list[dict[int, float] | None], tok: TokenText,
                  k: int) -> dict[str, Any]:
    """The prompt's part of an echoed completion's logprobs (vLLM's and lm-evaluation-harness's shape): every
    prompt token, the first with ``None`` for its logprob and its top logprobs (nothing comes before it); each
    other position the prompt token's logprob and the top ``k`` with it."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for pos, tid in enumerate(prompt_ids):
        s = tok(tid)
        entry = prompt_lps[pos] if pos < len(prompt_lps) else None
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if entry is None or pos == 0:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_finite(entry[tid]))
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        tops.append({tok(t): _finite(v) for t, v in [(tid, entry[tid]), *top]})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(head: dict[str, Any], tail: dict[str, Any] | None) -> dict[str, Any]:
    """``head`` (the echoed prompt's) followed by ``tail`` (the completion's), offsets shifted past the head."""
    if tail is None:
        return head
    shift = sum(map(len, head["tokens"]))
    return {"tokens": head["tokens"] + tail["tokens"], "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
            "top_logprobs": head["top_logprobs"] + tail["top_logprobs"],
            "text_offset": head["text_offset"] + [o + shift for o in tail["text_offset"]]}


def prompt_logprobs_entries(lps: list[dict[int, float] | None] | None, tok: TokenText) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or {token id: {logprob, decoded_token}}."""
    if lps is None:
        return None
    return [None if entry is None else {str(t): {"logprob": _finite(v), "decoded_token": tok(t)} for t, v in entry.items()}
            for entry in lps]


def chat_logprobs(lps: list[dict[int, float]], ids: list[int], tok: TokenText, k: int) -> list[dict[str, Any]]:
    """The chat shape: per token its logprob and the ``k`` most likely tokens at that position."""
    content = []
    for tid, entry in zip(ids, lps):
        s = tok(tid)
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        content.append({"token": s, "logprob": _finite(entry[tid]), "bytes": list(s.encode()),
                        "top_logprobs": [{"token": tok(t), "logprob": _finite(v), "bytes": list(tok(t).encode())}
                                         for t, v in top]})
    return content


def _finite(x: float) -> float:
    """JSON has no -inf: a token of probability 0 reports the lowest float32-ish value instead."""
    return x if x > -9999.0 else -9999.0
