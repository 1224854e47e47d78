"""The API side of the data-parallel replicas: start them, talk to them, notice when one dies, stop them all.

``Replicas`` spawns ``data_parallel_size`` processes (``replica.replica_main``), replica i with the visible GPUs
[i·tp, (i+1)·tp) in its ``CUDA_VISIBLE_DEVICES`` (set in its environment before it starts, so CUDA never sees the
others) and ``data_parallel_rank=i``; on the CPU each takes its share of the cores. Per replica, a sender thread
pickles and writes what the API side queues (so neither the event loop nor ``LLM`` waits on a full pipe) and a
receiver thread reads and unpickles what comes back and hands it to the sink: a queue that ``DataParallelLLMEngine``
reads, until ``DataParallelEngine`` points the sink at its event loop. Calls (``call_all``: LoRA loads, ...) are
answered on the receiver thread through ``concurrent.futures``, so they work before, during and without a loop.

A replica whose pipe closes has died: its process is reaped, and its failure (``failures[i]``, e.g. "data-parallel
replica 1 died (signal SIGKILL)", or the engine's own summary when its loop died) goes to the sink as an "exited"
message after everything it sent before. ``shutdown`` asks every replica to stop, waits ``STOP_GRACE_S``, then kills
what is left; it also runs at exit. Replicas are not daemonic processes (they start their own tensor-parallel
workers); they die with this process whatever ends it (``PR_SET_PDEATHSIG`` and the closed pipe).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, Callable

from minfer.config import EngineConfig
from minfer.engine.dp.replica import replica_main
from minfer.engine.dp.wire import decode_outputs
from minfer.engine.request_stream import EngineDeadError

logger = logging.getLogger("minfer.dp")

STOP_GRACE_S = 15.0  # a replica's current step, its engine thread and its tensor-parallel workers' own grace
Sink = Callable[[int, tuple[Any, ...]], None]


def replica_gpus(config: EngineConfig) -> list[str] | None:
    """Each replica's ``CUDA_VISIBLE_DEVICES`` value, or None off CUDA. Fails naming both fields when
    ``data_parallel_size`` x ``tensor_parallel_size`` GPUs are not visible (checked before any process starts; a
    replica's own config sees only its GPUs, so the engine's construction cannot check it)."""
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    if "WORLD_SIZE" in os.environ:
        raise ValueError("data_parallel_size > 1 does not run under torchrun (WORLD_SIZE is set): start one server "
                         "per replica, or let minfer spawn the replicas' processes itself")
    if config.resolved_device().type != "cuda":
        return None
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else \
        [str(i) for i in range(torch.cuda.device_count())]
    if dp * tp > len(ids):
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} GPUs; {len(ids)} are "
                         f"visible (CUDA_VISIBLE_DEVICES)")
    return [",".join(ids[i * tp:(i + 1) * tp]) for i in range(dp)]


class Replicas:
    """Handles on the replica processes (see the module's docstring), started at construction; ``wait_ready`` waits
    for their engines. ``final_only``: replicas send finished outputs only (``LLM``), not every step's deltas."""

    def __init__(self, config: EngineConfig, final_only: bool) -> None:
        self.size = size = config.data_parallel_size
        gpus = replica_gpus(config)
        self.failures: dict[int, str] = {}  # dead replica -> why, as a client may read it
        self.stats: list[dict[str, Any]] = [{} for _ in range(size)]  # each one's latest snapshot (receiver threads)
        self._sink: Sink | None = None
        self._inbox: queue.SimpleQueue[tuple[int, tuple[Any, ...]]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the sink, the pending calls, the failures
        self._calls: dict[int, tuple[int, Future[Any]]] = {}  # call id -> (replica, its answer)
        self._call_ids = itertools.count()
        self._outboxes: list[queue.SimpleQueue[tuple[Any, ...] | None]] = [queue.SimpleQueue() for _ in range(size)]
        self._stopping = False
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        atexit.register(self.shutdown)
        ctx = multiprocessing.get_context("spawn")
        threads = max(1, (os.cpu_count() or 1) // (size * config.tensor_parallel_size))
        level = logging.getLogger("minfer").getEffectiveLevel()
        try:
            for i in range(size):
                conn, child = ctx.Pipe()
                proc = ctx.Process(target=replica_main, name=f"minfer-dp{i}", daemon=False,
                                   args=(dataclasses.replace(config, data_parallel_rank=i), child, os.getpid(), level,
                                         threads, final_only))
                env = {"CUDA_VISIBLE_DEVICES": gpus[i]} if gpus is not None else \
                    {"LOCAL_WORLD_SIZE": str(size * config.tensor_parallel_size)}  # its tp ranks' share of cores
                with _environ(env):
                    proc.start()
                child.close()  # this side holds one end only, so a dead replica's pipe reads EOF
                self.procs.append(proc)
                self.conns.append(conn)
            for i in range(size):
                threading.Thread(target=self._send_loop, args=(i,), name=f"minfer-dp{i}-send", daemon=True).start()
                threading.Thread(target=self._receive_loop, args=(i,), name=f"minfer-dp{i}-recv", daemon=True).start()
        except BaseException:
            self.shutdown(grace_s=0.0)
            raise

    # ---- messages ----------------------------------------------------------------------------
    def send(self, i: int, message: tuple[Any, ...]) -> None:
        """Queue ``message`` for replica ``i`` (in order with everything queued for it before)."""
        self._outboxes[i].put(message)

    def alive(self, i: int) -> bool:
        return i not in self.failures

    def set_sink(self, sink: Sink | None) -> None:
        """Where replica messages go from now on (None: the inbox ``get`` reads); what the inbox holds goes first."""
        with self._lock:
            while sink is not None:
                try:
                    sink(*self._inbox.get_nowait())
                except queue.Empty:
                    break
            self._sink = sink

    def get(self, timeout: float | None) -> tuple[int, tuple[Any, ...]] | None:
        """The next message from the inbox (with no sink set), or None after ``timeout`` seconds."""
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def call_all(self, fn: Callable[[Any], Any]) -> list[Future[Any]]:
        """``fn(engine)`` on every live replica's engine thread, between steps; one future per replica. ``fn`` must
        pickle (a module-level function, ``operator.methodcaller``, a ``functools.partial`` of those)."""
        fn_bytes = pickle.dumps(fn)
        futures = []
        with self._lock:
            for i in range(self.size):
                if not self.alive(i):
                    continue
                future: Future[Any] = Future()
                call_id = next(self._call_ids)
                self._calls[call_id] = (i, future)
                self.send(i, ("call", call_id, fn_bytes))
                futures.append(future)
        if not futures:
            raise EngineDeadError(f"the engine has stopped: {self.failure}")
        return futures

    @property
    def failure(self) -> str | None:
        """The dead replicas' failures, joined; None while all serve."""
        return "; ".join(self.failures[i] for i in sorted(self.failures)) if self.failures else None

    # ---- threads -----------------------------------------------------------------------------
    def _send_loop(self, i: int) -> None:
        outbox, conn = self._outboxes[i], self.conns[i]
        while (message := outbox.get()) is not None:
            try:
                conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
            except (OSError, ValueError):  # the replica is gone: its receiver reports it
                return

    def _receive_loop(self, i: int) -> None:
        conn, reason = self.conns[i], None
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break
            if message[0] == "call_done":
                self._settle(*message[1:])
                continue
            if message[0] == "stats":  # a snapshot: the latest is all anyone reads
                self.stats[i] = message[1]
                continue
            if message[0] == "out":  # a step's outputs, sent as tuples (wire.py)
                message = ("out", decode_outputs(message[1]), *message[2:])
            if message[0] == "dead":  # its engine loop died; the process exits next
                reason = message[1]
            self._deliver(i, message)
        if self._stopping:
            return
        proc = self.procs[i]
        proc.join(2.0)  # reaped, so that its exit status can be named
        code = proc.exitcode
        how = "ended" if code is None else f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        failure = f"data-parallel replica {i}: {reason}" if reason else f"data-parallel replica {i} died ({how})"
        logger.error("%s (pid %s); the other replicas go on serving", failure, proc.pid)
        with self._lock:
            self.failures[i] = failure
            dead = [call_id for call_id, (replica, _) in self._calls.items() if replica == i]
            for call_id in dead:
                self._calls.pop(call_id)[1].set_exception(EngineDeadError(f"the engine has stopped: {failure}"))
        self._deliver(i, ("exited", failure))

    def _deliver(self, i: int, message: tuple[Any, ...]) -> None:
        with self._lock:
            sink = self._sink
            if sink is None:
                self._inbox.put((i, message))
                return
        sink(i, message)

    def _settle(self, call_id: int, result: Any, error: BaseException | None) -> None:
        with self._lock:
            entry = self._calls.pop(call_id, None)
        if entry is not None:
            entry[1].set_result(result) if error is None else entry[1].set_exception(error)

    def wait_ready(self) -> list[dict[str, Any]]:
        """Every replica's facts (``ReplicaLoop.facts``), once all have built their engines; raises the first failure
        to start (the caller then shuts them all down)."""
        infos: list[dict[str, Any] | None] = [None] * self.size
        while any(info is None for info in infos):
            i, message = self._inbox.get()
            if message[0] == "ready":
                infos[i] = message[1]
                self.stats[i] = self.stats[i] or message[1]["stats"]
            elif message[0] == "start_failed":
                raise RuntimeError(f"data-parallel replica {i} failed to start: {message[1]}")
            elif message[0] in ("exited", "dead"):
                raise RuntimeError(f"{message[1]} while starting")
        logger.info("%d data-parallel replicas ready (pids %s)", self.size, [info["pid"] for info in infos])
        return infos  # type: ignore[return-value]

    def shutdown(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every replica: after its current step, or killed past ``grace_s``. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        for outbox in self._outboxes:
            outbox.put(("stop",))
            outbox.put(None)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                logger.warning("data-parallel replica %s did not stop in %.0f s: killed", proc.name, grace_s)
                proc.kill()
                proc.join(5.0)
        for conn in self.conns:
            conn.close()
        with self._lock:
            for _, future in self._calls.values():
                future.set_exception(EngineDeadError("the engine has been shut down"))
            self._calls.clear()


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while a child starts (it inherits them), then as they were."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
