"""Structured outputs in the engine: grammars compiled off the step loop, one matcher per sample, and
each step's token bitmask.

The flow of one constrained request:

1. ``GrammarCompiler.submit`` hands its ``StructuredOutputsParams`` to a compiler process (xgrammar's compile
   precomputes, for every grammar state, which of the vocabulary's tokens fit: tens of milliseconds
   to minutes for a large schema and a 128k vocabulary), bounded in time and cancelled when its last
   waiting request is aborted. Equal constraints share one compile (``key``). The engine keeps the request
   out of the scheduler until the compile is done, so it never blocks the requests behind it.
2. Each sample gets its own ``xgrammar.GrammarMatcher`` (``Sequence.grammar``).
3. A step that samples a constrained row launches its forward first; while the GPU runs it the host
   completes the previous step (so every matcher has accepted every known token), fills the rows'
   bitmasks (``BitmaskFiller.fill``, on xgrammar's threads), and only then queues the sampling, which masks
   the logits (``sampler.apply_token_bitmask``) before anything else draws from them.
4. Each sampled token advances its sample's matcher (``advance``); a matcher that accepts a stop token
   terminates, which finishes the sample with reason "stop".

A matcher accepts exactly the tokens that end up in its sequence's ``token_ids``: tokens are accepted when
a step completes, and a token dropped in flight (its sequence stopped a step earlier) is never accepted,
so preemption (recompute keeps the tokens) and async scheduling need no rollback.
"""
from __future__ import annotations

import bisect
import copy
import logging
import socket
import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable

import torch

from minfer.config import cdiv
from minfer.engine.grammar_worker import CompilerProcess
from minfer.engine.sequence import Sequence
from minfer.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("minfer")

COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CACHE_SIZE = 256  # compiled grammars kept (least recently used goes first)
MAX_PROCESSES = 3  # compiler processes at most (each holds xgrammar and torch's CPU libraries: RSS below)
SLOW_AFTER = 0.25  # seconds a compile runs before a spare process starts beside it (if all are busy)
IDLE_EXIT = 60.0  # seconds an idle process beyond the first lives


class GrammarCompileError(ValueError):
    """A constraint that did not compile: past the time limit, or its compile killed the compiler process.
    A ValueError: what the constraint asked for is the cause, and the server answers it as a 400."""


@dataclass(eq=False)
class _Job:
    """One compile, queued or running in a child."""

    key: tuple[str, str]
    future: Future = field(default_factory=Future)
    limit: float = 0.0  # seconds it may run, and until when (monotonic): set when a child takes it
    deadline: float = 0.0
    cancelled: bool = False  # no request waits for it any more: its child is killed


class GrammarCompiler:
    """Compiles constraints in child processes (``grammar_worker``) and caches the results by key.

    A compile is bounded (``timeout`` seconds from the moment a child takes it: past it the child is killed
    and the request fails naming the limit), cancellable (``cancel``: a running compile's child is killed),
    and cannot take the engine down: a child that crashes (xgrammar's recursion on a hostile schema) fails
    the compile it ran and is replaced. Children start lazily (none until the first constrained request);
    while every child is busy on a compile that has run past ``SLOW_AFTER``, a spare starts (up to
    ``max_processes``), so a cheap compile never waits behind expensive ones for longer than a child's start-up.

    The tokenizer's xgrammar view (``TokenizerInfo``, a pass over the vocabulary) is built in this process,
    on the first constrained request, and sent to each child as JSON; the children's compiled grammars come
    back as JSON and are read back on a thread (xgrammar releases the GIL there), so the engine's loop only
    polls futures. The tokenizer is a copy: a Rust ``tokenizers`` object used from two threads at once (the
    engine's detokenizing) can fail with 'Already borrowed'."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int], timeout: float = 30.0,
                 max_processes: int = MAX_PROCESSES) -> None:
        self.vocab_size = vocab_size
        tokenizer, stop = copy.deepcopy(tokenizer), sorted(stop_token_ids)

        def tokenizer_info() -> Any:
            import xgrammar

            return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                           stop_token_ids=stop or None)

        self._pool = _CompilerPool(tokenizer_info, timeout, max_processes)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        # the pool's thread does not hold this object: dropping the compiler (or the interpreter's exit) stops it
        self._finalizer = weakref.finalize(self, self._pool.stop)

    @property
    def timeout(self) -> float:
        """Seconds a compile may run in its child; read when a child takes a compile."""
        return self._pool.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._pool.timeout = seconds

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``params``, as a future (an already compiled key returns its own)."""
        key = params.key
        future = self._cache.get(key)
        if future is not None and not (future.done() and (future.cancelled() or future.exception() is not None)):
            self._cache.move_to_end(key)
            return future
        future = self._cache[key] = self._pool.submit(key)
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def cancel(self, future: Future) -> bool:
        """Give up a compile nobody waits for: dropped from the queue, or its child killed. False when it had
        already finished."""
        return self._pool.cancel(future)

    def running(self) -> list[int]:
        """The processes running a compile now (a cancelled one no longer counts)."""
        return self._pool.running()

    def process_ids(self) -> list[int]:
        """The compiler processes alive now."""
        return self._pool.process_ids()

    def stats(self) -> dict[str, Any]:
        """The compile-time histogram (``compile_histogram``)."""
        return self._pool.stats()

    def shutdown(self) -> None:
        """Kill the children and stop the thread; compiles still pending are cancelled. Idempotent."""
        self._finalizer()


