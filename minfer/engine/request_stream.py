"""What the engine thread hands the event loop: one ``RequestStream`` per request, the table of a front's open
streams, and the errors that end one.

``AsyncLLMEngine`` (``async_engine.py``) and data parallelism's ``DataParallelEngine`` (``dp/client.py``) keep their
streams in a ``StreamTable`` and fill them from their engines; the readers (the server, which maps these errors to
HTTP statuses, and ``generate``) need only this file.
"""
from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any, Protocol

from minfer.outputs import RequestOutput


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed or shut down); no request can be served."""


class StepFailedError(RuntimeError):
    """The step serving this request raised on the host; the requests in flight were aborted, the engine goes on."""


class QueueFullError(RuntimeError):
    """Too many requests are already waiting for their first token; retry later."""


class EngineObserver(Protocol):
    """Hooks called on the engine thread (e.g. to record metrics); they must be quick."""

    def on_step(self, outputs: list[RequestOutput], new_tokens: list[int], now: float) -> None:
        """``new_tokens[i]``: tokens ``outputs[i]`` gained this step, over all its samples."""

    def on_abort(self, request_id: str) -> None:
        """The request ended without finishing (client gone); forget what is kept for it."""


class RequestStream:
    """The outputs of one request not yet read, joined into one, read on the event loop. The engine runs in delta
    mode (``RequestOutputKind.DELTA``): an unfinished request's output holds only its new tokens, the finished one
    everything. ``put`` joins a delta onto the unread output instead of queueing it (a finished output replaces it),
    which bounds what is kept per request whatever the client's pace and lets a slow client get several tokens in one
    chunk.

    ``interval``: how many new tokens wake the reader. Each wake costs the event loop a task switch and, in a
    streamed response, a chunk's encoding and a socket write, per request per step; a larger interval sends
    several tokens a chunk (vLLM's and SGLang's ``--stream-interval``), and 0 wakes it only for the first and the
    last output (a response sent whole reads nothing else). The first output and the last always wake it, and so
    do errors and ``close``."""

    __slots__ = ("request_id", "started", "finished", "interval", "_unread", "_woken", "_latest", "_error", "_event")

    def __init__(self, request_id: str, interval: int = 1) -> None:
        self.request_id = request_id
        self.started = False  # has produced an output (so it no longer counts as waiting)
        self.finished = False
        self.interval = interval
        self._unread = 0  # new tokens put since the reader last read (counted while interval > 1)
        self._woken = False
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        wake = self.interval == 1 or not self._woken or output.finished
        if not wake and self.interval:
            self._unread += max((len(c.token_ids) for c in output.outputs), default=0)  # before the join extends them
            wake = self._unread >= self.interval
        self._latest = output if self._latest is None else join_outputs(self._latest, output)
        if wake:
            self._woken = True
            self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def close(self) -> None:
        """End the stream where it is (its request was aborted): a reader waiting on it stops iterating, and an
        output it has not read is dropped."""
        self.finished = True
        self._latest = None
        self._event.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._event.wait()
        self._event.clear()
        if self.finished and self._error is None:  # closed while this reader waited
            raise StopAsyncIteration
        out, self._latest, self._unread = self._latest, None, 0
        if out is None or (self._error is not None and not out.finished):
            self.finished = True
            raise self._error or EngineDeadError("the request stream closed without output")
        self.finished = out.finished
        return out


def join_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """``new`` with the tokens and logprobs of ``old`` (an earlier, unread output) in front where ``new`` is a delta
    that continues it; ``old``'s lists are extended in place (the engine thread made them for this stream alone).
    A whole output (``token_offset`` 0) replaces ``old``."""
    for o, n in zip(old.outputs, new.outputs):
        if n.token_offset > o.token_offset:
            o.token_ids += n.token_ids
            if o.logprobs is not None and n.logprobs is not None:
                o.logprobs += n.logprobs
            n.token_ids, n.logprobs, n.token_offset = o.token_ids, o.logprobs, o.token_offset
    if new.prompt_logprobs is None:
        new.prompt_logprobs = old.prompt_logprobs
    return new


class StreamTable:
    """An engine front's open streams by request id, touched on the event loop only, and how many of them wait for
    their first output (what ``max_waiting_requests`` bounds)."""

    def __init__(self) -> None:
        self.streams: dict[str, RequestStream] = {}
        self.num_waiting = 0

    def __len__(self) -> int:
        return len(self.streams)

    def check(self, request_id: str, limit: int | None) -> None:
        """Whether a new request may open a stream: the waiting queue has room and its id is not in use."""
        if limit is not None and self.num_waiting >= limit:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting (limit {limit})")
        if request_id in self.streams:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def open(self, request_id: str) -> RequestStream:
        stream = self.streams[request_id] = RequestStream(request_id)
        self.num_waiting += 1
        return stream

    def close(self, request_ids: list[str]) -> list[str]:
        """End the streams of aborted requests; returns those whose engine request still runs (to abort there)."""
        running = []
        for request_id in request_ids:
            stream = self._pop(request_id)
            if stream is not None and not stream.finished:
                stream.close()
                running.append(request_id)
        return running

    def deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if not stream.started:
                stream.started = True
                self.num_waiting -= 1
            stream.put(out)
            if out.finished:
                del self.streams[out.request_id]

    def fail(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            stream = self._pop(request_id)
            if stream is not None:
                stream.fail(error)

    def _pop(self, request_id: str) -> RequestStream | None:
        stream = self.streams.pop(request_id, None)
        if stream is not None and not stream.started:
            self.num_waiting -= 1
        return stream


class Done:
    """What a call that has already acted returns so that it can also be awaited: ``AsyncLLMEngine.abort`` stops a
    request at once (the server calls it so), and a vLLM caller writes ``await engine.abort(request_id)``, vLLM's
    abort being a coroutine."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        yield from ()  # finishes at once: there is nothing to wait for
