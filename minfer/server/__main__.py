"""``python -m minfer.server serve|bench-serve ...``: the server commands without the main CLI.

The benchmark's ``--launch`` starts the server through this module, so it works on machines
whose ``minfer`` command does not (yet) mount the server subcommands.
"""
from __future__ import annotations

import argparse
import logging
import sys

from minfer.server.cli import add_bench_serve_parser, add_serve_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minfer.server")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_bench_serve_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"minfer {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
