"""``minfer serve``: the OpenAI-compatible HTTP server (``minfer.server``) on one model."""
from __future__ import annotations

import argparse
import os
from typing import Any

from minfer.engine_args import EngineArgs, engine_kwargs
from minfer.reasoning import REASONING_PARSERS
from minfer.server.lora_modules import LoRAModulePath, parse_lora_module
from minfer.server.run import DEFAULT_MAX_WAITING, require_server_extra, run_server
from minfer.server.tool_parsers import TOOL_PARSERS

API_KEY_ENV = "MINFER_API_KEY"


def port_number(text: str) -> int:
    """argparse type of ``--port``: caught when parsing, not after the model has loaded."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 65535], got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 65535], got {port}")
    return port


def lora_module(text: str) -> LoRAModulePath:
    """argparse type of ``--lora-modules``: a bad value is named when parsing, before the model loads."""
    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with a demo web page at /")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="a checkpoint folder or hub id, as in `vllm serve MODEL` (or --model; default: the "
                        "built-in model)")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 serves every interface: set an API key then")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` on every route but /health, /metrics, /version and "
                        f"the pages (default: ${API_KEY_ENV}; unset: no key)")
    p.add_argument("--allowed-hosts", action="append", default=None, metavar="HOSTS",
                   help="Host names this server answers to beside the loopback ones (localhost, *.localhost, "
                        "127.0.0.1, [::1]), comma-separated or repeated: names, addresses, '.example.com' (it and "
                        "every name under it), '*' (any); any other Host is a 400, a guard against DNS rebinding "
                        "(default: none on a loopback --host; '*' on any other, with a warning when there is no "
                        "API key either)")
    p.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGINS",
                   help="web pages on other origins that may call the API from a browser (scheme://host[:port], "
                        "comma-separated or repeated, or '*'): they get CORS headers; a browser request from any "
                        "other origin but the server's own is a 400 (default: none)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template (a file, or the template itself) used instead of the tokenizer's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a request send its own chat_template (a Jinja program run on this server, each render "
                        "bounded in time); without it such a request is a 400")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice 'auto' (the default with tools): the model's answer is parsed for calls "
                        "by --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls: hermes (Qwen, Hermes: <tool_call> blocks), llama3_json "
                        "(Llama 3.x: a JSON object)")
    p.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="split a reasoning model's <think>...</think> text from its answer into reasoning_content: "
                        "qwen3 (both tags in the output), deepseek_r1 (the prompt opens <think>)")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name clients pass as `model` (repeatable; default: the model as given)")
    p.add_argument("--lora-modules", nargs="+", action="extend", type=lora_module, default=None,
                   metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) loaded at start-up, with --enable-lora: name=path, or vLLM's "
                        "JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a request's `model` "
                        "names one to run through it. Loading and unloading while serving (POST "
                        "/v1/load_lora_adapter, /v1/unload_lora_adapter) needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=true "
                        "(or MINFER_ALLOW_RUNTIME_LORA_UPDATING)")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING,
                   help="past this many requests waiting for their first token, new ones get 503 (0: no limit)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="larger request bodies get a 413 before they are parsed (default: 16 MiB; 0: no cap)")
    p.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine in a process of its own (the data-parallel path with one replica), so that "
                        "its loop and the HTTP event loop do not share a GIL (default: on when the engine runs on one "
                        "GPU; --no-engine-process keeps it on a thread of the server's process)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="new tokens a streamed chunk waits for (the first and the last chunk excepted); more tokens a "
                        "chunk cost the server less per token when it serves many streams at once (default 1)")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def serve_model(args: argparse.Namespace) -> str | None:
    """The positional MODEL or ``--model``; both given, they must agree."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
    return args.model_tag if args.model_tag is not None else args.model


def api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$MINFER_API_KEY``; an empty key would let every client in, so it is refused."""
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"the API key is empty (--api-key or ${API_KEY_ENV}); unset it to serve without one")
    return key.strip() if key is not None else None


def cmd_serve(args: argparse.Namespace) -> int:
    require_server_extra()
    from minfer.server.chat_template import load_chat_template
    from minfer.server.hosts import parse_flag_list

    model, key = serve_model(args), api_key(args)  # run_server checks the tool flags before the model loads
    template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    run_server(model, engine_kwargs(args), host=args.host, port=args.port,
               served_model_names=args.served_model_name, max_waiting_requests=args.max_waiting_requests,
               log_level=args.uvicorn_log_level, access_log=not args.no_access_log, api_key=key,
               chat_template=template, max_request_bytes=args.max_request_bytes,
               enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
               trust_request_chat_template=args.trust_request_chat_template,
               reasoning_parser=args.reasoning_parser, allowed_hosts=parse_flag_list(args.allowed_hosts),
               allowed_origins=parse_flag_list(args.allowed_origins), lora_modules=args.lora_modules,
               engine_process=args.engine_process, stream_interval=args.stream_interval)
    return 0
