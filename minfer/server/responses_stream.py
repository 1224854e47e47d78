"""A response's output items and its stream of events, built from the model's text as it arrives.

One ``ResponseBuilder`` serves a stream (a ``feed`` per engine delta) and a whole response (one ``feed`` of the
final text, its events dropped), so a stream's items join to exactly the whole response's (the chat parsers'
rule). The text goes through chat's parsers: the reasoning parser's split first (``reasoning`` items, their text
as a ``reasoning_text`` part), then the request's tool parser (``function_call`` items; what is left is the
``message`` item's ``output_text``). Items appear in the order their first text does.

Events follow OpenAI's sequence, each with the next ``sequence_number``: ``response.created`` and
``response.in_progress``; per item ``response.output_item.added``, for a message or reasoning item
``response.content_part.added``, the deltas (``response.output_text.delta``, ``response.reasoning_text.delta``,
``response.function_call_arguments.delta``), their ``.done`` and ``response.content_part.done``, then
``response.output_item.done``; last ``response.completed``, or ``response.incomplete`` when the output was cut
(``incomplete_details.reason``: ``max_output_tokens``). A reasoning item closes when the answer starts, a call as
soon as it is whole (a named tool choice's one call streams its arguments and closes at the end), a message at
the end.
"""
from __future__ import annotations

import copy
import json
import uuid
from typing import Any

from minfer.server.reasoning import StreamSplitter
from minfer.server.tool_parsers import ToolDelta
from minfer.server.tools import ToolPlan

Event = dict[str, Any]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def event_sse(event: Event) -> bytes:
    """An event as SSE, named by its type as OpenAI names them."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def response_usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object. Cached and reasoning tokens are not counted apart (0, as vLLM reports them for
    models outside the harmony format)."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


class ResponseBuilder:
    """One response: ``head`` holds its fixed fields (id, model, the request's settings echoed), ``output`` its
    items as they grow. ``start``, ``feed`` and ``finish`` return the events to send."""

    def __init__(self, head: dict[str, Any], plan: ToolPlan, reasoning_parser: str | None) -> None:
        self.head = head
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self._seq = 0
        self._splitter = StreamSplitter(reasoning_parser)
        self._parser = plan.new_parser() if plan.mode != "none" else None
        self._streamed_call = plan.mode == "named"  # its one call's arguments arrive in pieces
        self._open: list[int] = []  # output indexes of the items not done yet, in order
        self._reasoning: int | None = None  # the reasoning item taking text now
        self._message: int | None = None
        self._calls: dict[int, int] = {}  # the parser's call index -> output index

    # ---- the response object ----------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        """The response object now (its ``output`` shares the items: serialise it before the next feed)."""
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        return {**self.head, "status": self.status, "incomplete_details": incomplete, "output": self.output,
                "usage": self.usage}

    def start(self) -> list[Event]:
        snapshot = {**self.response(), "output": []}
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    # ---- the model's text -------------------------------------------------------------------
    def feed(self, text: str, last: bool) -> list[Event]:
        """The events of the next piece of the model's text; ``last``: the output ends with it (what the parsers
        held back, a partial tag, comes out)."""
        thought, content = self._splitter.split(0, text, last)
        calls: list[ToolDelta] = []
        if self._parser is not None:
            content, calls = self._parser.feed(text if self._parser.needs_special_tokens else content)
            if last:
                more, later = self._parser.finish()
                content, calls = content + more, calls + later
        events: list[Event] = []
        if thought:
            events += self._think(thought)
        if content:
            events += self._say(content)
        for delta in calls:
            events += self._call(delta)
        return events

    def finish(self, finish_reason: str | None, input_tokens: int, output_tokens: int) -> list[Event]:
        """Close every open item and end the response: ``completed``, or ``incomplete`` when the output was cut
        by its token limit. A response with no item at all gets an empty message (there is always an answer)."""
        self.status = "incomplete" if finish_reason == "length" else "completed"
        self.usage = response_usage(input_tokens, output_tokens)
        events = self._say("") if not self.output else []
        for index in list(self._open):
            events += self._close(index)
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return events + [self._event(kind, response=self.response())]

    # ---- items ------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _add(self, item: dict[str, Any]) -> tuple[int, list[Event]]:
        index = len(self.output)
        self.output.append(item)
        self._open.append(index)
        return index, [self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item))]

    def _part_added(self, index: int, part: dict[str, Any]) -> Event:
        item = self.output[index]
        item["content"].append(part)
        return self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                           part=dict(part))

    def _think(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._reasoning is None:
            self._reasoning, events = self._add({"id": item_id("rs"), "type": "reasoning", "summary": [],
                                                 "content": [], "status": "in_progress"})
            events.append(self._part_added(self._reasoning, {"type": "reasoning_text", "text": ""}))
        item = self.output[self._reasoning]
        item["content"][0]["text"] += text
        return events + [self._event("response.reasoning_text.delta", item_id=item["id"],
                                     output_index=self._reasoning, content_index=0, delta=text)]

    def _say(self, text: str) -> list[Event]:
        events = self._end_reasoning()
        if self._message is None:
            index, added = self._add({"id": item_id("msg"), "type": "message", "role": "assistant",
                                      "status": "in_progress", "content": []})
            self._message = index
            events += added + [self._part_added(index, {"type": "output_text", "text": "", "annotations": [],
                                                        "logprobs": []})]
        if not text:
            return events
        item = self.output[self._message]
        item["content"][0]["text"] += text
        return events + [self._event("response.output_text.delta", item_id=item["id"], output_index=self._message,
                                     content_index=0, delta=text, logprobs=[])]

    def _call(self, delta: ToolDelta) -> list[Event]:
        events = self._end_reasoning()
        arguments = delta["function"].get("arguments", "")
        if "id" in delta:  # a new call
            index, added = self._add({"id": item_id("fc"), "type": "function_call", "call_id": delta["id"],
                                      "name": delta["function"]["name"], "arguments": "", "status": "in_progress"})
            self._calls[delta["index"]] = index
            events += added
        else:
            index = self._calls[delta["index"]]
        item = self.output[index]
        if arguments:
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=arguments))
        if not self._streamed_call:  # whole already
            events += self._close(index)
        return events

    def _end_reasoning(self) -> list[Event]:
        index, self._reasoning = self._reasoning, None
        return self._close(index) if index is not None and index in self._open else []

    def _close(self, index: int) -> list[Event]:
        """An item's closing events; an item left open by a cut output is ``incomplete``, any other ``completed``."""
        self._open.remove(index)
        item = self.output[index]
        item["status"] = "incomplete" if self.status == "incomplete" else "completed"
        ids: dict[str, Any] = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **ids, name=item["name"],
                                  arguments=item["arguments"])]
        else:
            part = item["content"][0]
            kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events = [self._event(kind, **ids, content_index=0, text=part["text"], **extra),
                      self._event("response.content_part.done", **ids, content_index=0, part=dict(part))]
        return events + [self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat message a next turn's conversation holds: its text and its calls
    (reasoning is left out, as chat templates drop earlier turns' reasoning); none when it has neither."""
    text = "".join(item["content"][0]["text"] for item in output if item["type"] == "message")
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return []
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]
