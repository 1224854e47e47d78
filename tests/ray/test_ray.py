"""minfer.ray on a local Ray of 2 CPUs: Ray Data's LLMPredictor and Ray Serve's serve_app, each against the offline
LLM on the built-in model (greedy, so the tokens must be equal), then nothing of Ray left running.

One Ray serves the whole module (it takes seconds to start). Its node address is the loopback one, so no traffic
leaves the machine; Serve's HTTP proxy listens on a free loopback port, never the default 8000.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

# Before Ray is imported: its node takes 127.0.0.1 (the address Ray uses where it runs no cluster) instead of the
# machine's outward one, and it reports no usage statistics.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import openai  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from minfer import LLM, SamplingParams  # noqa: E402
from minfer.llm import builtin_model_path  # noqa: E402
from minfer.ray import LLMPredictor, serve_app  # noqa: E402
from minfer.ray.serve import MinferServer, serve_app_kwargs  # noqa: E402

MODEL = str(builtin_model_path())
ENGINE: dict[str, Any] = dict(device="cpu", max_model_len=256, max_num_seqs=16)  # a small KV cache per replica
GREEDY: dict[str, Any] = dict(temperature=0.0, max_tokens=12)
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(", "# sort a list\n", "def main():",
           "x = [", "while True:"]
CHATS = [[{"role": "user", "content": "def add"}],
         [{"role": "system", "content": "code"}, {"role": "user", "content": "class Stack"}]]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")  # the built-in model's tokenizer has none
API_KEY = "ray-test-key"
SERVE_TITLES = ("ray::ServeReplica", "ray::ServeController", "ray::ProxyActor")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    with LLM(MODEL, **ENGINE) as llm:
        yield llm


def _texts(llm: LLM, prompts: list[Any], params: SamplingParams) -> list[tuple[str, int]]:
    return [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_ray_is_imported_only_when_used() -> None:
    code = "import sys, minfer, minfer.ray; assert 'ray' not in sys.modules; sys.modules['ray'] = None\n" \
           "try:\n    minfer.ray.serve_app\nexcept ImportError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 'pip install -e ".[ray]"' in out


def test_ray_data_equals_generate(local_ray: None, offline: LLM) -> None:
    """Two actors, batches of 3: every row keeps its columns and gets what one generate call gives it."""
    ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)])
    rows = ds.map_batches(LLMPredictor, fn_constructor_kwargs=dict(model=MODEL, sampling_params=GREEDY, **ENGINE),
                          compute=ray.data.ActorPoolStrategy(size=2), batch_size=3).take_all()
    rows.sort(key=lambda r: r["id"])
    assert [r["prompt"] for r in rows] == PROMPTS
    expected = _texts(offline, PROMPTS, SamplingParams(**GREEDY))
    assert [(r["generated_text"], r["num_generated_tokens"]) for r in rows] == expected
    assert all(n > 0 for _, n in expected)


def test_ray_data_token_ids_and_chats(local_ray: None, offline: LLM) -> None:
    """Chats through pyarrow batches (greedy with the model's repetition penalty, a SamplingParams), then token ids
    through pandas batches (a dict of SamplingParams' fields)."""
    defaults = dataclasses.replace(offline.get_default_sampling_params(), **GREEDY)
    ids = [offline.get_tokenizer().encode(p, add_special_tokens=False) for p in PROMPTS[:len(CHATS)]]
    items = [{"id": i, "messages": chat, "prompt_token_ids": t} for i, (chat, t) in enumerate(zip(CHATS, ids))]
    ds = ray.data.from_items(items)
    chat_args = dict(model=MODEL, input_column="messages", sampling_params=defaults, chat_template=TEMPLATE, **ENGINE)
    ds = ds.map_batches(LLMPredictor, fn_constructor_kwargs=chat_args,
                        batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=1), batch_size=4)
    ds = ds.rename_columns({"generated_text": "chat_text", "num_generated_tokens": "chat_tokens"})
    ds = ds.map_batches(LLMPredictor, fn_constructor_kwargs=dict(model=MODEL, sampling_params=GREEDY,
                                                                 input_column="prompt_token_ids", **ENGINE),
                        batch_format="pandas", compute=ray.data.ActorPoolStrategy(size=1), batch_size=4)
    rows = sorted(ds.take_all(), key=lambda r: r["id"])
    chats = [(o.outputs[0].text, len(o.outputs[0].token_ids))
             for o in offline.chat(CHATS, defaults, use_tqdm=False, chat_template=TEMPLATE)]
    assert [(r["chat_text"], r["chat_tokens"]) for r in rows] == chats
    expected = _texts(offline, [{"prompt_token_ids": t} for t in ids], SamplingParams(**GREEDY))
    assert [(r["generated_text"], r["num_generated_tokens"]) for r in rows] == expected


def test_predictor_refuses_what_it_cannot_write() -> None:
    with pytest.raises(ValueError, match="n must be 1"):
        LLMPredictor(model=MODEL, sampling_params={"n": 2}, **ENGINE)
    with pytest.raises(ValueError, match="input_column"):
        LLMPredictor(model=MODEL, input_column="text", **ENGINE)


def test_serve_run_arguments_are_read_from_text() -> None:
    """`serve run minfer.ray:app_builder key=value ...` hands every value over as text."""
    assert serve_app_kwargs({
        "model": MODEL, "tensor-parallel-size": "2", "enforce_eager": "true", "num_replicas": "auto",
        "max_model_len": "none", "served_model_name": "a,b", "allowed_hosts": '["x.example", "y.example"]',
        "autoscaling_config": '{"min_replicas": 1, "max_replicas": 3}', "gpu_memory_utilization": "0.5",
        "max_num_seqs": 8}) == {
        "model": MODEL, "tensor_parallel_size": 2, "enforce_eager": True, "num_replicas": "auto",
        "max_model_len": None, "served_model_names": ["a", "b"], "allowed_hosts": ["x.example", "y.example"],
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 3}, "gpu_memory_utilization": 0.5,
        "max_num_seqs": 8}
    with pytest.raises(ValueError, match="enforce_eager must be true or false"):
        serve_app_kwargs({"enforce_eager": "maybe"})


