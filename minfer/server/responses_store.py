"""The responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory, bounded, least
recently used first out.

Each entry holds a response as it was returned and the conversation a next turn continues: the chat messages of
every earlier input (instructions aside: OpenAI's API does not carry them over) and of this response's output.
An entry's size is counted as the characters of its messages and of its response's JSON; the store keeps at
most ``max_entries`` entries and ``max_bytes`` of them (1024 and 64 MiB by default), evicting the least recently
stored or read entry until both hold. An entry larger than ``max_bytes`` alone is not kept: a later turn naming
it gets the unknown-id 404, as after an eviction or a restart (nothing is written to disk).

Only the event loop touches the store, so it needs no lock.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_ENTRIES = 1024
MAX_BYTES = 64 << 20
_MESSAGE_OVERHEAD = 64  # a message's keys and role, roughly


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET returns it
    messages: list[dict[str, Any]]  # the conversation up to and including this response's output
    size: int


def messages_size(messages: list[dict[str, Any]]) -> int:
    """The characters a conversation holds (its texts and call arguments, and a fixed cost per message)."""
    total = 0
    for m in messages:
        total += _MESSAGE_OVERHEAD + len(m.get("content") or "")
        for call in m.get("tool_calls") or ():
            total += _MESSAGE_OVERHEAD + len(call["function"]["arguments"]) + len(call["function"]["name"])
    return total


class ResponseStore:
    """Responses by id, least recently used first out, within a count and a size."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("a response store holds at least one entry and one byte")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep ``body`` (under its ``id``) and its conversation; False when it alone is over the size bound."""
        size = len(json.dumps(body, separators=(",", ":"), ensure_ascii=False)) + messages_size(messages)
        if size > self.max_bytes:
            return False
        self.delete(body["id"])
        self._entries[body["id"]] = StoredResponse(body, messages, size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used one), or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
