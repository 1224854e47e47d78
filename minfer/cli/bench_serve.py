"""``minfer bench-serve``: load a server over HTTP and measure what its clients see (``minfer.benchmark.serve``).

Its client is the standard library only, so benchmarking a running server needs no server extra;
``--launch`` starts one in a child process and does.
"""
from __future__ import annotations

import argparse
from typing import Any

from minfer.cli.serve import port_number
from minfer.engine_args import EngineArgs


def add_bench_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench-serve", help="benchmark a running server over HTTP (or launch one)")
    p.add_argument("--base-url", default=None, help="a running server (default: http://127.0.0.1:8000)")
    p.add_argument("--launch", action="store_true", help="start a server on --model / --shape first")
    p.add_argument("--shape", default=None, help="with --launch: a random-weight shape (e.g. llama-3.1-8b); with "
                   "--load-format dummy only its config.json is written, to <shape>-dummy")
    p.add_argument("--checkpoint-dir", default="/tmp/minfer-shapes")
    p.add_argument("--port", type=port_number, default=8000, help="with --launch: the port to serve on")
    p.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for the launched server")
    p.add_argument("--concurrency", default="1,4", help="comma-separated client counts (closed loop)")
    p.add_argument("--request-rate", default=None, help="comma-separated req/s (open loop, Poisson) instead")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests at a rate")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per level (default max(16, 2 x level))")
    p.add_argument("--workload", choices=["a", "fixed", "prefix-repetition"], default=None,
                   help="a: BENCHMARKS.md's workload A, its lengths scaled to the served max_model_len when that is "
                        "below 2,048; fixed: --input-len / --output-len (default: fixed when either is given, else a); "
                        "prefix-repetition (vLLM's dataset of that name): each prompt one of --num-prefixes shared "
                        "prefixes of --prefix-len tokens, then --input-len tokens of its own; the prefix cache's hit "
                        "rate is reported per level")
    p.add_argument("--input-len", type=int, default=None,
                   help="fixed workload: prompt tokens; prefix-repetition: each prompt's own tokens after the shared "
                        "prefix (default 128)")
    p.add_argument("--output-len", type=int, default=None, help="fixed and prefix-repetition workloads: output tokens "
                        "(default 128)")
    p.add_argument("--prefix-len", type=int, default=None, help="prefix-repetition: tokens of a shared prefix "
                        "(default 512)")
    p.add_argument("--num-prefixes", type=int, default=None, help="prefix-repetition: distinct shared prefixes a "
                        "level's prompts draw from (default 8)")
    p.add_argument("--token-id-max", type=int, default=None,
                   help="prompt ids are drawn from [0, this] (default: the served model's vocabulary - 1, else 10000)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not measured) before each run")
    p.add_argument("--output-dir", default="bench-serve-results", help="results.json and latency.png go here")
    p.add_argument("--quiet", action="store_true")
    EngineArgs.add_cli_args(p)  # for --launch; --seed also seeds the prompts and the arrival times
    p.set_defaults(func=cmd_bench_serve)
    return p


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from minfer.benchmark.serve import run

    return run(args)
