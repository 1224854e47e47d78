"""Tensor parallelism's processes: rank 0 (the engine) starts, watches and stops ranks 1..N-1.

Two ways in, one process model:
- ``tensor_parallel_size=N`` alone: the engine spawns N-1 worker processes on this node (GPU r for
  rank r) and meets them over ``tcp://127.0.0.1``.
- under ``torchrun`` (``WORLD_SIZE`` set, one node or many): every rank runs the same command; the
  ranks meet through torchrun's env:// rendezvous, rank 0 goes on as the engine (and server), and
  the others turn into workers inside ``LLMEngine``'s constructor and exit when rank 0 stops.

Each worker builds a ``ModelRunner`` over its shard and ``follow``s rank 0's step channel. Faults
fail fast and name the rank: a dead worker is seen at once (its process sentinel here, or the closed
gloo socket), a stuck one by the time limit on the model's collectives (``MINFER_TP_TIMEOUT``,
seconds, default 30; NCCL aborts its communicator then). Waiting for the next step has no limit,
since a server may idle for hours. Workers ignore Ctrl-C (rank 0 stops them) and die with rank 0
(``PR_SET_PDEATHSIG``), so no shutdown path leaves one behind.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch

from minfer.config import EngineConfig, ModelConfig
from minfer.distributed import SINGLE, Command, StepChannel, TensorParallel
from minfer.distributed.channel import NO_TIMEOUT
from minfer.engine.gc_heap import heap_frozen

logger = logging.getLogger("minfer")

TIMEOUT_S = float(os.environ.get("MINFER_TP_TIMEOUT", "30"))


class TensorParallelError(RuntimeError):
    """A worker died or stopped answering: the engine cannot go on. ``summary`` names the failure as a
    client may read it: no pid, and not the underlying error's text, which can hold build paths."""

    def __init__(self, message: str, summary: str = "a tensor-parallel step failed") -> None:
        super().__init__(message)
        self.summary = summary


def shardable(config: ModelConfig, size: int) -> bool:
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    mlps = [config.intermediate_size] if len(config.moe_layers) < config.num_hidden_layers else []
    mlps += [config.moe_intermediate_size] if config.moe_layers else []
    return heads % size == 0 and (kv % size == 0 or size % kv == 0) and all(i % size == 0 for i in mlps)


def check_tensor_parallel(config: ModelConfig, size: int, device: torch.device) -> None:
    """Fail at construction, naming the field and the allowed values, before any process starts."""
    if not shardable(config, size):
        allowed = [n for n in range(1, 65) if shardable(config, n)]
        raise ValueError(
            f"tensor_parallel_size={size} does not shard this model ({config.num_attention_heads} attention heads, "
            f"{config.num_key_value_heads} KV heads, MLP {config.intermediate_size}, expert MLP "
            f"{config.moe_intermediate_size}): it must divide the attention "
            f"heads and the MLP width, and divide or be a multiple of the KV heads; allowed: {allowed}")
    if device.type == "cuda" and "WORLD_SIZE" not in os.environ and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; {torch.cuda.device_count()} are visible "
                         f"(CUDA_VISIBLE_DEVICES); across nodes, start the ranks with torchrun")


@dataclass(slots=True)
class Parallel:
    """What the engine's runner needs from the set-up; ``workers`` is None at size 1."""

    tp: TensorParallel = SINGLE
    channel: StepChannel | None = None
    device: torch.device | None = None
    workers: "Workers | None" = None


