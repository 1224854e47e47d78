"""While oversized and expensive requests are refused (413 past the body cap, 400 past the counts and lengths),
/health keeps answering and another client's tokens keep flowing; nothing leaks. The load runs until every
attack has been sent a few times and enough probes and stream chunks have come back, however fast this
machine is; the latencies (p99 of /health, the longest gap between stream chunks) are the benchmark's,
``benchmarks/server_health_under_load.py``, not asserted here.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from .conftest import LiveServer

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "server_health_under_load.py"
CAP = 1 << 20


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("_server_health_under_load", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_health_and_streams_flow_while_bad_requests_are_refused(tiny_model: Path) -> None:
    bench = _bench()
    live = LiveServer(tiny_model, max_request_bytes=CAP)
    try:
        wanted = {"attack_rounds": 3, "health_probes": 20, "stream_chunks": 20}
        # (the timeout only stops a stuck server from hanging the test; the counts below then fail)
        report = bench.run(live.base_url, 0.0, 0.01, CAP, live.ctx.processor.max_prompt_chars, at_least=wanted,
                           timeout=300.0)
        print(report)
        expected = {"body over the cap (Content-Length)": [413], "body over the cap (chunked)": [413]}
        assert report["attacks"].keys() == {name for name, _, _ in bench.attacks(CAP, 1)}, report["attacks"]
        for name, result in report["attacks"].items():
            assert result["statuses"] == expected.get(name, [400]), (name, result)
        assert not report["failures"], report["failures"]  # every probe a 200, every attack answered
        for key, n in wanted.items():
            assert report[key] >= n, (key, report)
        idle = live.wait_idle()
        assert idle["healthy"] and idle["kv_blocks_used"] == 0, idle
    finally:
        live.stop()
