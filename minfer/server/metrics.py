"""Prometheus metrics for GET /metrics, under vLLM's names (``vllm:*``) and our own (``minfer_*``).

vLLM's names and labels (``model_name``, ``engine``) are those of its v1 ``PrometheusStatLogger``,
so dashboards and alerts built for vLLM work unchanged; ours stay for the dashboards built on them.

Two sources. Engine state (running/waiting sequences, KV blocks, prefix cache, preemptions, the
tensor-parallel world size, constrained sequences, grammar compile times) is read at scrape time
from the engine thread's latest stats snapshot, so it costs nothing per step. Per-request timings
(TTFT, inter-token latency, end-to-end) and token counters are recorded on the engine thread as
outputs leave ``step()``: that is when a token exists, before any event-loop or network delay, and
prometheus-client's types are thread-safe.

Each app gets its own registry, so several servers (tests) can live in one process.
"""
from __future__ import annotations

import copy
import time
from bisect import bisect_left
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from minfer.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.5, 1.0, 2.5)
# vLLM's own buckets, so a histogram_quantile over both servers compares like with like.
_VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                      10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0)
_VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                         120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values, each series present from the start


def _one_two_five(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


class _EngineStateCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]], healthy: Callable[[], bool], model_name: str) -> None:
        self.stats, self.healthy, self.labels = stats, healthy, [model_name, "0"]

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
            "minfer_tensor_parallel_size": ("ranks (GPUs; on the CPU, processes) the model is sharded over",
                                            s.get("tensor_parallel_size", 1)),
            "minfer_num_requests_constrained": ("running sequences whose output a grammar constrains",
                                                s.get("num_constrained_running", 0)),
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
        yield _snapshot_histogram("minfer_grammar_compile_seconds",
                                  "time to compile a structured-output grammar for the tokenizer (cache misses)",
                                  s.get("grammar_compile_seconds"))
        yield from self._vllm_per_engine(s)

    def _vllm_per_engine(self, s: dict[str, Any]) -> Iterator[Metric]:
        """vLLM's engine-state series, one per engine as vLLM exposes them: a data-parallel server's live replicas
        (``s["replicas"]``) each under its own ``engine`` label (a reader sums them, ``sum by (model_name)``; the
        unlabelled ``minfer_*`` gauges are the totals), its adapters' info once; one engine's under "0"."""
        replicas = [r for r in s.get("replicas", ()) if r.get("alive", True)]
        if not replicas:
            yield from self._vllm(s)
            return
        families: dict[str, Metric] = {}
        for r in replicas:
            view = copy.copy(self)
            view.labels = [self.labels[0], str(r["engine"])]
            for family in view._vllm({k: v for k, v in r.items() if k != "lora_requests_info"}):
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()
        if "lora_requests_info" in s:
            yield _lora_info(s["lora_requests_info"])

    def _vllm(self, s: dict[str, Any]) -> Iterator[Metric]:
        """vLLM's engine-state series: a sequence counts as a request, as each of n samples is one in vLLM v1 (so the
        waiting ones include samples not yet forked and grammars compiling: engine_stats' ``num_requests_waiting``);
        the KV usage is a fraction (0..1) of the blocks, the cached but unreferenced ones counting as free."""
        for name, doc, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.", s["num_running"]),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                 s.get("num_requests_waiting", s["num_waiting"])),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s["kv_cache_usage"])):
            family = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
            family.add_metric(self.labels, value)
            yield family
        for name, doc, value in (
                ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s["num_preemptions"]),
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                 s["prefix_cache_queried_tokens"]),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                 s["prefix_cache_hit_tokens"])):
            family = CounterMetricFamily(name, doc, labels=VLLM_LABELS)
            family.add_metric(self.labels, value)
            yield family
        if "block_size" in s:
            yield self._cache_config(s)
        if "spec_decode_num_drafts" in s:
            yield from self._spec_decode(s)
        if "lora_requests_info" in s:
            yield _lora_info(s["lora_requests_info"])

    def _cache_config(self, s: dict[str, Any]) -> GaugeMetricFamily:
        """vLLM's ``vllm:cache_config_info`` (value 1, the settings as labels): the inference gateway's endpoint picker
        reads ``block_size`` and ``num_gpu_blocks`` from it to size its prefix-cache model of this server."""
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=("block_size", "enable_prefix_caching", "num_gpu_blocks", "engine"))
        family.add_metric([str(s["block_size"]), str(bool(s["enable_prefix_caching"])), str(s["num_kv_blocks"]),
                           self.labels[1]], 1.0)
        return family

    def _spec_decode(self, s: dict[str, Any]) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters (present when the engine speculates)."""
        for name, doc, key in (
                ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_decode_num_drafts"),
                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_decode_num_draft_tokens"),
                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                 "spec_decode_num_accepted_tokens")):
            family = CounterMetricFamily(name, doc, labels=VLLM_LABELS)
            family.add_metric(self.labels, s[key])
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", labels=[*VLLM_LABELS, "position"])
        for position, value in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
            family.add_metric([*self.labels, str(position)], value)
        yield family


def _lora_info(info: dict[str, Any]) -> GaugeMetricFamily:
    """vLLM's ``vllm:lora_requests_info``: the adapters of the running and of the waiting requests (names joined
    by commas) and ``max_lora`` as labels, the time as the value, so that a reader (the Gateway API inference
    extension's LoRA affinity) takes the newest series. Rendered at scrape time from the engine's latest snapshot:
    one series, the current one, not one per label set ever seen as vLLM's live gauge keeps."""
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                               labels=("max_lora", "waiting_lora_adapters", "running_lora_adapters"))
    family.add_metric([str(info["max_lora"]), ",".join(info["waiting_lora_adapters"]),
                       ",".join(info["running_lora_adapters"])], time.time())
    return family


