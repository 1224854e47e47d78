"""/metrics under vLLM's names and labels, so vLLM's dashboards read it: present, labelled, and moving."""
from __future__ import annotations

import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .conftest import MODEL_NAME, LiveServer

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions",
            "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens")


def _scrape(client: httpx.Client) -> dict[str, Any]:
    """{family name: {sample name + sorted labels: value}} of one scrape."""
    text = client.get("/metrics").text
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        out[family.name] = (family.type, {(s.name, tuple(sorted(s.labels.items()))): s.value
                                          for s in family.samples})
    return out


def _value(scrape: dict[str, Any], sample: str, **labels: str) -> float:
    family = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    want = {"model_name": MODEL_NAME, "engine": "0", **labels}
    return scrape[family][1][(sample, tuple(sorted(want.items())))]


def test_vllm_names_types_and_labels(client: httpx.Client) -> None:
    scrape = _scrape(client)
    for name, kind in [*((g, "gauge") for g in GAUGES), *((c, "counter") for c in COUNTERS),
                       *((h, "histogram") for h in HISTOGRAMS)]:
        assert name in scrape, name
        assert scrape[name][0] == kind, (name, scrape[name][0])
        for _, labels in scrape[name][1]:
            assert dict(labels)["model_name"] == MODEL_NAME and dict(labels)["engine"] == "0", (name, labels)
    for reason in ("stop", "length", "abort"):  # every finish reason is a series from the start, as in vLLM
        _value(scrape, "vllm:request_success_total", finished_reason=reason)
    assert 0.0 <= _value(scrape, "vllm:kv_cache_usage_perc") <= 1.0
    assert "minfer_num_requests_running" in scrape and "minfer_time_to_first_token_seconds" in scrape  # ours stay


def test_vllm_series_move_after_a_request(client: httpx.Client, server: LiveServer) -> None:
    before = _scrape(client)
    prompt = "def fibonacci(n):"
    resp = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True})
    assert resp.status_code == 200
    server.wait_idle()
    after = _scrape(client)

    def delta(sample: str, **labels: str) -> float:
        return _value(after, sample, **labels) - _value(before, sample, **labels)

    n_prompt = len(server.ctx.tokenizer.encode(prompt))
    assert delta("vllm:prompt_tokens_total") == n_prompt
    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:prefix_cache_queries_total") >= n_prompt
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_generation_tokens_sum") == 6
    assert delta("vllm:inter_token_latency_seconds_count") >= 1
    assert delta("vllm:time_per_output_token_seconds_count") == delta("vllm:inter_token_latency_seconds_count")
    assert _value(after, "vllm:num_requests_running") == 0 and _value(after, "vllm:kv_cache_usage_perc") == 0


def test_metrics_is_prometheus_text(client: httpx.Client) -> None:
    resp = client.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in resp.text


def test_spec_decode_counters(tiny_model) -> None:
    """With speculation on, vLLM's spec_decode counters are served, labelled per draft position, and move."""
    server = LiveServer(tiny_model, speculative_config={
        "method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": 3})
    body = {"prompt": "def f(x):", "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    try:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200
            streamed = ""  # several tokens a step arrive as one delta: the stream adds up to the same text
            with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as events:
                for line in events.iter_lines():
                    if line.startswith("data: {"):
                        streamed += json.loads(line[6:])["choices"][0]["text"]
            assert streamed == resp.json()["choices"][0]["text"]
            server.wait_idle()
            scrape = _scrape(client)
    finally:
        server.stop()
    drafted = _value(scrape, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _value(scrape, "vllm:spec_decode_num_accepted_tokens_total")
    assert _value(scrape, "vllm:spec_decode_num_drafts_total") > 0 and 0 < accepted <= drafted
    per_pos = [_value(scrape, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)]
    assert sum(per_pos) == accepted


def test_observe_many_is_repeated_observe() -> None:
    """``observe_many`` (one step's requests sharing an inter-token latency) leaves a histogram as that many
    ``observe`` calls would, at bucket edges, between and past them, labelled or not."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from minfer.server.metrics import _ITL_BUCKETS, observe_many

    registries = CollectorRegistry(), CollectorRegistry()
    plain = [Histogram("h", "d", buckets=_ITL_BUCKETS, registry=r) for r in registries]
    labelled = [Histogram("l", "d", ["engine"], buckets=_ITL_BUCKETS, registry=r).labels("3") for r in registries]
    for value, count in ((0.0005, 3), (0.0006, 1), (0.02, 250), (0.0201, 7), (2.5, 2), (9.0, 4), (0.0, 1)):
        for a, b in (plain, labelled):
            for _ in range(count):
                a.observe(value)
            observe_many(b, value, count)
    one, many = (generate_latest(r).decode().splitlines() for r in registries)
    assert len(one) == len(many) > 40
    for x, y in zip(one, many):
        name_x, value_x = x.rsplit(" ", 1)
        name_y, value_y = y.rsplit(" ", 1)
        assert name_x == name_y
        assert value_x == value_y if "_sum" not in name_x else abs(float(value_x) - float(value_y)) < 1e-9, (x, y)
