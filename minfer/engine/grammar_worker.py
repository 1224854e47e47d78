"""A grammar compiler process: both ends of the wire between the engine and one child that compiles.

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

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

COMPILE_THREADS = 2  # xgrammar's threads per compile (each child runs one compile at a time)
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


# ---- the child ----------------------------------------------------------------------------------
def _watch_parent(parent: int) -> None:
    """Exit when the parent is gone, even in the middle of a compile (the socket alone is read only
    between compiles)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _compile(compiler: Any, key: tuple[str, str]) -> tuple[float, str]:
    from minfer.structured_outputs import build_grammar

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