def _snapshot_histogram(name: str, doc: str, snapshot: dict[str, Any] | None) -> HistogramMetricFamily:
    """A histogram the engine keeps itself, rendered from its latest snapshot's ``"buckets"`` (``[(upper
    bound, cumulative count), ..., (inf, n)]``, the last being the count) and ``"sum"``; empty (one +Inf
    bucket) before there is one."""
    snapshot = snapshot or {}
    buckets = [(floatToGoString(bound), count) for bound, count in snapshot.get("buckets", ())] or [("+Inf", 0)]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=snapshot.get("sum", 0.0))


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """``count`` observations of ``value``, at the cost of one: a bucket's count and the sum grow by ``count`` (a
    histogram without prometheus-client's bucket layout observes ``count`` times)."""
    buckets, bounds, total = (getattr(histogram, name, None) for name in ("_buckets", "_upper_bounds", "_sum"))
    if buckets is None or bounds is None or total is None:
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    buckets[bisect_left(bounds, value)].inc(count)


class _VllmRequestMetrics:
    """vLLM's per-request series, bound to this server's label values once."""

    def __init__(self, r: CollectorRegistry, labels: tuple[str, str], max_model_len: int) -> None:
        self._parents: dict[int, Any] = {}  # id of a bound series -> its family, for ``for_engine``

        def bound(metric: Any) -> Any:
            child = metric.labels(*labels)
            self._parents[id(child)] = metric
            return child

        tokens = _one_two_five(max_model_len)
        self.prompt_tokens = bound(Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                           VLLM_LABELS, registry=r))
        self.generation_tokens = bound(Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                               VLLM_LABELS, registry=r))
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                [*VLLM_LABELS, "finished_reason"], registry=r)
        self._labels = labels
        for reason in FINISH_REASONS:
            self.success(reason)

        def histogram(name: str, doc: str, buckets: Any) -> Any:
            return bound(Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=r))

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _VLLM_TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _VLLM_ITL_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (the same values as "
                              "vllm:inter_token_latency_seconds, as vLLM records them).", _VLLM_ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _VLLM_REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", _VLLM_REQUEST_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", _VLLM_REQUEST_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", _VLLM_REQUEST_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", _VLLM_REQUEST_BUCKETS)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation = histogram("vllm:request_generation_tokens",
                                            "Number of generation tokens processed.", tokens)

    def success(self, reason: str) -> Any:
        return self._success.labels(*self._labels, reason)

    def for_engine(self, engine: int) -> "_VllmRequestMetrics":
        """The same series bound to another ``engine`` label (a data-parallel replica's), each present from now on."""
        other = copy.copy(self)
        other._labels = (self._labels[0], str(engine))
        for name, value in vars(self).items():
            parent = self._parents.get(id(value))
            if parent is not None:
                setattr(other, name, parent.labels(*other._labels))
        for reason in FINISH_REASONS:
            other.success(reason)
        return other

    def finished(self, out: RequestOutput, reason: str, now: float) -> None:
        self.success(reason).inc()
        m = out.metrics
        self.e2e.observe(now - m.arrival_time)
        if m.first_scheduled_time:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
            self.inference.observe(now - m.first_scheduled_time)
            if m.first_token_time:
                self.prefill.observe(m.first_token_time - m.first_scheduled_time)
                self.decode.observe(now - m.first_token_time)
        self.request_prompt.observe(len(out.prompt_token_ids))
        self.request_generation.observe(sum(c.token_offset + len(c.token_ids) for c in out.outputs))


