"""Incremental detokenization: the text a new token adds, without decoding the whole output again.

A token's text can depend on its neighbours (leading-space rules of SentencePiece, multi-byte
characters split across byte-level tokens), so each step decodes a short window ending at the new
token and emits only the part after the already-emitted window, holding back text that still ends
in an incomplete character (U+FFFD).
"""
from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, for leading-space rules


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # window start: decoded for context only
        self.read_offset = len(self.ids)  # text up to here has been emitted
        self.text = ""

    def step(self, token_id: int) -> str:
        """Append one token; return the text it made final (may be empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        after = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
