"""``minfer serve --tensor-parallel-size 2`` as a real process tree: the server (rank 0) and its worker.

On the CPU the ranks are processes over gloo. Checked here from outside, as an operator sees it:
greedy tokens equal one process's, /metrics and /stats report the world size, a killed worker fails the
requests in flight with 5xx errors (never a hang) and ends the server with a failure status (for a
supervisor to restart it), and SIGTERM, Ctrl-C or a dead worker leave no process behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

openai = pytest.importorskip("openai")

from minfer.server.run import ENGINE_DEAD_EXIT_STATUS  # noqa: E402

from .procs import descendants, free_port, kill_left, proc_stat, still_running, wait_healthy  # noqa: E402

if not sys.platform.startswith("linux"):
    pytest.skip("reads /proc", allow_module_level=True)

NAME = "tiny-tp"
PROMPT = "def fibonacci(n):"
MAX_TOKENS = 12
ENGINE = ["--num-kv-blocks", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "256"]
START_TIMEOUT_S = 90.0  # two processes import torch and load the model on two shared cores
GONE_TIMEOUT_S = 20.0  # uvicorn's graceful 5 s, the engine thread, the workers' join


def _children(pid: int) -> dict[int, str]:
    """pid -> /proc/<pid>/comm of the live children of ``pid``."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None and st[1] == pid:
                try:
                    out[int(entry)] = Path(f"/proc/{entry}/comm").read_text().strip()
                except OSError:
                    pass
    return out


class TPServer:
    """``python -m minfer.cli serve ... --tensor-parallel-size 2`` in a subprocess, its log in a file."""

    def __init__(self, model: Path, log: Path, **popen: Any) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        cmd = [sys.executable, "-m", "minfer.cli", "-v", "serve", "--model", str(model),  # -v: run_server's log
               "--tensor-parallel-size", "2", "--port", str(self.port), "--served-model-name", NAME,
               "--no-access-log", "--uvicorn-log-level", "warning", *ENGINE]
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, **popen)
        self.tree: dict[int, tuple[str, Any]] = {}

    def wait_healthy(self) -> None:
        wait_healthy(self.proc, self.base_url, START_TIMEOUT_S, self.log)
        # every process the server started (the worker, multiprocessing's resource tracker): none may outlive it
        self.tree = {pid: (comm, proc_stat(pid)) for pid, comm in _children(self.proc.pid).items()}
        workers = [pid for pid, (comm, _) in self.tree.items() if comm == "minfer-tp1"]
        assert len(workers) == 1, f"expected one child named minfer-tp1, found {_children(self.proc.pid)}"
        self.worker = workers[0]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def client(self, timeout: float = 30.0) -> Any:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def alive(self, pid: int) -> bool:
        """Whether the process recorded as ``pid`` still runs (not merely a process that reuses the number)."""
        st, (_, first) = proc_stat(pid), self.tree[pid]
        return st is not None and first is not None and st[2] == first[2]

    def left(self) -> list[str]:
        return [f"{pid} ({comm})" for pid, (comm, _) in self.tree.items() if self.alive(pid)]

    def wait_gone(self) -> int:
        """Wait until the server and every process it started are gone; return the server's exit status."""
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while self.proc.poll() is None or self.left():
            assert time.monotonic() < deadline, (f"still running {GONE_TIMEOUT_S:.0f} s after the signal: server "
                                                 f"{self.proc.poll() is None}, {self.left()}\n{self.log()}")
            time.sleep(0.02)
        return self.proc.returncode

    def kill_all(self) -> None:
        """The test's own safety net: nothing survives a failed assertion."""
        for pid in self.tree:
            if self.alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture()
def start(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., TPServer]]:
    servers: list[TPServer] = []

    def _start(**popen: Any) -> TPServer:
        servers.append(TPServer(tiny_model, tmp_path / f"server{len(servers)}.log", **popen))
        servers[-1].wait_healthy()
        return servers[-1]

    yield _start
    for s in servers:
        s.kill_all()


def _tp1_reference(model: Path) -> Any:
    from minfer import LLM, SamplingParams

    llm = LLM(str(model), num_kv_blocks=64)
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0),
                        use_tqdm=False)[0].outputs[0]


def test_tp2_server_matches_tp1_reports_its_size_and_stops_on_sigterm(start: Callable[..., TPServer],
                                                                      tiny_model: Path) -> None:
    server = start()
    out = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                             logprobs=0)
    ref = _tp1_reference(tiny_model)
    (choice,) = out.choices
    assert out.usage.completion_tokens == len(ref.token_ids) == MAX_TOKENS and choice.finish_reason == "length"
    assert choice.text == ref.text
    expected = [step[token] for step, token in zip(ref.logprobs, ref.token_ids)]
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-3)  # the same tokens, the same odds

    metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    assert "\nminfer_tensor_parallel_size 2.0\n" in metrics, metrics
    assert httpx.get(server.base_url + "/stats", timeout=10).json()["tensor_parallel_size"] == 2

    # SIGTERM: uvicorn stops, then run_server stops the worker (where the default SIGTERM handler that
    # uvicorn puts back would end the server first, the worker dying with it), and the server ends as
    # SIGTERM ends a process
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait_gone() == -signal.SIGTERM, server.log()
    assert "the tensor-parallel workers have stopped" in server.log(), server.log()