def start_tensor_parallel(config: EngineConfig, model_config: ModelConfig, model_dir: Path,
                          max_model_len: int) -> Parallel:
    """Rank 0's set-up (nothing at all at size 1). Under torchrun on a rank > 0 this runs the worker
    until rank 0 shuts down, then raises SystemExit: the rest of the caller's program is rank 0's."""
    size = config.tensor_parallel_size
    device = config.resolved_device()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        if size != world:
            raise ValueError(f"tensor_parallel_size ({size}) must equal torchrun's WORLD_SIZE ({world}): every "
                             f"rank holds one shard")
        check_tensor_parallel(model_config, size, device)
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        tp, channel, dev = init_rank("env://", rank, size, local, device.type)
        if rank > 0:
            _serve_as_worker(config, model_config, model_dir, max_model_len, tp, channel, dev)
            raise SystemExit(0)
        return Parallel(tp, channel, dev, Workers([], channel, tp))
    if size == 1:
        return Parallel()
    check_tensor_parallel(model_config, size, device)
    if torch.distributed.is_initialized():
        raise ValueError("tensor_parallel_size > 1: this process already belongs to a process group (another "
                         "tensor-parallel engine is running here: call its LLM's shutdown() first)")
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = multiprocessing.get_context("spawn")
    ready = [ctx.Event() for _ in range(1, size)]
    procs = [ctx.Process(target=worker_main, name=f"minfer-tp{rank}", daemon=True,
                         args=(config, model_config, model_dir, max_model_len, init, rank, size, ready[rank - 1],
                               logging.getLogger("minfer").getEffectiveLevel()))
             for rank in range(1, size)]
    for p in procs:
        p.start()
    workers = Workers(procs, None, None)
    try:
        workers.wait_started(ready)
        tp, channel, dev = init_rank(init, 0, size, 0, device.type)
    except BaseException:
        workers.shutdown()
        raise
    workers.channel, workers.tp = channel, tp
    workers.watch()
    return Parallel(tp, channel, dev, workers)


def init_rank(init_method: str, rank: int, size: int, local_rank: int, device_type: str
              ) -> tuple[TensorParallel, StepChannel, torch.device]:
    """Join the group: the model's collectives on NCCL (GPUs) or gloo (CPU), with the time limit;
    the step channel on a gloo group without one."""
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))  # the ranks share the cores
    torch.distributed.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                         timeout=timedelta(seconds=TIMEOUT_S))
    channel = StepChannel(torch.distributed.new_group(backend="gloo", timeout=NO_TIMEOUT), TIMEOUT_S)
    return TensorParallel(rank, size, torch.distributed.group.WORLD), channel, device


