"""Run the server: load the model into an engine, build the app, serve it with uvicorn until interrupted.

``minfer serve`` calls this, and so does the serving benchmark's ``--launch`` (in a child process,
with the engine arguments as a plain dict so that they cross 'spawn'). FastAPI, uvicorn and the
engine are imported inside, so importing this module costs nothing.
"""
from __future__ import annotations

import importlib.util
import logging
import signal
import threading
from typing import Any

from minfer.server.lora_modules import LoRAModulePath, check_lora_modules
from minfer.server.reasoning import check_reasoning_flag
from minfer.server.tool_parsers import check_tool_flags

DEFAULT_MAX_WAITING = 1024
ENGINE_DEAD_EXIT_STATUS = 70  # sysexits' EX_SOFTWARE: the engine died while serving (for a supervisor to restart)
SERVER_EXTRA = ("fastapi", "fastapi_offline", "uvicorn", "pydantic", "prometheus_client")
# minfer is not published on PyPI: it is installed from its checkout, and so is an extra.
_INSTALL = 'in the minfer checkout, run pip install -e ".[server]"'

logger = logging.getLogger("minfer")


def require_server_extra() -> None:
    """Fail with the install command, not an ImportError deep in a traceback, when the extra is missing."""
    missing = [name for name in SERVER_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"the server needs the `server` extra ({', '.join(missing)} not installed): {_INSTALL}")