class ServerMetrics:
    """The registry plus the ``EngineObserver`` hooks that fill its histograms and counters."""

    def __init__(self, stats: Callable[[], dict[str, Any]], healthy: Callable[[], bool], model_name: str = "minfer",
                 max_model_len: int = 1 << 20) -> None:
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
        self.vllm = _VllmRequestMetrics(r, (model_name, "0"), max_model_len)
        r.register(_EngineStateCollector(stats, healthy, model_name))
        self._last_token_time: dict[str, float] = {}  # engine thread only

    def on_step(self, outputs: list[RequestOutput], new_tokens: list[int], now: float) -> None:
        """Called for every step with outputs, so the latencies the step's requests share (those whose previous
        token came in the same step) are observed together and the tokens counted once a step."""
        last, v = self._last_token_time, self.vllm
        since: dict[float, int] = {}  # previous token's time -> requests
        for out, k in zip(outputs, new_tokens):
            prev = last.get(out.request_id)
            if prev is None:
                ttft, n_prompt = now - out.metrics.arrival_time, len(out.prompt_token_ids)
                self.ttft.observe(ttft)
                v.ttft.observe(ttft)
                self.prompt_tokens.inc(n_prompt)
                v.prompt_tokens.inc(n_prompt)
            elif k:
                since[prev] = since.get(prev, 0) + 1
            if out.finished:
                last.pop(out.request_id, None)
                reason = out.outputs[0].finish_reason or "unknown"
                self.e2e.observe(now - out.metrics.arrival_time)
                self.requests.labels(reason).inc()
                v.finished(out, reason, now)
            else:
                last[out.request_id] = now
        for prev, count in since.items():
            for histogram in (self.itl, v.itl, v.tpot):
                observe_many(histogram, now - prev, count)
        total = sum(new_tokens)
        self.generation_tokens.inc(total)
        v.generation_tokens.inc(total)

    def on_abort(self, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)
        self.requests.labels("abort").inc()
        self.vllm.success("abort").inc()

    def for_engine(self, engine: int) -> "ServerMetrics":
        """The hooks for data-parallel replica ``engine``'s outputs (``DataParallelEngine`` calls them on its
        receiver thread): vLLM's per-request series under its ``engine`` label, ours (unlabelled) summed over all."""
        view = copy.copy(self)  # the same registry, counters and token times
        view.vllm = self.vllm if engine == 0 else self.vllm.for_engine(engine)
        return view

    def render(self) -> bytes:
        return generate_latest(self.registry)
