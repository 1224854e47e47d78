"""Grammar compiler processes: the pool that the engine's ``GrammarCompiler`` drives, and each child's loop.

The child is a fresh interpreter (``python -m minfer.engine.grammar_worker FD``), never a fork: the engine
holds CUDA and torch threads, which a fork would copy half-alive. It is started by ``subprocess`` and not by
``multiprocessing``'s spawn, which re-imports the parent's ``__main__`` in the child: a user's script that
builds its ``LLM`` without a ``__main__`` guard would load the model again in every compiler process.
The two ends talk over a socket pair through ``multiprocessing.connection`` (pickled messages):

    child -> parent   ("started",)                      imports done (xgrammar pulls in torch: most of it)
    parent -> child   ("init", tokenizer_info_json)     once; the child builds its xgrammar.GrammarCompiler
    child -> parent   ("ready",)
    parent -> child   ("compile", job_id, key)          key: StructuredOutputsParams.key
    child -> parent   ("done", job_id, seconds, json) | ("failed", job_id, message)

The child needs no tokenizer: xgrammar's ``TokenizerInfo`` travels as JSON, and so does each
``CompiledGrammar``, which the parent reads back against its own ``TokenizerInfo``. A child whose parent
is gone (the socket closes, or the parent died without closing it) exits.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable

logger = logging.getLogger("minfer")

COMPILE_THREADS = 2  # xgrammar's threads per compile (each child runs one compile at a time)
MAX_PROCESSES = 3  # children at most (each imports xgrammar, which imports torch and transformers: ~270 MB RSS)
SLOW_AFTER = 0.25  # seconds every child has been busy before a spare starts
IDLE_EXIT = 60.0  # seconds an idle child beyond the first lives
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CompilerProcess:
    """The parent's handle on one child: its process, its connection, and what it is doing."""

    def __init__(self) -> None:
        parent_end, child_end = socket.socketpair()
        env = dict(os.environ)  # this minfer, wherever the parent found it
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (_PACKAGE_ROOT, env.get("PYTHONPATH"))))
        try:
            argv = [sys.executable, "-m", "minfer.engine.grammar_worker", str(child_end.fileno())]
            self.proc = subprocess.Popen(argv, pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL, env=env)
        finally:
            child_end.close()
        self.conn = Connection(parent_end.detach())
        self.pid = self.proc.pid
        self.state = "starting"  # -> "ready" (idle) | "busy"
        self.job: Any = None  # the job it compiles while busy
        self.since = time.monotonic()  # when it entered its state

    def send(self, message: tuple) -> None:
        self.conn.send(message)

    def kill(self) -> None:
        """Kill and reap the child (SIGKILL: a compile in xgrammar's C++ does not return to hear anything
        gentler)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()

    def exit_reason(self) -> str:
        """How the (dead) child ended, in words: 'signal SIGSEGV', 'exit code 1'."""
        code = self.proc.wait()
        if code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit code {code}"


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


class CompilerPool:
    """The children and the one thread that drives them: it hands queued compiles to idle children, reads
    their answers, kills those past their deadline or cancelled, and starts children as needed. Callers on
    other threads only queue, cancel and read, under ``_lock``."""

    def __init__(self, tokenizer_info: Callable[[], Any], on_compiled: Callable[[float], None], timeout: float,
                 max_processes: int = MAX_PROCESSES) -> None:
        """``tokenizer_info`` builds the xgrammar.TokenizerInfo (on the thread, when the first child asks);
        ``on_compiled`` hears each compile's seconds (on the thread)."""
        self.timeout = timeout
        self.max_processes = max_processes
        self._tokenizer_info = tokenizer_info
        self._on_compiled = on_compiled
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

    def stop(self) -> None:
        if threading.current_thread() is self._thread:  # a collection ran the finalizer here, maybe under the
            self._stopping = True  # lock: the loop's own exit kills the children
            self._wake()
            return
        with self._lock:
            self._stopping = True
            thread = self._thread
        self._wake()
        if thread is not None:
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
            elif worker.job is None:
                logger.warning("an idle grammar compiler process %d died (%s)", worker.pid, reason)
            return
        kind = message[0]
        if kind == "started":
            if self._info is None:
                try:
                    self._info = self._tokenizer_info()
                    self._info_json = self._info.serialize_json()
                except Exception as exc:  # noqa: BLE001 - the tokenizer could not be read: nothing can compile
                    logger.exception("the tokenizer's grammar view could not be built")
                    self._workers.remove(worker)
                    worker.kill()
                    self._fail_queued(exc)
                    return
            try:
                worker.send(("init", self._info_json))
            except OSError:  # it died: its end of the socket reports it
                pass
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
            self._on_compiled(message[2])
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


# ---- the child ----------------------------------------------------------------------------------
def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone, even in the middle of a compile (the socket alone is read only
    between compiles)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _compile(compiler: Any, key: tuple[str, str]) -> tuple[float, str]:
    from minfer.structured_grammar import build_grammar

    grammar = build_grammar(*key)  # the grammar StructuredOutputsParams checked
    started = time.perf_counter()
    compiled = compiler.compile_grammar(grammar)
    return time.perf_counter() - started, compiled.serialize_json()


def main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the server's terminal is the parent's to handle
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    import xgrammar

    conn.send(("started",))
    try:
        _, info_json = conn.recv()
        info = xgrammar.TokenizerInfo.deserialize_json(info_json)
        compiler = xgrammar.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)  # the parent caches
        conn.send(("ready",))
        while True:
            _, job_id, key = conn.recv()
            try:
                seconds, compiled = _compile(compiler, tuple(key))
            except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError with its own message
                conn.send(("failed", job_id, str(exc).strip() or type(exc).__name__))
                continue
            conn.send(("done", job_id, seconds, compiled))
    except (EOFError, OSError):  # the parent closed its end: shut down
        return


if __name__ == "__main__":
    main(int(sys.argv[1]))
