"""Fuzz every operation of the OpenAPI schema (valid and invalid inputs): never a 5xx."""
from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import LiveServer

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

EXAMPLES_PER_MODE = 300  # 100 per mode missed an int64 overflow in top_k in ~1 of 20 runs


def test_openapi_fuzz_has_no_server_errors(tiny_model: Path) -> None:
    # A short context bounds the work any generated request can ask for (n x 48 tokens at most).
    live = LiveServer(tiny_model, max_model_len=48, num_kv_blocks=256)
    try:
        schema = schemathesis.openapi.from_url(live.base_url + "/openapi.json")
        seen: dict[int, int] = {}
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=schema.as_strategy(generation_mode=mode))
            def check(case: schemathesis.Case) -> None:
                resp = case.call(base_url=live.base_url, timeout=60)
                seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
                assert resp.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {resp.text[:300]}"
                ctype = resp.headers.get("content-type") or [""]  # schemathesis keeps header values in lists
                if resp.status_code >= 400 and "application/json" in str(ctype):
                    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}

            check()
        assert any(200 <= code < 300 for code in seen) and any(400 <= code < 500 for code in seen), seen
        idle = live.wait_idle()
        assert idle["healthy"] and idle["kv_blocks_used"] == 0
    finally:
        live.stop()