def test_serve_app_checks_before_deploying() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        serve_app(MODEL, max_num_seqs=0)
    with pytest.raises(ValueError, match="num_replicas"):
        serve_app(MODEL, data_parallel_size=2)
    with pytest.raises(ValueError, match="tool-call-parser"):
        serve_app(MODEL, enable_auto_tool_choice=True)


def test_a_dead_engine_fails_serves_health_check() -> None:
    """Serve then replaces the replica (``minfer serve`` would exit for its supervisor to restart it)."""
    server = MinferServer()
    engine = SimpleNamespace(healthy=False, failure="tensor-parallel worker 1 died (SIGKILL)", error=None)
    server.app = SimpleNamespace(state=SimpleNamespace(ctx=SimpleNamespace(engine=engine)))  # Serve's wrapper sets it
    with pytest.raises(RuntimeError, match=r"worker 1 died \(SIGKILL\)"):
        server.check_health()
    engine.healthy = True
    server.check_health()


def test_serve_answers_the_openai_client(local_ray: None, offline: LLM) -> None:
    """Completions (whole and streamed) and a chat through Serve's proxy equal the offline engine with the model's
    defaults (the server's rule for missing fields); the API key and served name reach the replica's app."""
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(serve_app(MODEL, served_model_names=["minfer-ray"], api_key=API_KEY, chat_template=TEMPLATE,
                            num_replicas=1, **ENGINE), name="minfer", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["minfer-ray"]
        defaults = dataclasses.replace(offline.get_default_sampling_params(), **GREEDY)
        whole = client.completions.create(model="minfer-ray", prompt=PROMPTS[0], **GREEDY)
        assert whole.choices[0].text == offline.generate(PROMPTS[0], defaults, use_tqdm=False)[0].outputs[0].text
        stream = client.completions.create(model="minfer-ray", prompt=PROMPTS[0], stream=True, **GREEDY)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == whole.choices[0].text
        chat = client.chat.completions.create(model="minfer-ray", messages=CHATS[1], **GREEDY)
        expected = offline.chat(CHATS[1], defaults, use_tqdm=False, chat_template=TEMPLATE)[0].outputs[0].text
        assert chat.choices[0].message.content == expected
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        serving = _serve_processes()  # the replica, the controller and the proxy
        serve.shutdown()
    assert any(title.startswith("ray::ServeReplica") for title in serving.values()), serving
    _wait_gone(serving)
    assert not _serve_processes()


def test_ray_shutdown_leaves_no_process(local_ray: None) -> None:
    """Ray's own processes and its workers (which outlive their raylet as orphans if anything does). Only those:
    under pytest-xdist this process also holds other test files' children (an LLM's grammar workers)."""
    ray_processes = {pid: title for pid, title in _descendants().items() if "ray" in title}
    assert any("raylet" in title for title in ray_processes.values())
    ray.shutdown()
    _wait_gone(ray_processes)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _descendants() -> dict[int, str]:
    """This process's live descendants (zombies are gone), pid -> command line (Ray's workers retitle theirs)."""
    parents, titles = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            titles[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            parents[int(entry.name)] = int(ppid)
    found, frontier = {}, {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in found}
        found.update({pid: titles[pid] for pid in frontier})
    return found


def _serve_processes() -> dict[int, str]:
    return {pid: title for pid, title in _descendants().items() if title.startswith(SERVE_TITLES)}


def _wait_gone(processes: dict[int, str], within: float = 30.0) -> None:
    """A bounded wait for ``processes`` to exit (a process takes a moment to go), then none may be left."""
    deadline = time.monotonic() + within
    while (left := {pid: t for pid, t in processes.items() if _alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left running: {left}"


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
