"""Start a server in a child process for the benchmark, wait until it is healthy, stop it after.

A child process, not a thread: the benchmark's clients and the server's event loop and engine
thread would otherwise share one GIL, and the latencies measured would be partly our own. Not a
daemonic one, since the server's tensor-parallel workers are its own children: it is stopped on
the way out of ``launched_server``, at exit, and (SIGTERM from the kernel) when this process dies.
The child gets the engine arguments as a dict (multiprocessing 'spawn'), so every engine flag
of the command line reaches it unchanged.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import functools
import multiprocessing
import signal
import time
import urllib.error
from pathlib import Path
from typing import Any, Iterator

from minfer.benchmark.sse_client import get_json
from minfer.benchmark.workload import BENCH_MAX_MODEL_LEN
from minfer.engine_args import EngineArgs, engine_kwargs


@contextlib.contextmanager
def launched_server(args: argparse.Namespace) -> Iterator[str]:
    """Yield the base URL: ``args.base_url`` as is, or that of a server launched for the run."""
    if not args.launch:
        yield (args.base_url or "http://127.0.0.1:8000").rstrip("/")
        return
    from minfer.server.run import require_server_extra

    require_server_extra()
    EngineArgs.from_cli_args(args)  # a bad flag fails here, not in the child after a shape's checkpoint is written
    model, kwargs = args.model, engine_kwargs(args)
    if args.shape:
        from minfer.benchmark.shapes import shape_checkpoint

        model = str(shape_checkpoint(args.shape, Path(args.checkpoint_dir), kwargs["load_format"]))
        kwargs["skip_tokenizer_init"] = True  # random-weight shapes come without a tokenizer
        kwargs["max_model_len"] = kwargs["max_model_len"] or BENCH_MAX_MODEL_LEN  # as `minfer bench` does
    ctx = multiprocessing.get_context("spawn")
    # Not daemonic: a daemonic process may not start children, and the server's tensor-parallel workers
    # are its children. So it is stopped here (and at exit, and by the kernel should this process die).
    proc = ctx.Process(target=_serve_child, name="minfer-serve",
                       args=(model, kwargs, "127.0.0.1", args.port),
                       kwargs=dict(max_waiting_requests=None, log_level="warning", access_log=False))
    proc.start()
    stop = functools.partial(_stop, proc)
    atexit.register(stop)  # before multiprocessing's own exit hook, which would wait for the child forever
    base_url = f"http://127.0.0.1:{args.port}"
    try:
        _wait_healthy(base_url, proc, args.launch_timeout)
        yield base_url
    finally:
        stop()
        atexit.unregister(stop)


def _serve_child(*args: Any, **kwargs: Any) -> None:
    """The child's body: ``run_server``, with SIGTERM (a graceful stop) sent by the kernel should the
    benchmark die first, however it dies."""
    from minfer.server.run import run_server

    with contextlib.suppress(OSError, AttributeError):  # Linux only
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    run_server(*args, **kwargs)


def _stop(proc: multiprocessing.process.BaseProcess) -> None:
    """SIGTERM (the server stops gracefully, its workers with it); SIGKILL if it is still there after 30 s."""
    if proc.pid is None or proc.exitcode is not None:
        return
    proc.terminate()
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _wait_healthy(base_url: str, proc: multiprocessing.process.BaseProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.is_alive():
            raise RuntimeError(f"the launched server exited with code {proc.exitcode} before becoming healthy")
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            if get_json(base_url + "/health", timeout=2.0).get("status") == "ok":
                return
        time.sleep(0.25)
    raise TimeoutError(f"the launched server was not healthy after {timeout:.0f} s")
