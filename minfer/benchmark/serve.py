"""The serving benchmark (``minfer bench-serve``): load a server over HTTP, measure what its clients see.

Closed loop (``--concurrency 1,16,64``: that many clients, each sending its next request when
the last one ends) or open loop (``--request-rate 2,8``: Poisson arrivals, optionally capped by
``--max-concurrency``). Every request streams from /v1/completions with a token-id prompt, so no
tokenizer is needed and lengths are exact: workload A's (random 100-1024 in, 100-1024 out, scaled
down to the served model's ``max_model_len``, read from ``/v1/models`` as vLLM serves it) or fixed
ones (``--input-len`` / ``--output-len``, which choose it), or prompts sharing prefixes
(``--workload prefix-repetition``: the prefix cache's hit rate per level, and under data parallelism the
balancer's split). ``--launch`` starts the server itself in a child process first. ``run`` takes the
parsed arguments of ``minfer.cli.bench_serve``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minfer.benchmark.serve_report import plot, print_table, summarize
from minfer.benchmark.workload import WORKLOAD_A_MAX_TOKEN_ID, fit_note
from minfer.benchmark.sse_client import get_json, post_sse, split_url


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from sending to the first token's chunk
    latency: float = 0.0  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between successive token chunks
    start: float = 0.0
    end: float = 0.0
    error: str = ""


FIXED_LEN = 128  # a fixed workload's --input-len / --output-len when not given
PREFIX_LEN, NUM_PREFIXES = 512, 8  # the prefix-repetition workload's defaults


def choose_workload(args: argparse.Namespace) -> None:
    """``--input-len`` / ``--output-len`` choose the fixed workload (as lengths do in vLLM's random dataset); with
    an explicit ``--workload a``, which draws its own, they are an error rather than ignored, and so are the prefix
    flags outside the prefix-repetition workload."""
    given = [flag for flag, v in (("--input-len", args.input_len), ("--output-len", args.output_len)) if v is not None]
    if args.workload == "a" and given:
        raise ValueError(f"{' and '.join(given)} set the fixed workload's lengths, but --workload a draws its own: "
                         "drop them, or pass --workload fixed")
    prefix_flags = [flag for flag, v in (("--prefix-len", args.prefix_len), ("--num-prefixes", args.num_prefixes))
                    if v is not None]
    if prefix_flags and args.workload != "prefix-repetition":
        raise ValueError(f"{' and '.join(prefix_flags)} shape the prefix-repetition workload: pass --workload "
                         "prefix-repetition, or drop them")
    args.workload = args.workload or ("fixed" if given else "a")
    if args.workload in ("fixed", "prefix-repetition"):
        args.input_len = FIXED_LEN if args.input_len is None else args.input_len
        args.output_len = FIXED_LEN if args.output_len is None else args.output_len
    if args.workload == "prefix-repetition":
        args.prefix_len = PREFIX_LEN if args.prefix_len is None else args.prefix_len
        args.num_prefixes = NUM_PREFIXES if args.num_prefixes is None else args.num_prefixes


def build_requests(args: argparse.Namespace, n: int, level: int,
                   max_model_len: int | None = None) -> list[dict[str, Any]]:
    """Request bodies; each level's prompts start with a different token so that the prefix
    cache cannot turn a level's prefills into hits on the previous level's identical prompts
    (prefix-repetition: each level draws its own prefixes, which its prompts share).
    Workload A's lengths are scaled to ``max_model_len`` (the served model's) when it is below 2,048."""
    rng = random.Random(args.seed * 1_000_003 + level)
    top = args.token_id_max
    shared = args.workload == "prefix-repetition"
    if args.workload == "a":
        from minfer.benchmark.workload import workload_a

        prompts, params = workload_a(n, max_model_len)
        pairs = [(p["prompt_token_ids"], sp.max_tokens) for p, sp in zip(prompts, params)]
    elif shared:
        prefixes = [[rng.randint(0, top) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)]
        pairs = [(prefixes[k % args.num_prefixes] + [rng.randint(0, top) for _ in range(args.input_len)],
                  args.output_len) for k in range(n)]
        rng.shuffle(pairs)
    else:
        pairs = [([rng.randint(0, top) for _ in range(args.input_len)], args.output_len) for _ in range(n)]
    bodies = []
    for ids, max_tokens in pairs:
        ids = [t % (top + 1) for t in ids]
        if not shared:
            ids[0] = rng.randint(0, top)
        bodies.append({"prompt": ids, "max_tokens": max_tokens, "temperature": args.temperature,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    return bodies


async def send(base_url: str, model: str, body: dict[str, Any]) -> RequestResult:
    host, port, prefix = split_url(base_url)
    result = RequestResult(ok=False, prompt_tokens=len(body["prompt"]))
    start = last = time.perf_counter()
    result.start = start
    chunks = 0
    try:
        async for t, data in post_sse(host, port, prefix + "/v1/completions", dict(body, model=model)):
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                raise RuntimeError(msg["error"].get("message"))
            if msg.get("usage"):
                result.output_tokens = msg["usage"]["completion_tokens"]
            if msg.get("choices"):
                if chunks == 0:
                    result.ttft = t - start
                else:
                    result.itl.append(t - last)
                last = t
                chunks += 1
        result.ok = chunks > 0
        result.output_tokens = result.output_tokens or chunks
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = time.perf_counter()
    result.latency = result.end - start
    return result


async def run_level(base_url: str, model: str, bodies: list[dict[str, Any]], concurrency: int | None,
                    rate: float | None, seed: int) -> list[RequestResult]:
    """Closed loop with ``concurrency`` workers, or Poisson arrivals at ``rate`` (capped by concurrency)."""
    if rate is None:
        todo = iter(bodies)

        async def worker() -> list[RequestResult]:
            return [await send(base_url, model, body) for body in todo]

        per_worker = await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
        return [r for rs in per_worker for r in rs]
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(body: dict[str, Any]) -> RequestResult:
        if gate is None:
            return await send(base_url, model, body)
        async with gate:
            return await send(base_url, model, body)

    tasks = []
    for body in bodies:
        tasks.append(asyncio.ensure_future(one(body)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


def parse_levels(args: argparse.Namespace) -> list[tuple[str, float]]:
    """The load levels, with every numeric argument checked before any server is started or called."""
    for name in ("num_prompts", "max_concurrency", "input_len", "output_len", "prefix_len", "num_prefixes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if (args.token_id_max is not None and args.token_id_max < 0) or args.warmup < 0:
        raise ValueError(f"--token-id-max and --warmup must be >= 0, got {args.token_id_max} and {args.warmup}")
    choose_workload(args)
    if args.request_rate:
        kind, flag, text, cast = "rate", "--request-rate", args.request_rate, float
    else:
        kind, flag, text, cast = "concurrency", "--concurrency", args.concurrency, int
    try:
        values = [cast(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise ValueError(f"{flag} values must be > 0, got {text!r}")
    return [(kind, v) for v in values]


def engine_stats(base_url: str) -> dict[str, Any] | None:
    """minfer's engine counters (``/stats``); None from another OpenAI-compatible server."""
    try:
        return get_json(base_url + "/stats")
    except (OSError, ValueError):
        return None


