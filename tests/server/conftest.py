"""Live servers for the HTTP tests: uvicorn in a thread on 127.0.0.1, on a port the OS picks.

In-process (not a subprocess) so tests can reach the engine to break it, gate it or count its
calls; `test_bench_serve` covers the subprocess path. One shared server serves most tests; those
that break or stall their engine start their own (a tiny model loads in well under a second).
"""
from __future__ import annotations

import importlib.util
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from minfer.config import EngineConfig  # noqa: E402
from minfer.engine.llm_engine import LLMEngine  # noqa: E402
from minfer.outputs import RequestOutputKind  # noqa: E402
from minfer.server.app import build_app  # noqa: E402
from minfer.server.http_protocol import http_protocol  # noqa: E402
from minfer.server.limits import DEFAULT_MAX_REQUEST_BYTES  # noqa: E402

MODEL_NAME = "tiny-llama3"
ENGINE_ARGS: dict[str, Any] = dict(num_kv_blocks=512, max_num_seqs=64, max_num_batched_tokens=1024)


def _root_conftest() -> Any:
    """tests/conftest.py by path: the bare name ``conftest`` may be bound to another folder's."""
    path = Path(__file__).resolve().parent.parent / "conftest.py"
    spec = importlib.util.spec_from_file_location("_minfer_tests_root_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class LiveServer:
    """An app on uvicorn in a background thread; ``stop`` shuts both down."""

    def __init__(self, model_dir: Path, max_waiting_requests: int | None = 1024, api_key: str | None = None,
                 chat_template: str | None = None, max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
                 trust_request_chat_template: bool = True, allowed_hosts: tuple[str, ...] = (),
                 allowed_origins: tuple[str, ...] = (), http: str = "auto", app_args: dict[str, Any] | None = None,
                 **engine_args: Any) -> None:
        """``trust_request_chat_template`` is on by default: the shared server's tests send templates.
        ``http``: uvicorn's HTTP protocol under ``http_protocol`` (as ``minfer serve`` runs it); ``app_args``: more
        of ``build_app``'s arguments (LoRA modules, ...)."""
        self.engine = LLMEngine(EngineConfig(model=str(model_dir), **{**ENGINE_ARGS, **engine_args}),
                                RequestOutputKind.DELTA)
        self.app = build_app(self.engine, [MODEL_NAME], max_waiting_requests, api_key=api_key,
                             chat_template=chat_template, max_request_bytes=max_request_bytes,
                             trust_request_chat_template=trust_request_chat_template,
                             allowed_hosts=allowed_hosts, allowed_origins=allowed_origins, **(app_args or {}))
        self.ctx = self.app.state.ctx
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2,
                                                    http=http_protocol(http)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)

    @property
    def async_engine(self) -> Any:
        return self.ctx.engine

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.base_url + "/stats", timeout=10).json()

    def wait_idle(self, timeout: float = 15.0) -> dict[str, Any]:
        """Poll /stats until nothing runs or waits and no KV block is held; return the last stats."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if (s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_used"] == 0) or \
                    time.monotonic() > deadline:
                return s
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _root_conftest().make_checkpoint(tmp_path_factory.mktemp("server-ckpt") / "llama3", "llama3")


@pytest.fixture(scope="session")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    live = LiveServer(tiny_model)
    yield live
    live.stop()


@pytest.fixture()
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


@pytest.fixture()
def openai_client(server: LiveServer) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