def run_server(model: str | None, engine_kwargs: dict[str, Any], host: str = "127.0.0.1", port: int = 8000,
               served_model_names: list[str] | None = None, max_waiting_requests: int | None = DEFAULT_MAX_WAITING,
               log_level: str = "info", access_log: bool = True, api_key: str | None = None,
               chat_template: str | None = None, max_request_bytes: int | None = None,
               enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
               trust_request_chat_template: bool = False, reasoning_parser: str | None = None,
               allowed_hosts: list[str] | None = None, allowed_origins: list[str] | None = None,
               lora_modules: list[LoRAModulePath] | None = None, engine_process: bool | None = None,
               stream_interval: int = 1) -> None:
    """Load the model, then serve until interrupted (SIGINT/SIGTERM shut down gracefully) or until the engine
    dies (a tensor-parallel worker, a device error): then the requests in flight fail, the server stops and
    the process exits with ``ENGINE_DEAD_EXIT_STATUS`` (``SystemExit``), where a server answering 503s forever
    would never be restarted. The engine's tensor-parallel workers stop however serving ends, and so do the
    replicas of ``data_parallel_size`` > 1 (``engine/dp/``: this process then loads no weights; the server exits
    only once every replica has died, and /health names a dead one while the others serve).

    ``engine_kwargs``: ``EngineConfig`` fields but ``model``; ``model`` None serves the built-in model.
    ``chat_template``: the template's text (``chat_template.load_chat_template`` reads a file).
    ``enable_auto_tool_choice``, ``tool_call_parser``: see ``build_app`` (checked before the model loads).
    ``trust_request_chat_template``, ``reasoning_parser``: see ``build_app`` (the parser's name is checked
    before the model loads).
    ``allowed_hosts``: see ``build_app``; None: the loopback names alone on a loopback ``host``, else ``*``.
    ``allowed_origins``: see ``build_app`` (both are checked before the model loads).
    ``lora_modules``: see ``build_app`` (their names and ``enable_lora`` are checked before the model loads, the
    adapters themselves once it has).
    ``engine_process``: one engine in a process of its own (the data-parallel path with one replica), so that the
    engine loop and this process's event loop do not share a GIL; its messages cost pickling on both sides. None:
    ``default_engine_process`` (on a GPU the event loop's share of one GIL held the 8B shape's server back: 1.21x
    the tokens at 256 clients in its own process; a CPU engine's own sampling and pickling outweigh that).
    ``stream_interval``: see ``build_app`` (checked before the model loads).
    """
    require_server_extra()
    try:
        import uvicorn

        from minfer.server.app import build_app
        from minfer.server.hosts import HostAllowList, check_origins, default_allowed_hosts, is_loopback
        from minfer.server.http_protocol import http_protocol
        from minfer.server.serving import check_stream_interval
    except ImportError as exc:  # installed, but broken (a dependency of the extra is missing)
        raise ValueError(f"the server's packages do not import ({exc}): {_INSTALL}") from None

    check_tool_flags(enable_auto_tool_choice, tool_call_parser)
    check_reasoning_flag(reasoning_parser)
    check_stream_interval(stream_interval)
    hosts = allowed_hosts if allowed_hosts is not None else default_allowed_hosts(host)
    any_host = HostAllowList(hosts).any
    origins = check_origins(allowed_origins or [])
    if api_key is None and not is_loopback(host):
        logger.warning("serving on %s without an API key: anyone who can reach this port can use the model%s "
                       "(pass --api-key or set MINFER_API_KEY)", host,
                       ", and with any Host header a web page in a browser that reaches it can too (DNS rebinding;"
                       " --allowed-hosts names the hosts to answer to)" if any_host else "")
    elif api_key is None and any_host:
        logger.warning("--allowed-hosts '*' without an API key: a web page in your browser can reach this server "
                       "by DNS rebinding (pass --api-key, or name the hosts to answer to)")

    from minfer.config import EngineConfig
    from minfer.engine.dp.engine import DataParallelLLMEngine
    from minfer.engine.gc_heap import heap_frozen
    from minfer.engine.llm_engine import LLMEngine
    from minfer.llm import builtin_model_path
    from minfer.outputs import RequestOutputKind

    if model is None:
        builtin = builtin_model_path()
        if not (builtin / "config.json").is_file():
            raise ValueError(f"the built-in model is not installed (no {builtin}/config.json); pass a model")
        model, names = str(builtin), served_model_names or ["minfer-builtin"]
    else:
        names = served_model_names or [model]
    check_lora_modules(lora_modules or [], names, bool(engine_kwargs.get("enable_lora", False)))
    config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
    if engine_process is None:
        engine_process = default_engine_process(config)
    replicas = config.data_parallel_size > 1 or engine_process
    engine_class = DataParallelLLMEngine if replicas else LLMEngine  # replicas: engine/dp/
    engine = engine_class(config, RequestOutputKind.DELTA)  # the server streams deltas
    # uvicorn handles SIGTERM while it serves, shuts down gracefully, then restores the handler it found and
    # raises the signal again: with the default handler the process would end right there, before the
    # workers are stopped. Ours raises _Terminated instead; the signal is raised again once they are stopped.
    catching = threading.current_thread() is threading.main_thread()  # handlers can be set there only
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if catching else None
    terminated = False
    died: list[str] = []
    server: Any = None

    def engine_dead(failure: str) -> None:  # on the event loop, once the requests in flight have failed
        logger.error("the engine has stopped (%s): the server stops, exit status %d", failure, ENGINE_DEAD_EXIT_STATUS)
        died.append(failure)
        server.should_exit = True

    try:
        logger.info("serving %s as %s on http://%s:%d", model, names, host, port)
        limit = {} if max_request_bytes is None else {"max_request_bytes": max_request_bytes or None}  # 0: no cap
        app = build_app(engine, names, max_waiting_requests or None, api_key=api_key, chat_template=chat_template,
                        enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                        on_engine_dead=engine_dead, trust_request_chat_template=trust_request_chat_template,
                        reasoning_parser=reasoning_parser, allowed_hosts=hosts, allowed_origins=origins,
                        lora_modules=lora_modules or (), stream_interval=stream_interval, **limit)
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                                               timeout_graceful_shutdown=5, http=http_protocol()))
        try:
            with heap_frozen():  # the start-up heap out of full collections while serving (engine/gc_heap.py)
                server.run()
        except KeyboardInterrupt:  # Ctrl-C: uvicorn has stopped gracefully and raised it again; end quietly
            pass
        if not server.started and not died:
            from uvicorn.main import STARTUP_FAILURE

            raise SystemExit(STARTUP_FAILURE)  # as uvicorn.run ends when it cannot start (the port is taken)
    except _Terminated:
        terminated = True
    finally:  # a normal stop, Ctrl-C, SIGTERM, or a crash in uvicorn or the app: the tensor-parallel workers stop
        if catching:  # first, so that a second SIGTERM while they stop ends the process at once
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        engine.shutdown()
        if replicas:
            logger.info("the data-parallel replicas have stopped" if config.data_parallel_size > 1 else
                        "the engine process has stopped")
        elif config.tensor_parallel_size > 1:
            logger.info("the tensor-parallel workers have stopped")
    if terminated:  # end as SIGTERM ends the process (its exit status says so), now that the workers are gone
        signal.raise_signal(signal.SIGTERM)
    if died:
        raise SystemExit(ENGINE_DEAD_EXIT_STATUS)


def default_engine_process(config: Any) -> bool:
    """Whether ``minfer serve`` runs its engine in a process of its own when not told: on one GPU (``config``: the
    ``EngineConfig``), where serving measured faster so (``benchmarks/RESULTS.md``, the serve runs of issue 42). A
    tensor-parallel engine keeps its thread until a replica's workers have been served on GPUs."""
    return config.resolved_device().type == "cuda" and config.tensor_parallel_size == 1


class _Terminated(BaseException):
    """SIGTERM arrived (a BaseException, as KeyboardInterrupt is, so no ``except Exception`` swallows it)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated()
