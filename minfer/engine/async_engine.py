"""AsyncLLMEngine: one background thread owns an LLMEngine; asyncio code streams from it.

Why a thread and not an asyncio task: ``LLMEngine.step`` blocks for a whole forward, which inline on the event loop
would freeze every HTTP connection; in a thread, the loop keeps accepting, parsing and streaming while torch (which
releases the GIL in its kernels and while waiting on the GPU) computes (CPU, 8-layer test model, 48 streaming
clients: GET /health in 6 ms p50 beside the thread, 160 ms with ``step()`` on the loop). The engine is not
thread-safe, so only this thread touches it: callers talk to it through a command queue (requests, aborts, which
act before the next step, and ``call``s: LoRA loads and unloads), and it answers by ``loop.call_soon_threadsafe``,
once per step for the whole batch of outputs. With nothing unfinished it blocks on the queue (no busy spin).

If a step raises a host-side error from the values it was given (``RECOVERABLE_STEP_ERRORS``), the requests in
flight fail with ``StepFailedError`` and the loop goes on with an empty engine. If the loop raises anything else, or
a tensor-parallel worker dies (an idle loop is woken to it), the engine is dead: every in-flight stream, call and
later request fails with ``EngineDeadError``, ``healthy`` turns False and ``on_dead`` is called (the server exits
there); nothing waits forever. A client reads the ``failure`` summary, never the error's own text (a device's or
gloo's message can hold build paths), which goes to the log.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, Callable

from minfer.engine.gc_heap import heap_frozen
from minfer.engine.llm_engine import LLMEngine
from minfer.engine.processor import EngineRequest, Processor
from minfer.engine.request_stream import (Done, EngineDeadError, EngineObserver, QueueFullError,  # noqa: F401
                                          RequestStream, StepFailedError, StreamTable, join_outputs)
from minfer.engine.tp_workers import TensorParallelError
from minfer.engine.vllm_async_api import VLLMAsyncAPI
from minfer.lora.request import LoRARequest
from minfer.outputs import RequestOutput, RequestOutputKind

logger = logging.getLogger("minfer.async_engine")

# Failures a step can raise on the host from values it was given (say, a sampling parameter no check
# caught): the loop aborts the requests in flight and goes on. Anything else (a RuntimeError from the
# device, say), or this many failed steps in a row, ends the loop.
RECOVERABLE_STEP_ERRORS = (ArithmeticError, LookupError, ValueError, TypeError)
MAX_FAILED_STEPS = 3


class AsyncLLMEngine(VLLMAsyncAPI):
    """Serve an ``LLMEngine`` to asyncio callers from a background thread. ``max_waiting_requests`` bounds the
    requests admitted but not yet producing a token (queued or in prefill); past it ``add_request`` raises
    ``QueueFullError``. ``processor``: the event loop's copy of the engine's, which checks requests before queueing.
    vLLM's calls (``from_engine_args``, ``generate``) are in ``vllm_async_api.py``."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None) -> None:
        if engine.output_kind is not RequestOutputKind.DELTA:  # RequestStream.put joins deltas
            raise ValueError(f"AsyncLLMEngine needs an LLMEngine built with RequestOutputKind.DELTA, "
                             f"got {engine.output_kind}")
        self.engine = engine
        self.processor: Processor = engine.processor.clone()
        self.max_waiting_requests = max_waiting_requests
        self.observer: EngineObserver | None = None  # told of every step and abort, on the engine thread
        self.on_dead: Callable[[str], None] | None = None  # called on the event loop with ``failure`` once dead
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams = StreamTable()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stats: dict[str, Any] = engine.get_stats()
        self._token_times: deque[tuple[float, int]] = deque()  # (time, new tokens) of the last second's steps
        self._num_tokens: dict[str, int] = {}  # engine thread: output tokens so far per request
        self._calls: set[asyncio.Future[Any]] = set()  # ``call``s the engine thread has not answered yet
        self.owns_engine = False  # ``from_engine_args`` built the LLMEngine: ``shutdown`` stops it too
        self._shut_down = False

    # ---- lifecycle (event loop side) ------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the streams."""
        if self._shut_down:
            raise EngineDeadError("the engine has been shut down")
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self.engine.workers is not None:  # a worker that dies while the loop idles wakes it
            self.engine.workers.on_failure = functools.partial(self._commands.put, ("wake",))
        self._thread = threading.Thread(target=self._run, name="minfer-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step; in-flight requests fail with EngineDeadError. An engine that
        ``from_engine_args`` built stops too (tensor-parallel workers, grammar processes). It cannot start again."""
        self._shut_down = True
        if self._thread is not None:
            self._commands.put(("stop",))
            self._thread.join(timeout)
            self._thread = None
            self._fail_all(EngineDeadError("the engine is shutting down"))
        if self.owns_engine:
            self.owns_engine = False
            self.engine.shutdown()

    @property
    def healthy(self) -> bool:
        return (self._error is None and self._thread is not None and self._thread.is_alive()
                and self.engine.failure is None)  # a dead tensor-parallel worker, also while idle

    @property
    def error(self) -> BaseException | None:
        """Why the engine died (its full text is for the log), or None."""
        if self._error is None and self.engine.workers is not None:
            return self.engine.workers.error  # a dead worker, before the loop has woken to it
        return self._error

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve, as a client may read it: what failed, without the error's text."""
        if self.healthy:
            return None
        error = self.error
        if error is None:
            return "the engine loop is not running"
        if isinstance(error, TensorParallelError):
            return error.summary
        return f"the engine step raised {type(error).__name__}"

    def stats(self) -> dict[str, Any]:
        """The engine's counters as of its last step with the KV usage and prefix-cache hit rate derived from them,
        the output rate over the last second, and the server's waiting count (``list(deque)`` copies atomically)."""
        now = time.time()
        recent = sum(n for t, n in list(self._token_times) if t > now - 1.0)
        s = self._stats
        used, queried = s["num_kv_blocks"] - s["num_free_kv_blocks"], s["prefix_cache_queried_tokens"]
        return dict(s, kv_blocks_used=used, kv_cache_usage=used / max(s["num_kv_blocks"], 1),
                    prefix_cache_hit_rate=s["prefix_cache_hit_tokens"] / queried if queried else 0.0,
                    generation_tokens_per_s=float(recent), num_waiting_requests=self._streams.num_waiting,
                    num_streams=len(self._streams))

    # ---- engine calls: LoRA adapters (event loop side) --------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> bool:  # a bad adapter raises LoRAAdapterError here
        return await self.call(lambda engine: engine.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:  # refused (ValueError) while requests use it
        return await self.call(lambda engine: engine.remove_lora(lora_int_id))

    async def list_loras(self) -> dict[int, LoRARequest]:
        return await self.call(lambda engine: engine.list_loras())

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)`` on the engine thread, between two steps, in order with the requests and aborts queued
        before it; what it raises is raised here and the engine goes on (an ``Exception``, not a dead engine)."""
        if not self.healthy:
            raise EngineDeadError(f"the engine has stopped: {self.failure} (the server log has the details)")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls.add(future)  # failed with the streams if the engine dies first
        self._commands.put(("call", fn, future))
        future.add_done_callback(self._calls.discard)
        return await future

    # ---- requests (event loop side) -------------------------------------------------------
    def add_request(self, request: EngineRequest) -> RequestStream:
        """Queue a request (checked by ``self.processor``) for the engine thread; its outputs arrive on the stream."""
        if not self.healthy:
            raise EngineDeadError(f"the engine has stopped: {self.failure} (the server log has the details)")
        self._streams.check(request.request_id, self.max_waiting_requests)
        stream = self._streams.open(request.request_id)
        self._commands.put(("add", request))
        return stream

    def abort(self, request_id: str | Iterable[str]) -> Done:
        """Stop a request, or each of several; its KV blocks are freed before the engine's next step and its stream
        ends (a reader waiting on it stops). Done when it returns; ``await engine.abort(id)`` (vLLM's) works too."""
        for one in self._streams.close([request_id] if isinstance(request_id, str) else list(request_id)):
            self._commands.put(("abort", one))
        return Done()

    # What the engine thread hands the event loop (``_call_on_loop``; a data-parallel replica forwards them by name).
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._streams.deliver(outputs)

    def _fail(self, request_id: str, error: BaseException) -> None:
        self._streams.fail([request_id], error)

    def _fail_each(self, request_ids: list[str], error: BaseException) -> None:
        self._streams.fail(request_ids, error)

    def _fail_all(self, error: BaseException) -> None:
        self._streams.fail(list(self._streams.streams), error)
        for future in list(self._calls):
            _settle(future, None, error)

    def _call_on_loop(self, fn: Any, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[union-attr]
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        with heap_frozen():  # no full collection walks the model's objects while the loop runs (gc_heap.py)
            self._loop_steps()

    def _loop_steps(self) -> None:
        engine = self.engine
        failures = 0  # steps failed in a row
        try:
            while True:
                if engine.workers is not None:
                    engine.workers.check()  # a worker died while the loop was idle ("wake")
                # Block only when there is nothing to compute: that is the idle sleep.
                if not self._handle_commands(block=not engine.has_unfinished_requests()):
                    return
                if not engine.has_unfinished_requests():
                    continue
                try:
                    outputs = engine.step()
                except RECOVERABLE_STEP_ERRORS as exc:
                    failures += 1
                    if failures >= MAX_FAILED_STEPS:
                        raise
                    self._recover(exc)
                    continue
                failures = 0
                now = time.time()
                new_tokens = self._count_new_tokens(outputs)
                self._publish_stats(sum(new_tokens), now)
                if self.observer is not None:
                    self.observer.on_step(outputs, new_tokens, now)
                for request_id, error in engine.step_errors.items():  # its "abort" output is then not delivered
                    self._call_on_loop(self._fail, request_id, error)
                if outputs:
                    self._call_on_loop(self._deliver, outputs)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the waiting clients
            logger.exception("the engine loop died; failing all in-flight requests")
            self._error = exc
            self._call_on_loop(self._died)

    def _died(self) -> None:
        failure = self.failure or "the engine loop died"
        self._fail_all(EngineDeadError(f"the engine has stopped: {failure} (the server log has the details)"))
        if self.on_dead is not None:
            self.on_dead(failure)

    def _recover(self, exc: BaseException) -> None:
        """After a step raised on the host: abort everything in the engine, fail those requests, go on."""
        logger.exception("a step failed; aborting the %d requests in flight, the engine goes on",
                         len(self.engine.requests))
        ids = self.engine.abort_all()  # raises (and the loop dies) if that leaves blocks held
        for request_id in ids:
            self._num_tokens.pop(request_id, None)
            if self.observer is not None:
                self.observer.on_abort(request_id)
        self._stats = self.engine.get_stats()
        error = StepFailedError(f"the engine step serving this request failed: {exc!r}; the requests in flight "
                                "were aborted")
        self._call_on_loop(self._fail_each, ids, error)

    def _handle_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one if ``block``); False once told to stop."""
        handled = False
        while True:
            try:
                cmd = self._commands.get(timeout=None) if block else self._commands.get_nowait()
            except queue.Empty:
                if handled:  # one snapshot for a burst of adds and aborts
                    self._stats = self.engine.get_stats()
                return True
            block, handled = False, True
            kind = cmd[0]
            if kind == "stop":
                return False
            if kind == "wake":
                continue
            if kind == "abort":
                known = cmd[1] in self.engine.requests  # it may have finished meanwhile
                self.engine.abort_request(cmd[1])
                self._num_tokens.pop(cmd[1], None)
                if known and self.observer is not None:
                    self.observer.on_abort(cmd[1])
            elif kind == "add":
                request = cmd[1]
                try:
                    self.engine.add_processed_request(request)
                except (ValueError, TypeError) as exc:  # a bad request, not a broken engine
                    self._call_on_loop(self._fail, request.request_id, exc)
            elif kind == "call":
                try:
                    result, error = cmd[1](self.engine), None
                except Exception as exc:  # noqa: BLE001 - the caller's to report (a bad adapter); the engine goes on
                    result, error = None, exc
                self._call_on_loop(_settle, cmd[2], result, error)

    def _count_new_tokens(self, outputs: list[RequestOutput]) -> list[int]:
        counts = self._num_tokens
        new = []
        for out in outputs:
            total = sum(c.token_offset + len(c.token_ids) for c in out.outputs)
            new.append(total - counts.get(out.request_id, 0))
            if out.finished:
                counts.pop(out.request_id, None)
            else:
                counts[out.request_id] = total
        return new

    def _publish_stats(self, num_new_tokens: int, now: float) -> None:
        """Refresh the stats snapshot (one dict assignment, so readers never see it half-built)."""
        window = self._token_times
        window.append((now, num_new_tokens))
        while window[0][0] < now - 1.0:
            window.popleft()
        self._stats = self.engine.get_stats()


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Answer a ``call`` on the event loop, unless its caller has gone (cancelled) or it was answered already."""
    if not future.done():
        future.set_result(result) if error is None else future.set_exception(error)
