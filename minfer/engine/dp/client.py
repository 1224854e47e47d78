"""DataParallelEngine: what the server calls of ``AsyncLLMEngine``, over a ``DataParallelLLMEngine``'s replicas.

The server builds it in place of ``AsyncLLMEngine`` when ``data_parallel_size`` > 1 and calls it the same way:
``add_request`` -> ``RequestStream``, ``abort``, ``call`` (LoRA loads and unloads, on every replica), ``stats``,
``healthy`` / ``failure``, ``start`` / ``shutdown``, ``observer``, ``on_dead``. There is no engine thread here: each
replica runs its own engine loop, and this object routes requests to them (the balancer, in ``add_request``) and
feeds the streams from their messages, which ``start`` sends to its event loop (the replica's receiver thread first
hands a step's outputs to the ``observer``, the metrics, labelled with the replica's index when the observer offers
``for_engine``).

A replica that dies fails its requests in flight (``EngineDeadError`` naming it: a 500, or a failed stream) and is
named by ``failure`` (/health answers 503), while the others go on serving new requests; ``on_dead`` is called only
when the last one has died (the server exits then, for a supervisor to restart it).
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable
from operator import methodcaller
from typing import Any, Callable

from minfer.engine.dp.engine import DataParallelLLMEngine, broadcast_result
from minfer.engine.request_stream import Done, EngineDeadError, RequestStream, StreamTable
from minfer.lora.request import LoRARequest
from minfer.outputs import RequestOutputKind


class DataParallelEngine:
    """``AsyncLLMEngine``'s server-side interface over data-parallel replicas (see the module's docstring).
    ``max_waiting_requests`` bounds the requests admitted here but not yet producing a token, over all replicas."""

    def __init__(self, engine: DataParallelLLMEngine, max_waiting_requests: int | None = None) -> None:
        if engine.output_kind is not RequestOutputKind.DELTA:  # RequestStream.put joins deltas
            raise ValueError("DataParallelEngine needs a DataParallelLLMEngine built with RequestOutputKind.DELTA")
        self.engine = engine
        self.processor = engine.processor.clone()
        self.max_waiting_requests = max_waiting_requests
        self.observer: Any = None  # told of every step and abort, on a replica's receiver thread
        self.on_dead: Callable[[str], None] | None = None  # called on the event loop once every replica has died
        self.owns_engine = False  # ``shutdown`` stops the replicas too
        self._streams = StreamTable()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shut_down = False

    # ---- lifecycle (event loop side) ------------------------------------------------------------
    def start(self) -> None:
        """Take the replicas' messages on the running loop from now on."""
        if self._shut_down:
            raise EngineDeadError("the engine has been shut down")
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        observers = [self._observer_for(i) for i in range(self.engine.replicas.size)]

        def sink(replica: int, message: tuple[Any, ...]) -> None:  # on the replica's receiver thread
            observer = observers[replica]
            if observer is not None and message[0] == "out":
                observer.on_step(*message[1:])
            elif observer is not None and message[0] == "aborted":
                observer.on_abort(message[1])
            try:
                self._loop.call_soon_threadsafe(self._on_message, replica, message)  # type: ignore[union-attr]
            except RuntimeError:  # the loop has closed: nobody is left to tell
                pass

        self.engine.replicas.set_sink(sink)

    def _observer_for(self, replica: int) -> Any:
        observer = self.observer
        return observer.for_engine(replica) if hasattr(observer, "for_engine") else observer

    def shutdown(self, timeout: float = 10.0) -> None:
        """Fail the requests in flight and stop taking messages; ``owns_engine``: stop the replicas too."""
        self._shut_down = True
        self.engine.replicas.set_sink(None)
        self._streams.fail(list(self._streams.streams), EngineDeadError("the engine is shutting down"))
        if self.owns_engine:
            self.owns_engine = False
            self.engine.shutdown()

    @property
    def healthy(self) -> bool:
        """Every replica serves (one that died turns /health to 503, though the others still answer)."""
        return self._loop is not None and not self._shut_down and self.engine.failure is None

    @property
    def error(self) -> BaseException | None:
        failure = self.engine.failure
        return None if failure is None else EngineDeadError(failure)

    @property
    def failure(self) -> str | None:
        """Which replicas died and how (e.g. "data-parallel replica 1 died (signal SIGKILL)"), or None."""
        if self.healthy:
            return None
        return self.engine.failure or ("the engine has been shut down" if self._shut_down else
                                       "the engine loop is not running")

    def _serving(self) -> bool:
        """Some replica can still take a request."""
        return self._loop is not None and not self._shut_down and any(self.engine.balancer.alive)

    def stats(self) -> dict[str, Any]:
        """The replicas' stats merged (``dp/stats.py``), with the requests waiting here and the open streams."""
        return dict(self.engine.get_stats(), num_waiting_requests=self._streams.num_waiting,
                    num_streams=len(self._streams))

    # ---- engine calls: on every replica ----------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return await self.call(methodcaller("add_lora", lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self.call(methodcaller("remove_lora", lora_int_id))

    async def list_loras(self) -> dict[int, LoRARequest]:
        return await self.call(methodcaller("list_loras"))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine)`` on every live replica's engine thread, between steps (``fn`` must pickle); what one raises
        is raised here (``broadcast_result``)."""
        if not self._serving():
            raise EngineDeadError(f"the engine has stopped: {self.failure} (the server log has the details)")
        futures = self.engine.replicas.call_all(fn)  # a replica that dies, or the shutdown, fails its future
        await asyncio.wait([asyncio.wrap_future(f) for f in futures])
        return broadcast_result(futures)

    # ---- requests (event loop side) ----------------------------------------------------------------
    def add_request(self, request: Any) -> RequestStream:
        """Route a checked request (``EngineRequest``) to a replica; its outputs arrive on the stream."""
        if not self._serving():
            raise EngineDeadError(f"the engine has stopped: {self.failure} (the server log has the details)")
        self._streams.check(request.request_id, self.max_waiting_requests)
        self.engine.add_processed_request(request)
        return self._streams.open(request.request_id)

    def abort(self, request_id: str | Iterable[str]) -> Done:
        """Stop a request, or each of several: its stream ends now, its replica frees its blocks before its next
        step. ``await engine.abort(id)`` works too."""
        for one in self._streams.close([request_id] if isinstance(request_id, str) else list(request_id)):
            self.engine.abort_request(one)
        return Done()

    # ---- the replicas' messages (event loop side) ----------------------------------------------------
    def _on_message(self, replica: int, message: tuple[Any, ...]) -> None:
        event = self.engine.receive(replica, message)
        if event is None:
            return
        kind = event[0]
        if kind == "out":
            self._streams.deliver(event[1])
        elif kind == "fail":
            self._streams.fail([event[1]], event[2])
        elif kind == "fail_each":
            self._streams.fail(event[1], event[2])
        elif kind == "exited":
            self._replica_died(event[1], event[2])

    def _replica_died(self, failure: str, lost: list[str]) -> None:
        error = EngineDeadError(f"the engine has stopped: {failure} (the server log has the details)")
        self._streams.fail(lost, error)
        if not any(self.engine.balancer.alive):
            self._streams.fail(list(self._streams.streams), error)
            if self.on_dead is not None:
                self.on_dead(self.engine.failure or failure)