class _CompilerPool:
    """The children and the one thread that drives them: it hands queued compiles to idle children, reads
    their answers, kills those past their deadline or cancelled, and starts children as needed. Callers on
    other threads only queue, cancel and read, under ``_lock``."""

    def __init__(self, tokenizer_info: Callable[[], Any], timeout: float, max_processes: int) -> None:
        self.timeout = timeout
        self.max_processes = max_processes
        self._tokenizer_info = tokenizer_info
        self._info: Any = None  # xgrammar.TokenizerInfo, built on the thread
        self._info_json = ""
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._workers: list[CompilerProcess] = []
        self._stopping = False
        self._thread: threading.Thread | None = None  # started by the first submit
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="minfer-grammar-load")
        self.compile_counts = [0] * (len(COMPILE_BUCKETS) + 1)
        self.compile_seconds = 0.0

    # ---- callers' side (any thread) ------------------------------------------------------------
    def submit(self, key: tuple[str, str]) -> Future:
        job = _Job(key)
        with self._lock:
            if self._stopping:
                raise RuntimeError("the grammar compiler has been shut down")
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="minfer-grammar", daemon=True)
                self._thread.start()
        self._wake()
        return job.future

    def cancel(self, future: Future) -> bool:
        with self._lock:
            job = next((j for j in self._queue if j.future is future), None)
            if job is not None:
                self._queue.remove(job)
            else:
                job = next((w.job for w in self._workers if w.job is not None and w.job.future is future), None)
            if job is None or not future.cancel():
                return False
            job.cancelled = True  # the thread kills its child
        self._wake()
        return True

    def running(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._workers if w.job is not None and not w.job.cancelled]

    def process_ids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._workers]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return compile_histogram(list(self.compile_counts), self.compile_seconds)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            thread = self._thread
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        with self._lock:  # the thread is gone (or stuck): whatever it left
            self._kill_all()
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):  # already awake (a full buffer), or stopped
            pass

    # ---- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                    now = time.monotonic()
                    self._kill_overdue(now)
                    self._dispatch(now)
                    timeout = self._next_wakeup(now)
                    conns = {w.conn: w for w in self._workers}
                for ready in mp_wait([self._wake_r, *conns], timeout):
                    if ready is self._wake_r:
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except (BlockingIOError, OSError):
                            pass
                        continue
                    worker = conns[ready]
                    try:
                        message = worker.conn.recv()  # outside the lock: a big grammar is tens of MB
                    except (EOFError, OSError):
                        message = None
                    with self._lock:
                        if worker in self._workers:
                            self._on_message(worker, message)
        except Exception:  # noqa: BLE001 - never leave a waiter hanging
            logger.exception("the grammar compiler's thread failed; pending compiles fail")
        finally:
            with self._lock:
                self._stopping = True
                self._kill_all()

    def _on_message(self, worker: CompilerProcess, message: tuple | None) -> None:
        now = time.monotonic()
        if message is None:  # the child died
            self._workers.remove(worker)
            reason = worker.exit_reason()
            worker.conn.close()
            if worker.state == "starting":  # every child would: fail what waits instead of retrying forever
                logger.error("a grammar compiler process failed to start (%s)", reason)
                self._fail_queued(RuntimeError(f"the grammar compiler process failed to start ({reason}); "
                                               "see the server log"))
            elif worker.job is not None and not worker.job.cancelled:
                logger.error("the grammar compiler process %d died (%s) while compiling %s", worker.pid, reason,
                             _describe(worker.job.key))
                _settle(worker.job.future, error=GrammarCompileError(
                    f"structured_outputs: the grammar compiler process died ({reason}) while compiling this "
                    "constraint"))
            return
        kind = message[0]
        if kind == "started":
            try:
                if self._info is None:
                    self._info = self._tokenizer_info()
                    self._info_json = self._info.serialize_json()
                worker.send(("init", self._info_json))
            except Exception as exc:  # noqa: BLE001 - the tokenizer could not be read: nothing can compile
                logger.exception("the tokenizer's grammar view could not be built")
                self._workers.remove(worker)
                worker.kill()
                self._fail_queued(exc)
        elif kind == "ready":
            worker.state, worker.since = "ready", now
        else:  # "done" or "failed"
            job, worker.job = worker.job, None
            worker.state, worker.since = "ready", now
            if job is None or job.cancelled:
                return
            if kind == "failed":
                _settle(job.future, error=GrammarCompileError(f"structured_outputs: {message[2]}"))
                return
            seconds = message[2]
            self.compile_counts[bisect.bisect_left(COMPILE_BUCKETS, seconds)] += 1
            self.compile_seconds += seconds
            self._loader.submit(self._load, job.future, message[3])

    def _load(self, future: Future, compiled_json: str) -> None:
        """Read a compiled grammar back against this process's TokenizerInfo (on the loader thread)."""
        import xgrammar

        if future.cancelled():
            return
        try:
            _settle(future, xgrammar.CompiledGrammar.deserialize_json(compiled_json, self._info))
        except Exception as exc:  # noqa: BLE001 - reaches the request as its error
            _settle(future, error=exc)

    def _kill_overdue(self, now: float) -> None:
        """Kill the children whose compile was cancelled or is past its deadline, and extra idle ones."""
        idle = [w for w in self._workers if w.state == "ready"]
        for worker in list(self._workers):
            job = worker.job
            overdue = job is not None and now >= job.deadline
            if overdue and not job.cancelled:
                logger.warning("a structured-outputs compile ran past its %g s limit; killing its process (%s)",
                               job.limit, _describe(job.key))
                _settle(job.future, error=GrammarCompileError(
                    f"structured_outputs: the grammar did not compile within the limit of {job.limit:g} s "
                    "(structured_outputs_compile_timeout, --structured-outputs-compile-timeout)"))
            spare = worker in idle[1:] and now - worker.since >= IDLE_EXIT
            if (job is not None and (overdue or job.cancelled)) or spare:
                self._workers.remove(worker)
                worker.kill()

    def _dispatch(self, now: float) -> None:
        """Queued compiles to idle children; a child started where none is free and one is needed."""
        for worker in self._workers:
            if not self._queue:
                break
            if worker.state == "ready":
                job = self._queue.popleft()
                worker.state, worker.since, worker.job = "busy", now, job
                job.limit = self.timeout
                job.deadline = now + job.limit
                try:
                    worker.send(("compile", id(job), job.key))
                except OSError:  # it died: its end of the socket reports it, and the job fails with it
                    pass
        busy = [w for w in self._workers if w.state == "busy"]
        if len(busy) == len(self._workers) < self.max_processes and (
                (self._queue and not busy) or (busy and now - max(w.since for w in busy) >= SLOW_AFTER)):
            self._workers.append(CompilerProcess())

    def _next_wakeup(self, now: float) -> float | None:
        """Seconds until a deadline, the last busy child turning slow (when a spare could start) or an extra
        idle child's exit; None: only a message or a call wakes the thread."""
        times = [w.job.deadline for w in self._workers if w.job is not None]
        if self._workers and all(w.state == "busy" for w in self._workers) and len(self._workers) < self.max_processes:
            times.append(max(w.since for w in self._workers) + SLOW_AFTER)
        idle = [w for w in self._workers if w.state == "ready"]
        times += [w.since + IDLE_EXIT for w in idle[1:]]
        return max(0.0, min(times) - now) if times else None

    def _fail_queued(self, error: BaseException) -> None:
        while self._queue:
            _settle(self._queue.popleft().future, error=error)

    def _kill_all(self) -> None:
        """Kill every child and cancel what is still pending (under ``_lock``)."""
        for worker in self._workers:
            worker.kill()
            if worker.job is not None:
                worker.job.future.cancel()
        self._workers.clear()
        while self._queue:
            self._queue.popleft().future.cancel()


