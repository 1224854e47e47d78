"""Prometheus metrics for GET /metrics.

Two sources. Engine state (running/waiting sequences, KV blocks, prefix cache, preemptions) is
read at scrape time from the engine thread's latest stats snapshot, so it costs nothing per
step. Per-request timings (TTFT, inter-token latency, end-to-end) and token counters are
recorded on the engine thread as outputs leave ``step()``: that is when a token exists, before
any event-loop or network delay, and prometheus-client's types are thread-safe.

Each app gets its own registry, so several servers (tests) can live in one process.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from minfer.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.5, 1.0, 2.5)


class _EngineStateCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]], healthy: Callable[[], bool]) -> None:
        self.stats, self.healthy = stats, healthy

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        gauges = {
            "minfer_num_requests_running": ("sequences in the running batch", s["num_running"]),
            "minfer_num_requests_waiting": ("sequences waiting to be scheduled", s["num_waiting"]),
            "minfer_num_requests_queued": ("requests admitted by the server, not yet producing tokens",
                                           s.get("num_waiting_requests", 0)),
            "minfer_kv_blocks_total": ("KV-cache blocks", s["num_kv_blocks"]),
            "minfer_kv_blocks_used": ("KV-cache blocks held by unfinished sequences", s["kv_blocks_used"]),
            "minfer_kv_cache_usage_ratio": ("fraction of KV-cache blocks in use", s["kv_cache_usage"]),
            "minfer_prefix_cache_hit_rate": ("prompt tokens served from the prefix cache / tokens looked up",
                                             s["prefix_cache_hit_rate"]),
            "minfer_engine_healthy": ("1 while the engine loop runs", 1.0 if self.healthy() else 0.0),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "minfer_num_preemptions": ("sequences preempted for lack of KV blocks", s["num_preemptions"]),
            "minfer_prefix_cache_queried_tokens": ("prompt tokens looked up in the prefix cache",
                                                   s["prefix_cache_queried_tokens"]),
            "minfer_prefix_cache_hit_tokens": ("prompt tokens found in the prefix cache", s["prefix_cache_hit_tokens"]),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """The registry plus the ``EngineObserver`` hooks that fill its histograms and counters."""

    def __init__(self, stats: Callable[[], dict[str, Any]], healthy: Callable[[], bool]) -> None:
        disable_created_metrics()  # no `*_created` series: they double the output and nobody reads them
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("minfer_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("minfer_generation_tokens", "tokens generated", registry=r)
        self.requests = Counter("minfer_requests", "requests ended, by finish reason", ["finish_reason"], registry=r)
        self.ttft = Histogram("minfer_time_to_first_token_seconds", "arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("minfer_inter_token_latency_seconds", "time between a request's successive tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("minfer_e2e_request_latency_seconds", "arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineStateCollector(stats, healthy))
        self._last_token_time: dict[str, float] = {}  # engine thread only

    def on_step(self, outputs: list[RequestOutput], new_tokens: list[int], now: float) -> None:
        last = self._last_token_time
        for out, k in zip(outputs, new_tokens):
            prev = last.get(out.request_id)
            if prev is None:
                self.ttft.observe(now - out.metrics.arrival_time)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            elif k:
                self.itl.observe(now - prev)
            self.generation_tokens.inc(k)
            if out.finished:
                last.pop(out.request_id, None)
                self.e2e.observe(now - out.metrics.arrival_time)
                self.requests.labels(out.outputs[0].finish_reason or "unknown").inc()
            else:
                last[out.request_id] = now

    def on_abort(self, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)
        self.requests.labels("abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
