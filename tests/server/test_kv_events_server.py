"""The gateway's model-server contract on a served model: ``minfer serve --kv-events-config '<json>'`` publishes the
prefix cache's blocks to a ZeroMQ subscriber, frees its port when serving ends, and /metrics carries the series
the inference gateway's endpoint picker reads (``vllm:cache_config_info``; waiting requests counted as vLLM counts
them)."""
from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from minfer.cli import main
from minfer.server.metrics import ServerMetrics

from .conftest import LiveServer
from .procs import free_port


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_serve_with_kv_events_config_publishes_block_events(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`minfer serve MODEL --kv-events-config '{...}'`: a completion's full prompt blocks reach a SUB socket as vLLM's
    BlockStored (topic, 8-byte sequence number, msgpack batch), and the publisher's port is free once serving ends."""
    import uvicorn
    from fastapi.testclient import TestClient

    port = free_port()
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv@pod-a@tiny"}
    received: list[Any] = []

    class Server:
        """uvicorn.Server without a socket: ``run`` drives the app through a test client while the engine lives."""

        def __init__(self, config: Any) -> None:
            self.config, self.started, self.should_exit = config, False, False

        def run(self) -> None:
            app, self.started = self.config.app, True
            tok = app.state.ctx.tokenizer
            ctx = zmq.Context()
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
            sub.connect(f"tcp://127.0.0.1:{port}")
            try:
                with TestClient(app) as c:
                    # PUB drops what it sends before the subscription arrives: new prompts (a new first block each)
                    # until the prefill batch of the latest one gets through
                    for i in range(50):
                        prompt = f"{i} def fibonacci(n): return n if n < 2 else fibonacci(n - 1)"
                        resp = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                        assert resp.status_code == 200, resp.text
                        ids = tok.encode(prompt, add_special_tokens=False)
                        while sub.poll(300):
                            topic, seq, payload = sub.recv_multipart()
                            batch = msgpack.unpackb(payload)
                            if any(e[0] == "BlockStored" and e[2] is None and e[3] == ids[:len(e[3])]
                                   for e in batch[1]):
                                received.append((topic, seq, batch, ids))
                        if received:
                            break
                    received.append(_families(c.get("/metrics").text))
            finally:
                sub.close(0)
                ctx.term()

    monkeypatch.setattr(uvicorn, "Server", Server)
    assert main(["serve", str(tiny_model), "--kv-events-config", json.dumps(kv), "--port", "8124", "--allowed-hosts",
                 "testserver", "--block-size", "4", "--num-kv-blocks", "64", "--max-num-seqs", "4"]) == 0
    (topic, seq, (ts, events, rank), ids), metrics = received
    assert topic == b"kv@pod-a@tiny" and len(seq) == 8 and isinstance(ts, float) and rank == 0
    first = next(e for e in events if e[0] == "BlockStored" and e[2] is None)
    assert first[4:] == [4, None, "GPU", None]  # block_size, lora_id, medium, lora_name
    assert first[3] == ids[:len(ids) // 4 * 4] and len(first[1]) == len(ids) // 4  # the prompt's full blocks
    info = metrics["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels == {"block_size": "4", "num_gpu_blocks": "64",
                                               "enable_prefix_caching": "True", "engine": "0"}
    with socket.socket() as s:  # the engine's shutdown closed the publisher
        s.bind(("0.0.0.0", port))


def test_waiting_requests_are_counted_as_vllm_counts_them(server: LiveServer) -> None:
    """vllm:num_requests_waiting reads the engine's vLLM-style count (samples not yet forked, grammars compiling),
    minfer_num_requests_waiting the scheduler's queue; the KV usage is a fraction."""
    stats = dict(server.async_engine.stats(), num_waiting=1, num_requests_waiting=3, kv_cache_usage=0.25)
    metrics = _families(ServerMetrics(lambda: stats, lambda: True, "m").render().decode())
    assert metrics["vllm:num_requests_waiting"].samples[0].value == 3
    assert metrics["minfer_num_requests_waiting"].samples[0].value == 1
    assert metrics["vllm:kv_cache_usage_perc"].samples[0].value == 0.25
    info = metrics["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == str(stats["block_size"]) and info["num_gpu_blocks"] == str(stats["num_kv_blocks"])
