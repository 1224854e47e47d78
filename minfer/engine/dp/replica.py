"""One data-parallel replica's process: an ordinary engine, with its own tensor-parallel workers, served over a pipe.

``launcher.Replicas`` spawns it with the replica's GPUs already in ``CUDA_VISIBLE_DEVICES`` and its index in
``config.data_parallel_rank``. Its engine loop is ``AsyncLLMEngine``'s own: ``ReplicaLoop`` runs ``_run`` on the main
thread, a reader thread feeds the command queue from the pipe (requests, aborts, calls, stop), and what the loop hands
its event loop (``_call_on_loop``: a step's outputs, a failed request, a call's answer, the loop's death) becomes a
message to the API side instead, so the step loop, its error recovery and its stats are the single engine's.

Messages are pickled with ``pickle`` itself, not multiprocessing's pickler (which would pass a pooled vector as a
shared-memory handle), one ``send_bytes`` each; a step's outputs as tuples (``wire.py``). Outputs go back as deltas
(the server's streams), or, for ``LLM`` (``final_only``), only the finished ones. The replica ignores Ctrl-C (its
launcher stops it), dies with its parent (``PR_SET_PDEATHSIG``, and the pipe closing), and its tensor-parallel
workers die with it.
"""
from __future__ import annotations

import copy
import functools
import logging
import os
import pickle
import signal
import threading
import time
from typing import Any

import torch

from minfer.config import EngineConfig
from minfer.engine.async_engine import AsyncLLMEngine
from minfer.engine.dp.wire import encode_outputs
from minfer.engine.llm_engine import LLMEngine
from minfer.engine.tp_workers import _die_with_parent, _set_process_name
from minfer.outputs import RequestOutput, RequestOutputKind

logger = logging.getLogger("minfer.dp")

STATS_INTERVAL_S = 0.05  # a replica's stats snapshot goes to the API side at most this often, when it changed