def cache_counts(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """A level's prefix-cache lookups and hits (tokens) and their ratio, from the server's counters around it; with
    data-parallel replicas the balancer's prefix-affinity placements too. Empty without minfer's counters."""
    if not before or not after or "prefix_cache_queried_tokens" not in after:
        return {}
    queried = after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    out = {"prefix_cache_queried_tokens": queried, "prefix_cache_hit_tokens": hits,
           "prefix_cache_hit_rate": hits / queried if queried else 0.0}
    if "dp_affinity_hits" in after:
        out["dp_routing"] = after["dp_routing"]
        out["dp_affinity_hits"] = after["dp_affinity_hits"] - before.get("dp_affinity_hits", 0)
        out["routed"] = [r["routed"] - b["routed"] for r, b in zip(after["replicas"], before.get("replicas", []))]
    return out


def served_token_id_max(base_url: str) -> int:
    """The largest prompt id the served model takes: its vocabulary from minfer's /stats, else (another
    OpenAI-compatible server) workload A's 10,000."""
    try:
        return int(get_json(base_url + "/stats")["vocab_size"]) - 1
    except (OSError, KeyError, ValueError, TypeError):
        return WORKLOAD_A_MAX_TOKEN_ID


def served_model(base_url: str) -> tuple[str, int | None]:
    """The served model's id and its ``max_model_len`` from /v1/models (minfer and vLLM list it; None when a
    server does not)."""
    try:
        card = get_json(base_url + "/v1/models")["data"][0]
    except OSError as exc:
        raise ValueError(f"cannot reach a server at {base_url} ({exc}); start one with `minfer serve`, "
                         f"or pass --launch") from None
    max_len = card.get("max_model_len")
    return card["id"], int(max_len) if isinstance(max_len, int) and max_len > 0 else None


def run(args: argparse.Namespace) -> int:
    from minfer.benchmark.launch import launched_server

    levels = parse_levels(args)
    with launched_server(args) as base_url:
        model, max_len = served_model(base_url)
        prefix = args.prefix_len if args.workload == "prefix-repetition" else 0
        if args.workload != "a" and max_len is not None and prefix + args.input_len + args.output_len > max_len:
            raise ValueError(f"{f'--prefix-len {prefix} + ' if prefix else ''}--input-len {args.input_len} + "
                             f"--output-len {args.output_len} tokens do not fit the served model's max_model_len of "
                             f"{max_len}")
        if args.token_id_max is None:
            args.token_id_max = served_token_id_max(base_url)
        note = fit_note(max_len, None) if args.workload == "a" else ""
        if note and not args.quiet:
            print(f"workload A: {note}", flush=True)
        results = []
        for i, (kind, value) in enumerate(levels):
            n = args.num_prompts or max(16, 2 * int(value))
            conc = int(value) if kind == "concurrency" else args.max_concurrency
            rate = value if kind == "rate" else None
            if args.warmup:  # short requests: compile/allocate paths, not measure them
                warm = [dict(b, max_tokens=16) for b in build_requests(args, args.warmup, 10_000 + i, max_len)]
                asyncio.run(run_level(base_url, model, warm, len(warm), None, args.seed))
            before = engine_stats(base_url)
            t0 = time.perf_counter()
            bodies = build_requests(args, n, i, max_len)
            reqs = asyncio.run(run_level(base_url, model, bodies, conc, rate, args.seed + i))
            summary = summarize(reqs, time.perf_counter() - t0)
            summary.update({kind: value, "num_prompts": n, "max_concurrency": conc})
            summary.update(cache_counts(before, engine_stats(base_url)))
            results.append(summary)
            if not args.quiet:
                hits = f", prefix-cache hits {summary['prefix_cache_hit_rate']:.1%}" if "prefix_cache_hit_rate" in \
                    summary else ""
                print(f"{kind} {value}: {summary['completed']}/{n} ok, {summary['output_tok_s']:.1f} out tok/s, "
                      f"TTFT p50 {summary['ttft_ms']['p50']:.1f} ms{hits}", flush=True)
            for error in summary["errors"]:
                print(f"  failed request: {error}", flush=True)
        stats = engine_stats(base_url)
    report = {"base_url": base_url, "model": model, "max_model_len": max_len,
              "workload": args.workload + (f" ({note})" if note else ""), "levels": results,
              "engine_stats_after": stats, "args": {k: v for k, v in vars(args).items() if k != "func"}}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    print_table(results, levels[0][0])
    title = f"minfer bench-serve: {model}, workload {args.workload}"
    png = plot(results, levels[0][0], out / "latency.png", title=title)
    print(f"wrote {out / 'results.json'}" + (f" and {png}" if png else " (no plot: matplotlib is not installed)"))
    return 0 if not any(r["failed"] for r in results) else 1

