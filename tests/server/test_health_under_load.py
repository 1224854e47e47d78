"""While oversized and expensive requests are refused (413 past the body cap, 400 past the counts and lengths),
/health keeps answering and another client's tokens keep flowing; nothing leaks. The figures the issue asks
for (p99 under 100 ms) come from ``benchmarks/server_health_under_load.py``; this asserts them loosely."""
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
        report = bench.run(live.base_url, 6.0, 0.01, CAP, live.ctx.processor.max_prompt_chars)
        print(report)
        expected = {"body over the cap (Content-Length)": [413], "body over the cap (chunked)": [413]}
        for name, result in report["attacks"].items():
            assert result["statuses"] == expected.get(name, [400]), (name, result)
        assert not report["failures"], report["failures"]
        assert report["health_probes"] > 20
        assert report["health_p99_ms"] < 1000, report  # loose: 2 shared cores, the client in this process
        assert report["stream_chunks"] > 20 and report["stream_max_gap_ms"] < 2000, report
        idle = live.wait_idle()
        assert idle["healthy"] and idle["kv_blocks_used"] == 0, idle
    finally:
        live.stop()
