"""``minfer serve`` and ``minfer bench-serve``: parsers the main CLI mounts, and the server runner.

Heavy imports (torch, FastAPI, uvicorn) happen inside the commands so ``minfer --help`` stays fast
and a machine without the server extra can still run the other commands.
"""
from __future__ import annotations

import argparse
import logging
from typing import Any

DEFAULT_MAX_WAITING = 1024


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
    from minfer.cli import _add_engine_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with a demo web page at /")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name clients pass as `model` (repeatable; default: --model as given)")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING,
                   help="past this many requests waiting for their first token, new ones get 503 (0: no limit)")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer: prompts must be token-id lists (e.g. random-weight benchmark shapes)")
    p.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    _add_engine_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def add_bench_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    from minfer.server.bench_serve import add_arguments

    p = subparsers.add_parser("bench-serve", help="benchmark a running server over HTTP (or launch one)")
    add_arguments(p)
    p.set_defaults(func=cmd_bench_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    from minfer.cli import _engine_kwargs

    run_server(args.model, _engine_kwargs(args), host=args.host, port=args.port,
               served_model_names=args.served_model_name, max_waiting_requests=args.max_waiting_requests,
               skip_tokenizer_init=args.skip_tokenizer_init, log_level=args.uvicorn_log_level,
               access_log=not args.no_access_log)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from minfer.server.bench_serve import run

    return run(args)


def run_server(model: str | None, engine_kwargs: dict[str, Any], host: str = "127.0.0.1", port: int = 8000,
               served_model_names: list[str] | None = None, max_waiting_requests: int | None = DEFAULT_MAX_WAITING,
               skip_tokenizer_init: bool = False, log_level: str = "info", access_log: bool = True) -> None:
    """Load the model, then serve until interrupted (SIGINT/SIGTERM shut down gracefully)."""
    import uvicorn

    from minfer.config import EngineConfig
    from minfer.engine.llm_engine import LLMEngine
    from minfer.llm import builtin_model_path
    from minfer.server.app import build_app

    if model is None:
        builtin = builtin_model_path()
        if not (builtin / "config.json").is_file():
            raise ValueError(f"the built-in model is not installed (no {builtin}/config.json); pass --model")
        model, names = str(builtin), served_model_names or ["minfer-builtin"]
    else:
        names = served_model_names or [model]
    config = EngineConfig.from_kwargs(model=model, skip_tokenizer_init=skip_tokenizer_init, **engine_kwargs)
    engine = LLMEngine(config, stream_text=True)
    logging.getLogger("minfer").info("serving %s as %s on http://%s:%d", model, names, host, port)
    app = build_app(engine, names, max_waiting_requests or None)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=5)
