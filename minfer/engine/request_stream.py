"""What the engine thread hands the event loop: one ``RequestStream`` per request, and the errors that end one.

``AsyncLLMEngine`` (``async_engine.py``) fills the streams from its engine thread; the readers (the server, which
maps these errors to HTTP statuses, and ``generate``) need only this file.
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
    chunk."""

    __slots__ = ("request_id", "started", "finished", "_latest", "_error", "_event")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.started = False  # has produced an output (so it no longer counts as waiting)
        self.finished = False
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self._latest = output if self._latest is None else join_outputs(self._latest, output)
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
        out, self._latest = self._latest, None
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


class Done:
    """What a call that has already acted returns so that it can also be awaited: ``AsyncLLMEngine.abort`` stops a
    request at once (the server calls it so), and a vLLM caller writes ``await engine.abort(request_id)``, vLLM's
    abort being a coroutine."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        yield from ()  # finishes at once: there is nothing to wait for