def _settle(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Finish a future unless it was cancelled meanwhile (an abort races the answer)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _describe(key: tuple[str, str]) -> str:
    kind, text = key
    return f"{kind} of {len(text)} characters"


def compile_histogram(counts: list[int] | None = None, total: float = 0.0) -> dict[str, Any]:
    """Compile times as Prometheus reads a histogram: cumulative counts per upper bound (the last is
    +inf), their sum and count (compiles only: a cached grammar costs none)."""
    cumulative, running = [], 0
    for bound, n in zip((*COMPILE_BUCKETS, float("inf")), counts or [0] * (len(COMPILE_BUCKETS) + 1)):
        running += n
        cumulative.append((bound, running))
    return {"buckets": cumulative, "sum": total, "count": running}


def new_matcher(compiled: Any) -> Any:
    import xgrammar

    return xgrammar.GrammarMatcher(compiled)


class BitmaskFiller:
    """Fills the token bitmask of a step's sampling rows: a constrained row allows what its matcher
    allows, every other row (unconstrained, or finished while the step was in flight) allows all.

    The host buffer is pinned (the upload must not wait for the forward the fill hides under), and it and
    the device buffer it uploads into are allocated once. Before the host buffer is refilled, the previous
    step's upload must have left it (an event; in practice long done: the previous step's draws, queued
    after that upload, have been read). The device buffer needs no wait: the next upload is queued on the
    same stream behind the previous step's sampling, the only reader of the mask."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        import xgrammar

        self.device = device
        cuda = device.type == "cuda"
        shape = (max_rows, cdiv(vocab_size, 32))
        self._host = torch.empty(shape, dtype=torch.int32, pin_memory=cuda)
        self._device = torch.empty(shape, dtype=torch.int32, device=device) if cuda else None
        self._uploaded = torch.cuda.Event() if cuda else None
        self._batch = xgrammar.BatchGrammarMatcher()

    def fill(self, seqs: list[Sequence]) -> torch.Tensor:
        """[len(seqs), ceil(vocab / 32)] int32 on the device (bit j of word w: token 32 w + j allowed)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        bitmask = self._host[:len(seqs)]
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None and not s.is_finished
                and not s.grammar.is_terminated()]
        if len(rows) == len(seqs):  # every row constrained: xgrammar writes them all
            self._batch.batch_fill_next_token_bitmask([s.grammar for s in seqs], bitmask)
        else:
            # numpy, not torch: a torch fill of this size runs on the intra-op thread pool, whose threads
            # then spin beside xgrammar's and slow its fill many times over (RESULTS.md, structured outputs)
            bitmask.numpy()[:] = -1
            if rows:
                self._batch.batch_fill_next_token_bitmask([seqs[i].grammar for i in rows], bitmask, rows)
        if self._uploaded is None:
            return bitmask.clone()  # the CPU: the buffer is reused, the mask must not change under the sampler
        on_device = self._device[:len(seqs)]
        on_device.copy_(bitmask, non_blocking=True)
        self._uploaded.record()
        return on_device


def advance(seq: Sequence, token: int) -> bool:
    """Feed a sampled token to the sample's matcher; True when the grammar has ended (a stop token)."""
    matcher = seq.grammar
    if not matcher.accept_token(token):  # the mask made this impossible: a bug, but not the caller's
        logger.error("sequence %d: token %d does not fit its grammar; ending it", seq.seq_id, token)
        return True
    return matcher.is_terminated()

