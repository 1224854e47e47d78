"""The server over two data-parallel replicas (``--data-parallel-size 2``; on the CPU, two processes).

One in-process server serves the module (its last test kills one of its replicas): greedy completions, streams, n > 1,
structured outputs and LoRA adapters (loaded on both replicas) behave as one engine's; concurrent requests reach both
replicas, as the per-replica series of /metrics show; a repeated prefix stays on the replica that caches it; a killed
replica is named by /health, fails its requests in flight, and the other serves on. Then ``minfer serve
--data-parallel-size 2`` as a real process tree: SIGTERM stops every process, and a killed server's replicas exit.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from operator import methodcaller
from pathlib import Path
from typing import Any, Iterator

import pytest

openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")

import httpx  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import uvicorn  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minfer import LLM, SamplingParams  # noqa: E402
from minfer.config import EngineConfig  # noqa: E402
from minfer.engine.dp.engine import DataParallelLLMEngine  # noqa: E402
from minfer.lora import LoRARequest  # noqa: E402
from minfer.outputs import RequestOutputKind  # noqa: E402
from minfer.server.app import build_app  # noqa: E402
from minfer.server.http_protocol import http_protocol  # noqa: E402
from minfer.server.lora_modules import LoRAModulePath  # noqa: E402

from .conftest import ENGINE_ARGS, MODEL_NAME  # noqa: E402
from .procs import descendants, free_port, kill_left, proc_stat, still_running, wait_healthy  # noqa: E402

if not sys.platform.startswith("linux"):
    pytest.skip("reads /proc", allow_module_level=True)

ARGS: dict[str, Any] = dict(ENGINE_ARGS, enable_lora=True, max_loras=2, max_lora_rank=8)
GREEDY = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
CLIENT_GREEDY = dict(temperature=0.0, max_tokens=10, extra_body={"ignore_eos": True})  # the openai client's spelling
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The quick brown fox", "class Stack:"]
START_TIMEOUT_S = 90.0
GONE_TIMEOUT_S = 30.0


def _write_adapter(base: Path, folder: Path, seed: int, modules: list[str]) -> Path:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=modules, init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(str(folder))
    return folder


class DPServer:
    """A two-replica app on uvicorn in a thread of this process (the replicas are its child processes)."""

    def __init__(self, model: Path, lora_modules: list[LoRAModulePath]) -> None:
        self.engine = DataParallelLLMEngine(EngineConfig(model=str(model), data_parallel_size=2, **ARGS),
                                            RequestOutputKind.DELTA)
        self.app = build_app(self.engine, [MODEL_NAME], lora_modules=lora_modules, allow_runtime_lora_updating=True)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2,
                                                    http=http_protocol()))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.base_url + "/stats", timeout=10).json()

    def routed(self) -> list[int]:
        return [r["routed"] for r in self.stats()["replicas"]]

    def wait_idle(self) -> None:
        deadline = time.monotonic() + 20
        while (s := self.stats())["num_running"] or s["num_waiting"] or s["kv_blocks_used"]:
            assert time.monotonic() < deadline, s
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.engine.shutdown()


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dp-lora")
    return {"sql": _write_adapter(tiny_model, root / "sql", 1, ["q_proj", "v_proj", "down_proj"]),
            "chat": _write_adapter(tiny_model, root / "chat", 2, ["q_proj", "o_proj", "up_proj"])}


@pytest.fixture(scope="module")
def dp(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[DPServer]:
    server = DPServer(tiny_model, [LoRAModulePath("sql", str(adapters["sql"]))])
    pids = list(server.engine.pids)
    yield server
    server.stop()
    assert still_running({pid: (proc_stat(pid)[2], "replica") for pid in pids if proc_stat(pid)}, 5.0) == []


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Iterator[LLM]:
    """One engine, for what the replicas must equal."""
    with LLM(str(tiny_model), **ARGS) as llm:
        yield llm


@pytest.fixture()
def client(dp: DPServer) -> Any:
    return openai.OpenAI(base_url=dp.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _scrape(dp: DPServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(dp.base_url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _sample(scrape: dict[Any, float], name: str, **labels: str) -> float:
    return scrape[(name, tuple(sorted({"model_name": MODEL_NAME, **labels}.items())))]


def test_completions_streams_n_and_constraints_behave_as_one_engines(client: Any, reference: LLM) -> None:
    ref = reference.generate(PROMPTS, SamplingParams(**GREEDY, logprobs=0), use_tqdm=False)
    outs = [client.completions.create(model=MODEL_NAME, prompt=p, logprobs=0, **CLIENT_GREEDY) for p in PROMPTS]
    for out, r in zip(outs, ref):
        assert out.choices[0].text == r.outputs[0].text
        expected = [step[token] for step, token in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)]
        assert out.choices[0].logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], stream=True, **CLIENT_GREEDY)
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref[0].outputs[0].text
    both = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], n=2, **CLIENT_GREEDY)
    assert [c.text for c in both.choices] == [ref[1].outputs[0].text] * 2
    choice = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=8,
                                       extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert choice.choices[0].text in ("alpha", "beta")
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          **CLIENT_GREEDY)
    ref_chat = reference.chat([{"role": "user", "content": "hi"}], SamplingParams(**GREEDY), use_tqdm=False)
    assert chat.choices[0].message.content == ref_chat[0].outputs[0].text


def test_lora_adapters_are_loaded_on_every_replica(dp: DPServer, client: Any, reference: LLM,
                                                   adapters: dict[str, Path]) -> None:
    """--lora-modules at start-up and a load while serving both reach the two replicas; a request through an
    adapter gives one engine's output on either replica."""
    resp = httpx.post(dp.base_url + "/v1/load_lora_adapter", json={"lora_name": "chat",
                                                                   "lora_path": str(adapters["chat"])}, timeout=60)
    assert resp.status_code == 200, resp.text
    per_replica = [f.result(10) for f in dp.engine.replicas.call_all(methodcaller("list_loras"))]
    assert [sorted(r.lora_name for r in loras.values()) for loras in per_replica] == [["chat", "sql"]] * 2
    prompt = [5, 9, 17, 33, 2, 41, 8]  # under one block: no prefix affinity, so two at once go one to each replica
    dp.wait_idle()
    before = dp.routed()
    results: dict[str, Any] = {}
    threads = [threading.Thread(target=lambda name=name: results.update(
        {name: client.completions.create(model=name, prompt=prompt, **CLIENT_GREEDY).choices[0].text}))
        for name in ("sql", "chat")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [a - b for a, b in zip(dp.routed(), before)] == [1, 1]
    for lora_id, name in ((1, "sql"), (2, "chat")):
        lora = LoRARequest(name, lora_id, str(adapters[name]))
        out = reference.generate([{"prompt_token_ids": prompt}], SamplingParams(**GREEDY), use_tqdm=False,
                                 lora_request=lora)
        assert results[name] == out[0].outputs[0].text, name
    resp = httpx.post(dp.base_url + "/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=60)
    assert resp.status_code == 200, resp.text
    per_replica = [f.result(10) for f in dp.engine.replicas.call_all(methodcaller("list_loras"))]
    assert [sorted(r.lora_name for r in loras.values()) for loras in per_replica] == [["sql"]] * 2


def test_concurrent_requests_reach_both_replicas_as_their_metrics_show(dp: DPServer, client: Any) -> None:
    dp.wait_idle()
    before = _scrape(dp)
    texts = [f"{p} # request {k}" for k, p in enumerate(PROMPTS * 2)]
    threads = [threading.Thread(target=client.completions.create,
                                kwargs=dict(model=MODEL_NAME, prompt=t, **CLIENT_GREEDY)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    dp.wait_idle()
    after = _scrape(dp)
    done = {e: _sample(after, "vllm:request_success_total", engine=e, finished_reason="length")
            - _sample(before, "vllm:request_success_total", engine=e, finished_reason="length") for e in "01"}
    assert done["0"] > 0 and done["1"] > 0 and sum(done.values()) == len(texts), done
    for e in "01":  # vLLM's series once per engine; the totals are ours, unlabelled
        assert _sample(after, "vllm:prompt_tokens_total", engine=e) > _sample(before, "vllm:prompt_tokens_total",
                                                                             engine=e)
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            assert _sample(after, gauge, engine=e) == 0.0
    assert after[("minfer_num_requests_running", ())] == 0.0 and ("minfer_kv_cache_usage_ratio", ()) in after
    stats = dp.stats()
    assert stats["data_parallel_size"] == 2 and [r["alive"] for r in stats["replicas"]] == [True, True]
    assert stats["num_kv_blocks"] == 2 * ARGS["num_kv_blocks"]


def test_a_repeated_prefix_stays_on_the_replica_that_caches_it(dp: DPServer, client: Any) -> None:
    """A stream keeps replica 0 busy while the first prompt of a family goes to replica 1; then, all idle, where a
    tie would pick replica 0, the family's later prompts follow their prefix to replica 1 and hit its cache."""
    prefix = "class Stack:\n    def __init__(self):\n        self.items = []\n" * 4
    dp.wait_idle()
    before, hits = dp.routed(), _scrape(dp)
    busy = client.completions.create(model=MODEL_NAME, prompt="The lazy dog jumps over", stream=True,
                                     temperature=0.0, max_tokens=400,
                                     extra_body={"ignore_eos": True})
    next(iter(busy))
    assert [a - b for a, b in zip(dp.routed(), before)] == [1, 0]
    client.completions.create(model=MODEL_NAME, prompt=prefix + "    def pop(self):", **CLIENT_GREEDY)
    busy.close()  # the client leaves: its replica aborts the request
    dp.wait_idle()
    for k in range(4):
        client.completions.create(model=MODEL_NAME, prompt=prefix + f"    def peek{k}(self):", **CLIENT_GREEDY)
    assert [a - b for a, b in zip(dp.routed(), before)] == [1, 5]
    after = _scrape(dp)
    assert _sample(after, "vllm:prefix_cache_hits_total", engine="1") > \
        _sample(hits, "vllm:prefix_cache_hits_total", engine="1")
    assert _sample(after, "vllm:request_success_total", engine="0", finished_reason="abort") == \
        _sample(hits, "vllm:request_success_total", engine="0", finished_reason="abort") + 1


def test_a_killed_replica_is_named_fails_its_requests_and_the_other_serves_on(dp: DPServer, client: Any) -> None:
    """The module's last test: it kills replica 0 (SIGKILL) with a stream and a whole request in flight on it."""
    prefix = "for i in range(10):\n    print(i, os.getcwd(), sys.argv)\n" * 3
    dp.wait_idle()
    before = dp.routed()
    stream = client.completions.create(model=MODEL_NAME, prompt=prefix + "x = 1", stream=True, temperature=0.0,
                                       max_tokens=300, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    victim = [a - b for a, b in zip(dp.routed(), before)].index(1)
    whole: dict[str, Any] = {}

    def request_whole() -> None:  # the same prefix: it joins the stream's replica (within the affinity margin)
        whole["response"] = httpx.post(dp.base_url + "/v1/completions", timeout=30, json={
            "model": MODEL_NAME, "prompt": prefix + "y = 2", "max_tokens": 300, "ignore_eos": True})

    thread = threading.Thread(target=request_whole)
    thread.start()
    deadline = time.monotonic() + 20
    while dp.stats()["replicas"][victim]["num_running"] < 2:
        assert time.monotonic() < deadline, dp.stats()
        time.sleep(0.02)
    os.kill(dp.engine.pids[victim], signal.SIGKILL)
    name = f"data-parallel replica {victim} died (signal SIGKILL)"
    with pytest.raises(openai.APIError, match=name.replace("(", r"\(").replace(")", r"\)")):
        for _ in chunks:
            pass
    thread.join(30)
    response = whole["response"]
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == "engine_dead" and name in error["message"], error
    health = httpx.get(dp.base_url + "/health", timeout=10)
    assert health.status_code == 503 and health.json() == {"status": "engine_dead", "error": name}
    for _ in range(3):  # the other replica takes everything from now on
        assert client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **CLIENT_GREEDY).choices[0].text
    stats = dp.stats()
    assert [r["alive"] for r in stats["replicas"]] == [victim != 0, victim != 1] and not stats["healthy"]
    scrape = _scrape(dp)
    assert ("vllm:num_requests_running", (("engine", str(1 - victim)), ("model_name", MODEL_NAME))) in scrape
    assert ("vllm:num_requests_running", (("engine", str(victim)), ("model_name", MODEL_NAME))) not in scrape


class ServeProcess:
    """``python -m minfer.cli serve --data-parallel-size 2`` (or ``replicas``, a list of flags) in a subprocess, its
    log in a file."""

    def __init__(self, model: Path, log: Path, replicas: tuple[str, ...] = ("--data-parallel-size", "2")) -> None:
        self.port, self.log_path = free_port(), log
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "minfer.cli", "-v", "serve", "--model", str(model), *replicas,
               "--port", str(self.port), "--no-access-log", "--uvicorn-log-level", "warning", "--num-kv-blocks", "64",
               "--max-num-seqs", "4", "--max-num-batched-tokens", "256"]
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        wait_healthy(self.proc, self.base_url, START_TIMEOUT_S, self.log)
        self.tree = descendants(self.proc.pid)
        names = sorted(name for _, name in self.tree.values())
        assert "minfer-dp0" in names and ("minfer-dp1" in names) == ("--data-parallel-size" in replicas), names

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill_all(self) -> None:
        kill_left(self.tree)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def test_sigterm_stops_the_server_and_every_replica(tiny_model: Path, tmp_path: Path) -> None:
    server = ServeProcess(tiny_model, tmp_path / "serve.log")
    try:
        out = httpx.post(server.base_url + "/v1/completions", timeout=30,
                         json={"prompt": PROMPTS[0], "max_tokens": 4}).json()
        assert out["choices"][0]["text"] is not None and json.dumps(out)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(GONE_TIMEOUT_S) == -signal.SIGTERM, server.log()
        assert still_running(server.tree, 5.0) == [], server.log()
        assert "the data-parallel replicas have stopped" in server.log(), server.log()
    finally:
        server.kill_all()


def test_the_replicas_of_a_killed_server_exit(tiny_model: Path, tmp_path: Path) -> None:
    """SIGKILL gives the server no chance to stop anything: its replicas watch for their parent's death."""
    server = ServeProcess(tiny_model, tmp_path / "serve.log")
    try:
        server.proc.kill()
        server.proc.wait(10)
        assert still_running(server.tree, 10.0) == [], server.log()
    finally:
        server.kill_all()


def test_engine_process_serves_and_stops(tiny_model: Path, tmp_path: Path) -> None:
    """``--engine-process``: one engine in a process of its own (a single replica) gives the in-process engine's
    greedy tokens, streamed too, and SIGTERM stops both processes."""
    with LLM(str(tiny_model), **ENGINE_ARGS) as llm:
        want = llm.generate([PROMPTS[0]], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].text
    server = ServeProcess(tiny_model, tmp_path / "serve.log", ("--engine-process",))
    try:
        body = {"prompt": PROMPTS[0], **GREEDY}
        out = httpx.post(server.base_url + "/v1/completions", timeout=30, json=body).json()
        assert out["choices"][0]["text"] == want and out["usage"]["completion_tokens"] == GREEDY["max_tokens"], out
        with httpx.stream("POST", server.base_url + "/v1/completions", timeout=30, json={**body, "stream": True}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == \
            out["choices"][0]["text"]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(GONE_TIMEOUT_S) == -signal.SIGTERM, server.log()
        assert still_running(server.tree, 5.0) == [], server.log()
        assert "the engine process has stopped" in server.log(), server.log()
    finally:
        server.kill_all()
