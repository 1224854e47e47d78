"""The ``minfer`` command: generate | eval-ppl | bench | serve | bench-serve | train.

One module per command group adds its subparser and holds its handler; every heavy import
(torch, the engine, FastAPI) happens inside a handler, so ``minfer --help`` stays fast and a
machine without the ``server`` extra still runs the other commands.
"""
from __future__ import annotations

import argparse
import logging
import sys

from minfer.cli import bench, bench_serve, generate, serve
from minfer.train.command import add_train_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minfer", description="A compact, fast LLM inference engine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details (KV cache size, ...)")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_generate_parser(sub)
    generate.add_eval_ppl_parser(sub)
    bench.add_bench_parser(sub)
    serve.add_serve_parser(sub)
    bench_serve.add_bench_serve_parser(sub)
    add_train_parser(sub)
    for command in sub.choices.values():  # -v after the command too; SUPPRESS keeps one given before it
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log engine details (KV cache size, ...)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"minfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
