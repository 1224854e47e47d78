"""Run the server: load the model into an engine, build the app, serve it with uvicorn until interrupted.

``minfer serve`` calls this, and so does the serving benchmark's ``--launch`` (in a child process,
with the engine arguments as a plain dict so that they cross 'spawn'). FastAPI, uvicorn and the
engine are imported inside, so importing this module costs nothing.
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Any

DEFAULT_MAX_WAITING = 1024
SERVER_EXTRA = ("fastapi", "uvicorn", "pydantic", "prometheus_client")


def require_server_extra() -> None:
    """Fail with the install command, not an ImportError deep in a traceback, when the extra is missing."""
    missing = [name for name in SERVER_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"the server needs the `server` extra ({', '.join(missing)} not installed): "
                         f"pip install 'minfer[server]'")


def run_server(model: str | None, engine_kwargs: dict[str, Any], host: str = "127.0.0.1", port: int = 8000,
               served_model_names: list[str] | None = None, max_waiting_requests: int | None = DEFAULT_MAX_WAITING,
               log_level: str = "info", access_log: bool = True) -> None:
    """Load the model, then serve until interrupted (SIGINT/SIGTERM shut down gracefully).

    ``engine_kwargs``: ``EngineConfig`` fields but ``model``; ``model`` None serves the built-in model.
    """
    import uvicorn

    from minfer.config import EngineConfig
    from minfer.engine.llm_engine import LLMEngine
    from minfer.llm import builtin_model_path
    from minfer.outputs import RequestOutputKind
    from minfer.server.app import build_app

    if model is None:
        builtin = builtin_model_path()
        if not (builtin / "config.json").is_file():
            raise ValueError(f"the built-in model is not installed (no {builtin}/config.json); pass --model")
        model, names = str(builtin), served_model_names or ["minfer-builtin"]
    else:
        names = served_model_names or [model]
    config = EngineConfig.from_kwargs(model=model, **engine_kwargs)
    engine = LLMEngine(config, RequestOutputKind.DELTA)  # the server streams deltas
    logging.getLogger("minfer").info("serving %s as %s on http://%s:%d", model, names, host, port)
    app = build_app(engine, names, max_waiting_requests or None)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=5)