def worker_main(config: EngineConfig, model_config: ModelConfig, model_dir: Path, max_model_len: int,
                init_method: str, rank: int, size: int, started: object, log_level: int) -> None:
    """A spawned worker process: join the group, build this rank's runner, follow rank 0."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 stops us
    _set_process_name(f"minfer-tp{rank}")
    logging.basicConfig(level=log_level, format=f"%(name)s[tp{rank}]: %(message)s")
    started.set()
    tp, channel, device = init_rank(init_method, rank, size, rank, config.resolved_device().type)
    _serve_as_worker(config, model_config, model_dir, max_model_len, tp, channel, device)


def _serve_as_worker(config: EngineConfig, model_config: ModelConfig, model_dir: Path, max_model_len: int,
                     tp: TensorParallel, channel: StepChannel, device: torch.device) -> None:
    from minfer.engine.model_runner import ModelRunner  # the runner imports this module's names
    from minfer.engine.spec.factory import make_draft

    draft = make_draft(config, model_config, max_model_len, device, tp)  # rank 0's order: draft, runner, attach
    runner = ModelRunner(model_config, config, model_dir, max_model_len, tp, channel, device, draft)
    if draft is not None:
        draft.attach(runner)
    try:
        with heap_frozen():  # its start-up heap out of the cyclic collector, as rank 0's loop (gc_heap.py)
            runner.follow()
    finally:
        torch.distributed.destroy_process_group()


class Workers:
    """Rank 0's handle on the other ranks: watch them, name the one that failed, stop them all."""

    def __init__(self, procs: list, channel: StepChannel | None, tp: TensorParallel | None) -> None:
        self.procs, self.channel, self.tp = procs, channel, tp
        self.error: TensorParallelError | None = None  # the first failure; the engine cannot go on after it
        self.on_failure: Callable[[], None] | None = None  # called on the watch thread when a worker dies
        self._stopping = False
        atexit.register(self.shutdown)

    def wait_started(self, ready: list) -> None:
        """Until every worker has imported and is about to join (a worker that dies on the way fails
        this at once, where the rendezvous would wait out its time limit)."""
        while not all(e.is_set() for e in ready):
            dead = self._dead()
            if dead:
                raise TensorParallelError(f"tensor-parallel {dead[0]} while starting", dead[1])
            time.sleep(0.02)

    def watch(self) -> None:
        if self.procs:
            threading.Thread(target=self._watch, name="minfer-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        ended = multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self._stopping:
            return
        for p in self.procs:
            if p.sentinel in ended:
                p.join(1.0)  # reaped, so that its exit code can be named
        dead = self._dead() or ("worker ended", "a tensor-parallel worker died")
        error = TensorParallelError(f"tensor-parallel {dead[0]}", dead[1])
        self.error = self.error or error  # a step that failed on the closed socket may have named it first
        logger.error("%s; the engine stops", error)
        if self.on_failure is not None:
            self.on_failure()
        if self.tp is not None and torch.distributed.get_backend(self.tp.group) == "nccl":
            try:  # a collective waiting on the dead rank would spin on the GPU forever
                torch.distributed.distributed_c10d._abort_process_group(self.tp.group)
            except Exception as exc:  # noqa: BLE001 - best effort; the engine fails either way
                logger.warning("could not abort the NCCL communicator: %r", exc)

    def _dead(self) -> tuple[str, str] | None:
        """The first dead worker found: (its description for the log, its summary for a client), or None."""
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                code = p.exitcode
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                return (f"worker rank {rank} (pid {p.pid}) exited with {how}",
                        f"a tensor-parallel worker died (rank {rank}, {how})")
        return None

    @property
    def failure(self) -> str | None:
        return None if self.error is None else str(self.error)

    def check(self) -> None:
        if self.error is not None:
            raise TensorParallelError(str(self.error), self.error.summary)

    def explain(self, exc: BaseException) -> TensorParallelError:
        """The error to raise for ``exc`` from a step: which rank failed, or that one is stuck. Waits a
        moment for a worker whose socket closed to be reaped, so that its rank can be named."""
        deadline = time.monotonic() + 2.0
        while self._dead() is None and self.procs and time.monotonic() < deadline:
            time.sleep(0.02)
        dead = self._dead()
        if dead is not None:
            error = TensorParallelError(f"tensor-parallel {dead[0]}: {exc}", dead[1])
        elif "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            error = TensorParallelError(f"a tensor-parallel collective timed out after {TIMEOUT_S:g} s (a worker is "
                                        f"stuck; MINFER_TP_TIMEOUT sets the limit): {exc}",
                                        f"a tensor-parallel collective timed out after {TIMEOUT_S:g} s")
        else:
            error = TensorParallelError(f"a tensor-parallel step failed, so the ranks may disagree on what runs "
                                        f"next; the engine stops: {exc!r}")
        self.error = self.error or error
        return error

    def shutdown(self) -> None:
        """Tell the workers to stop, wait a little, then kill any that remain. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)  # nothing left to do at exit; and the exit hooks no longer hold it
        if self.channel is not None and self.error is None:  # after a failure they cannot follow: kill
            try:
                self.channel.send(Command.SHUTDOWN)
            except Exception:  # noqa: BLE001 - a worker is gone already; the kill below covers the rest
                pass
            deadline = time.monotonic() + 5.0  # one grace period for all of them
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        if torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - the group may be broken by the failure that stopped us
                logger.warning("tearing down the tensor-parallel group: %r", exc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies, however that happens."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _set_process_name(name: str) -> None:
    """The name ps and /proc/<pid>/comm show (PR_SET_NAME), so a worker is easy to find."""
    try:
        ctypes.CDLL("libc.so.6").prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
