"""``minfer serve``: the OpenAI-compatible HTTP server (``minfer.server``) on one model."""
from __future__ import annotations

import argparse
from typing import Any

from minfer.engine_args import add_engine_args, engine_kwargs
from minfer.server.run import DEFAULT_MAX_WAITING, require_server_extra, run_server


def port_number(text: str) -> int:
    """argparse type of ``--port``: caught when parsing, not after the model has loaded."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 65535], got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 65535], got {port}")
    return port


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with a demo web page at /")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name clients pass as `model` (repeatable; default: --model as given)")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING,
                   help="past this many requests waiting for their first token, new ones get 503 (0: no limit)")
    p.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    require_server_extra()
    run_server(args.model, engine_kwargs(args), host=args.host, port=args.port,
               served_model_names=args.served_model_name, max_waiting_requests=args.max_waiting_requests,
               log_level=args.uvicorn_log_level, access_log=not args.no_access_log)
    return 0