class Channel:
    """One end of a replica's pipe: whole pickled messages, one writer at a time."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError):  # the other side is gone: its own watch reacts
                pass

    def recv(self) -> tuple[Any, ...]:
        return pickle.loads(self.conn.recv_bytes())


def portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling both ways (an exception with a constructor of its own may not), else a
    builtin of its kind with its text, so the API side maps it to the same HTTP status."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - anything that does not round-trip
        kind = next((t for t in (ValueError, TypeError) if isinstance(error, t)), RuntimeError)
        return kind(f"{type(error).__name__}: {error}")


def replica_main(config: EngineConfig, conn: Any, parent_pid: int, log_level: int, num_threads: int,
                 final_only: bool) -> None:
    """The spawned process: build the engine, say ready (or why not), serve until told to stop or the loop dies."""
    index = config.data_parallel_rank
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the launcher stops us
    _set_process_name(f"minfer-dp{index}")
    logging.basicConfig(level=log_level, format=f"%(name)s[dp{index}]: %(message)s")
    torch.set_num_threads(num_threads)
    channel = Channel(conn)
    try:
        engine = LLMEngine(config, RequestOutputKind.DELTA)
    except BaseException as exc:  # noqa: BLE001 - the launcher names the replica and raises it
        logger.exception("data-parallel replica %d failed to start", index)
        channel.send(("start_failed", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    loop = ReplicaLoop(engine, channel, final_only)
    try:
        channel.send(("ready", loop.facts()))
        loop.serve()
    finally:
        engine.shutdown()
    if loop.error is not None:
        raise SystemExit(1)


class ReplicaLoop(AsyncLLMEngine):
    """``AsyncLLMEngine``'s engine loop with a pipe where its event loop would be (see the module's docstring)."""

    def __init__(self, engine: LLMEngine, channel: Channel, final_only: bool) -> None:
        super().__init__(engine)
        self.channel, self.final_only = channel, final_only
        self.observer = self  # on_step / on_abort below, called on the loop's thread
        self._step_tokens: tuple[list[int], float] = ([], 0.0)
        self._announced: set[str] = set()  # requests whose prompt the API side has had in an output already

    def facts(self) -> dict[str, Any]:
        """What the API side needs to check requests as this engine would, without loading the model itself."""
        engine = self.engine
        processor = copy.copy(engine.processor)
        processor.tokenizer = None  # the API side sets its own
        processor._max_token_chars = None
        return {"processor": processor, "eos_token_ids": engine.eos_token_ids, "max_model_len": engine.max_model_len,
                "pooler_config": engine.pooler.config if engine.pooler is not None else None,
                "stats": self.stats(), "pid": os.getpid()}

    def serve(self) -> None:
        self._thread = threading.current_thread()  # ``healthy`` reads it: this thread runs the loop
        if self.engine.workers is not None:  # a tensor-parallel worker that dies while the loop idles wakes it
            self.engine.workers.on_failure = functools.partial(self._commands.put, ("wake",))
        threading.Thread(target=self._read, name="minfer-dp-read", daemon=True).start()
        threading.Thread(target=self._report, name="minfer-dp-stats", daemon=True).start()
        self._run()

    def _read(self) -> None:
        """Pipe -> command queue. The pipe closing (the API side has gone) stops the loop."""
        while True:
            try:
                message = self.channel.recv()
            except (EOFError, OSError):
                self._commands.put(("stop",))
                return
            if message[0] != "call":
                self._commands.put(message)
                continue
            _, token, fn_bytes = message
            try:
                fn = pickle.loads(fn_bytes)
            except Exception as exc:  # noqa: BLE001 - a function this process cannot import: the caller's error
                self.channel.send(("call_done", token, None, portable(exc)))
                continue
            self._commands.put(("call", fn, token))

    def _report(self) -> None:
        """The stats snapshot to the API side whenever the loop has refreshed it (every step, every command burst),
        and while the last second's output rate it carries is not yet back to 0 (an idle loop refreshes nothing)."""
        sent, rate = None, 0.0
        while True:
            time.sleep(STATS_INTERVAL_S)
            snapshot = self._stats
            if snapshot is not sent or rate:
                sent, stats = snapshot, self.stats()
                rate = stats["generation_tokens_per_s"]
                self.channel.send(("stats", stats))

    # ---- EngineObserver: on the loop's thread --------------------------------------------------
    def on_step(self, outputs: list[RequestOutput], new_tokens: list[int], now: float) -> None:
        self._step_tokens = (new_tokens, now)  # sent with the outputs, for the API side's metrics

    def on_abort(self, request_id: str) -> None:
        self._announced.discard(request_id)
        if not self.final_only:
            self.channel.send(("aborted", request_id))

    # ---- what AsyncLLMEngine hands its event loop, sent over the pipe instead ------------------
    def _call_on_loop(self, fn: Any, *args: Any) -> None:
        name = getattr(fn, "__name__", "")
        if name == "_deliver":  # a step's outputs; ``on_step`` has just stashed their token counts
            (outputs,), (new_tokens, now) = args, self._step_tokens
            if self.final_only:
                kept = [k for k, out in enumerate(outputs) if out.finished]
                outputs, new_tokens = [outputs[k] for k in kept], [new_tokens[k] for k in kept]
            self._strip_prompts(outputs)
            if outputs:
                self.channel.send(("out", encode_outputs(outputs), new_tokens, now))
        elif name == "_fail":  # followed: the step's "abort" output for it comes next (a grammar that failed)
            request_id, error = args
            self.channel.send(("fail", request_id, portable(error), request_id in self.engine.step_errors))
        elif name == "_fail_each":
            request_ids, error = args
            self.channel.send(("fail_each", list(request_ids), portable(error)))
        elif name == "_settle":
            token, result, error = args
            try:
                self.channel.send(("call_done", token, result, None if error is None else portable(error)))
            except Exception as exc:  # noqa: BLE001 - a result that does not pickle
                self.channel.send(("call_done", token, None, portable(exc)))
        elif name == "_died":
            self.channel.send(("dead", self.failure or "the engine loop died"))
        else:
            raise AssertionError(f"ReplicaLoop does not forward {name or fn!r}")

    def _strip_prompts(self, outputs: list[RequestOutput]) -> None:
        """A request's prompt goes back with its first and its finished output only (where the API side's metrics
        read its length); the deltas between carry none, and the API side puts its own copy back: a long prompt is
        not pickled again at every step."""
        announced = self._announced
        for out in outputs:
            if out.finished:
                announced.discard(out.request_id)
            elif out.request_id in announced:
                out.prompt, out.prompt_token_ids = None, []
            else:
                announced.add(out.request_id)