def _watch_health_until_gone(server: TPServer) -> list[dict[str, Any]]:
    """/health's answers until the server stops answering (it exits), each checked to hide the internals."""
    bodies = []
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            health = httpx.get(server.base_url + "/health", timeout=5)
        except httpx.HTTPError:  # no longer listening
            break
        if health.status_code != 200:
            assert health.status_code == 503, health.text
            bodies.append(health.json())
            _assert_no_internals(health.text)
            assert health.json()["status"] == "engine_dead", health.json()
        time.sleep(0.02)
    return bodies


def _assert_no_internals(text: str) -> None:
    """A client sees what failed, never a build path, a source line or a traceback (those go to the log)."""
    assert "/" not in text and ".cc" not in text and ".py" not in text, text
    assert "Traceback" not in text and "pid" not in text, text


def test_a_worker_killed_while_idle_ends_the_server_with_a_failure_status(start: Callable[..., TPServer]) -> None:
    """The server exits non-zero (for a supervisor to restart it) instead of serving 503s forever; until then
    /health names the failure without internals; nothing it started is left behind."""
    server = start()
    client = server.client(timeout=10.0)  # a hang fails as a timeout
    assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, temperature=0).choices[0].text

    os.kill(server.worker, signal.SIGKILL)
    for body in _watch_health_until_gone(server):
        assert body["error"] == "a tensor-parallel worker died (rank 1, signal SIGKILL)", body
    assert server.wait_gone() == ENGINE_DEAD_EXIT_STATUS, server.log()
    log = server.log()
    assert "worker rank 1" in log and "SIGKILL" in log and "the server stops" in log, log
    assert "the tensor-parallel workers have stopped" in log, log


def test_a_worker_killed_mid_request_fails_the_requests_and_ends_the_server(start: Callable[..., TPServer]) -> None:
    """A streamed request ends with an error event, a whole one with a 5xx in OpenAI's error shape (never a
    hang), neither showing internals; then the server exits non-zero and leaves nothing behind."""
    server = start()
    client = server.client(timeout=10.0)
    whole: dict[str, Any] = {}

    def request_whole() -> None:
        try:
            whole["response"] = httpx.post(server.base_url + "/v1/completions", timeout=10.0,
                                           json={"model": NAME, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True})
        except httpx.HTTPError as exc:  # a hang, or the connection dropped without an answer
            whole["response"] = exc

    stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=480, temperature=0, stream=True)
    chunks = 0
    thread = threading.Thread(target=request_whole)
    with pytest.raises(openai.APIError) as info:  # the SSE error event, raised by the client
        for _ in stream:
            chunks += 1
            if chunks == 2:
                thread.start()
                deadline = time.monotonic() + 10.0
                while httpx.get(server.base_url + "/stats", timeout=5).json()["num_running"] < 2:
                    assert time.monotonic() < deadline, "the second request never ran"
                    time.sleep(0.02)
                os.kill(server.worker, signal.SIGKILL)
    assert chunks >= 2
    message = str(info.value)
    assert "a tensor-parallel worker died (rank 1, signal SIGKILL)" in message, message
    _assert_no_internals(message)
    thread.join(15.0)
    response = whole["response"]
    assert isinstance(response, httpx.Response), response
    assert response.status_code >= 500, response.text
    error = response.json()["error"]  # OpenAI's error shape
    assert {"message", "type", "param", "code"} <= error.keys() and error["code"] == "engine_dead", error
    assert "a tensor-parallel worker died (rank 1, signal SIGKILL)" in error["message"], error
    _assert_no_internals(error["message"])
    _watch_health_until_gone(server)
    assert server.wait_gone() == ENGINE_DEAD_EXIT_STATUS, server.log()
    assert "worker rank 1 (pid" in server.log(), server.log()  # the full text goes to the log


def test_ctrl_c_leaves_no_process_behind(start: Callable[..., TPServer]) -> None:
    server = start(start_new_session=True)  # its own process group, as a terminal's foreground job
    assert os.getpgid(server.worker) == server.proc.pid  # Ctrl-C reaches the worker too (it ignores it)
    os.killpg(server.proc.pid, signal.SIGINT)
    assert server.wait_gone() == 0, server.log()
    assert "the tensor-parallel workers have stopped" in server.log(), server.log()


def test_bench_serve_launches_a_tp2_server_and_stops_it(tiny_model: Path, tmp_path: Path) -> None:
    """The launched server is not a daemonic process (one may not start the worker) and still always stops."""
    port = free_port()
    cmd = [sys.executable, "-m", "minfer.cli", "bench-serve", "--launch", "--model", str(tiny_model),
           "--port", str(port), "--tensor-parallel-size", "2", *ENGINE, "--concurrency", "2", "--num-prompts", "4",
           "--warmup", "1", "--workload", "fixed", "--input-len", "16", "--output-len", "8", "--token-id-max", "299",
           "--quiet", "--output-dir", str(tmp_path)]
    log = tmp_path / "bench.log"
    with open(log, "wb") as f:  # a file, not a pipe nobody reads while it runs
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    seen: dict[int, tuple[int, str]] = {}
    deadline = time.monotonic() + 2 * START_TIMEOUT_S
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, "bench-serve --launch did not finish"
            seen.update(descendants(proc.pid))
            time.sleep(0.05)
        left = still_running(seen, grace_s=10.0)  # multiprocessing's resource tracker ends just after its parent
    finally:
        kill_left(seen)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text(errors="replace")[-4000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["levels"][0]["completed"] == 4 and report["levels"][0]["failed"] == 0, report["levels"]
    assert report["engine_stats_after"]["tensor_parallel_size"] == 2
    assert len(seen) >= 2, seen  # the server and its worker at least
    assert left == [], f"left behind by bench-serve: {left}"
