"""GET /health latency while the server handles oversized and expensive requests (p50 / p99 / max).

Runs a server in this process (uvicorn in a thread, as the tests do) on a tiny random-weight checkpoint
or ``--model``, probes /health every ``--probe-interval`` seconds from one thread while another sends, in
a loop, each request of ``attacks()``: bodies past the size cap (declared and chunked), a text prompt
longer than the context can hold, a huge token-id list, thousands of prompts, a chat of tens of thousands of
messages, and a prompt just inside the character bound (tokenized, then refused), while a third client
streams tokens. With ``--hostile``, the attacks also bring work that grows without bound unless the server
bounds it: a request's chat template that loops 10^10 times, a 900 KB grammar of 50,000 rules, a 10,000-link
``$ref`` chain, a schema of 5,000 properties and an enum of 10,000 entries to compile. A fourth client
sends plain 6-token requests in a loop (also without ``--hostile``, for comparison). Reports the /health
percentiles, the longest gap between the streaming client's tokens, the plain requests' latency, and each
attack's status and time.

    python benchmarks/server_health_under_load.py [--model DIR] [--seconds 20] [--max-request-bytes N] [--hostile]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

Attack = tuple[str, str, Callable[[], dict[str, Any]]]  # (name, path, httpx.request kwargs)


LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
         "{{ messages[0].content }}")  # 150 bytes, 10^10 iterations


def hostile_attacks() -> list[Attack]:
    """Requests whose template, grammar or schema would run unbounded: each must end in a bounded time."""
    def body(payload: dict[str, Any]) -> Callable[[], dict[str, Any]]:
        data = json.dumps(payload).encode()
        return lambda: {"content": data, "headers": {"Content-Type": "application/json"}}

    def schema(s: dict[str, Any]) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": "s", "schema": s}}

    chain = {"$ref": "#/$defs/d0", "$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(10_000)}}
    chain["$defs"]["d10000"] = {"type": "integer"}
    grammar = "root ::= r0\n" + "\n".join(f'r{i}::="a" r{i + 1}' for i in range(49_999)) + '\nr49999::="z"'
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5_000)}}
    return [
        ("looping request chat template", "/v1/chat/completions",
         body({"messages": [{"role": "user", "content": "hi"}], "chat_template": LOOPS, "max_tokens": 2})),
        ("50,000-rule grammar", "/v1/completions", body({"prompt": "x", "max_tokens": 2, "guided_grammar": grammar})),
        ("10,000-link $ref chain", "/v1/completions",
         body({"prompt": "x", "max_tokens": 2, "response_format": schema(chain)})),
        ("schema of 5,000 properties", "/v1/completions",
         body({"prompt": "x", "max_tokens": 2, "response_format": schema({**wide, "title": "w"})})),
        ("enum of 10,000 entries", "/v1/completions",
         body({"prompt": "x", "max_tokens": 2, "response_format": schema({"enum": [f"v{i}" for i in range(10_000)]})})),
    ]


def attacks(max_request_bytes: int, max_prompt_chars: int) -> list[Attack]:
    over = max_request_bytes + 1024
    inside = int(max_request_bytes * 0.8)

    def chunked() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(over // 65536 + 1):
            yield b"a" * 65536
        yield b'"}'

    def body(payload: dict[str, Any]) -> Callable[[], dict[str, Any]]:
        data = json.dumps(payload).encode()  # encoded once: the client's own JSON work would share the GIL
        return lambda: {"content": data, "headers": {"Content-Type": "application/json"}}

    return [
        ("body over the cap (Content-Length)", "/v1/completions", body({"prompt": "a" * over})),
        ("body over the cap (chunked)", "/v1/completions",
         lambda: {"content": chunked(), "headers": {"Content-Type": "application/json"}}),
        ("text past the context", "/v1/completions", body({"prompt": "word " * (inside // 5)})),
        ("huge token-id list", "/v1/completions", body({"prompt": [7] * (inside // 3)})),
        ("thousands of prompts", "/v1/completions", body({"prompt": ["hi"] * min(inside // 6, 200_000)})),
        ("tens of thousands of messages", "/v1/chat/completions",
         body({"messages": [{"role": "user", "content": "hi"}] * min(inside // 40, 100_000)})),
        ("prompt at the character bound", "/v1/completions", body({"prompt": "ab " * (max_prompt_chars // 3)})),
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(base_url: str, seconds: float, probe_interval: float, max_request_bytes: int,
        max_prompt_chars: int, at_least: dict[str, int] | None = None, timeout: float = 300.0,
        hostile: bool = False, plain: bool = False) -> dict[str, Any]:
    """The load for ``seconds``, then on until the report's counts reach ``at_least`` ("health_probes",
    "stream_chunks", "attack_rounds") or ``timeout`` seconds have passed since the start: the test asks for
    counts, whatever this machine's speed; the benchmark for a duration. ``hostile``: add
    ``hostile_attacks``; ``plain``: a fourth client timing plain 6-token requests."""
    stop = threading.Event()
    health: list[float] = []
    failures: list[str] = []
    gaps: list[float] = []
    results: dict[str, list[tuple[int, float]]] = {}
    rounds = [0]

    def probe() -> None:
        with httpx.Client(base_url=base_url, timeout=30) as c:
            while not stop.is_set():
                t = time.perf_counter()
                r = c.get("/health")
                health.append(time.perf_counter() - t)
                if r.status_code != 200:
                    failures.append(f"/health {r.status_code}")
                time.sleep(probe_interval)

    def stream() -> None:
        body = {"prompt": "def f():", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=base_url, timeout=60) as c:
            while not stop.is_set():
                last = time.perf_counter()
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        now = time.perf_counter()
                        if line.startswith("data: {"):
                            gaps.append(now - last)
                            last = now
                        if stop.is_set():
                            break

    requests = attacks(max_request_bytes, max_prompt_chars) + (hostile_attacks() if hostile else [])
    latencies: list[float] = []

    def plain_requests() -> None:
        with httpx.Client(base_url=base_url, timeout=120) as c:
            while not stop.is_set():
                t = time.perf_counter()
                r = c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 6, "ignore_eos": True})
                latencies.append(time.perf_counter() - t)
                if r.status_code != 200:
                    failures.append(f"plain request {r.status_code}")

    def attack() -> None:
        with httpx.Client(base_url=base_url, timeout=120) as c:
            while not stop.is_set():
                for name, path, kwargs in requests:
                    t = time.perf_counter()
                    try:
                        status = c.post(path, **kwargs()).status_code
                    except httpx.HTTPError as exc:  # a server may close a refused upload early
                        status = -1
                        failures.append(f"{name}: {exc!r}")
                    results.setdefault(name, []).append((status, time.perf_counter() - t))
                    if stop.is_set():
                        break
                else:
                    rounds[0] += 1

    clients = (probe, stream, attack) + ((plain_requests,) if plain else ())
    threads = [threading.Thread(target=f, daemon=True) for f in clients]
    counts = {"health_probes": lambda: len(health), "stream_chunks": lambda: len(gaps),
              "attack_rounds": lambda: rounds[0]}
    started = time.monotonic()
    for th in threads:
        th.start()
    time.sleep(seconds)
    while (any(counts[k]() < n for k, n in (at_least or {}).items())
           and time.monotonic() - started < timeout):
        time.sleep(0.05)
    stop.set()
    for th in threads:
        th.join(60)
    return {
        "seconds": time.monotonic() - started, "attack_rounds": rounds[0],
        "health_probes": len(health), "health_p50_ms": 1e3 * statistics.median(health) if health else None,
        "health_p99_ms": 1e3 * percentile(health, 0.99) if health else None,
        "health_max_ms": 1e3 * max(health) if health else None,
        "stream_chunks": len(gaps), "stream_max_gap_ms": 1e3 * max(gaps) if gaps else None,
        **({"plain_requests": len(latencies), "plain_p50_ms": 1e3 * statistics.median(latencies),
            "plain_p99_ms": 1e3 * percentile(latencies, 0.99), "plain_max_ms": 1e3 * max(latencies)}
           if latencies else {}),
        "attacks": {name: {"statuses": sorted({s for s, _ in rs}), "mean_s": statistics.mean(t for _, t in rs)}
                    for name, rs in results.items()},
        "failures": failures[:10],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: a tiny random-weight Llama built here)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--probe-interval", type=float, default=0.01)
    ap.add_argument("--max-request-bytes", type=int, default=None, help="default: the server's default")
    ap.add_argument("--hostile", action="store_true", help="add the attacks that bring unbounded work")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT / "tests"))
    from server.conftest import LiveServer, _root_conftest  # the tests' in-process server

    from minfer.server.limits import DEFAULT_MAX_REQUEST_BYTES

    model = Path(args.model) if args.model else _root_conftest().make_checkpoint(
        Path(tempfile.mkdtemp()) / "llama3", "llama3")
    cap = args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES
    live = LiveServer(model, max_request_bytes=cap)
    try:
        report = run(live.base_url, args.seconds, args.probe_interval, cap, live.ctx.processor.max_prompt_chars,
                     hostile=args.hostile, plain=True)
        report["idle_after"] = {k: v for k, v in live.wait_idle().items()
                                if k in ("healthy", "kv_blocks_used", "num_running", "num_waiting")}
    finally:
        live.stop()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
