"""Ray Serve: ``serve.run(serve_app(model, ...))`` serves the OpenAI routes of ``minfer serve``, one engine a replica.

The driver only checks the arguments (engine fields, tool and reasoning parsers, hosts, origins, LoRA names, the
chat template file) so a mistake fails there, before any replica loads weights. Each replica then builds its own
engine and ``build_app``'s FastAPI app (Serve's ``ingress`` with a builder function, which Serve calls inside the
replica), and Serve runs the app's lifespan there: the engine thread starts on the replica's event loop, and stops
with the engine's workers when Serve stops the replica. Serve's HTTP proxy takes the place of uvicorn and balances
requests over the replicas; ``check_health`` reports a dead engine, so Serve replaces the replica where
``minfer serve`` would exit for its supervisor to restart it.

``app_builder`` is the same application for Serve's CLI and config files (``serve run minfer.ray:app_builder
model=... tensor_parallel_size=2 num_replicas=2``), whose values arrive as text.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import json
import typing
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Mapping, Sequence

from minfer.config import EngineConfig
from minfer.engine_args import builtin_model
from minfer.ray.extra import require_ray
from minfer.server.chat_template import load_chat_template
from minfer.server.hosts import HostAllowList, check_origins
from minfer.server.lora_modules import LoRAModulePath, check_lora_modules, parse_lora_module
from minfer.server.reasoning import check_reasoning_flag
from minfer.server.run import DEFAULT_MAX_WAITING, require_server_extra
from minfer.server.tool_parsers import check_tool_flags

if TYPE_CHECKING:
    from fastapi import FastAPI
    from ray.serve import Application

BUILTIN_NAME = "minfer-builtin"  # the served name of the built-in model, as `minfer serve` calls it
ALIASES = {"served_model_name": "served_model_names"}  # `minfer serve`'s flag spelling, for app_builder


def serve_app(model: str | None = None, *, served_model_names: Sequence[str] | None = None,
              max_waiting_requests: int | None = DEFAULT_MAX_WAITING, api_key: str | None = None,
              chat_template: str | None = None, max_request_bytes: int | None = None,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              trust_request_chat_template: bool = False, reasoning_parser: str | None = None,
              allowed_hosts: Sequence[str] | None = None, allowed_origins: Sequence[str] | None = None,
              lora_modules: Sequence[LoRAModulePath | str] | None = None,
              allow_runtime_lora_updating: bool | None = None, num_replicas: int | str | None = None,
              autoscaling_config: Mapping[str, Any] | None = None, ray_actor_options: Mapping[str, Any] | None = None,
              max_ongoing_requests: int | None = None, deployment_options: Mapping[str, Any] | None = None,
              **engine_kwargs: Any) -> Application:
    """The Serve application: ``serve.run(serve_app("org/model", tensor_parallel_size=2, num_replicas=2))``.

    ``model``: a checkpoint folder (made absolute here, since replicas may run in another directory) or hub id;
    None: the built-in model, served as ``minfer-builtin``. Every keyword not named below is an engine argument
    (``EngineConfig``'s fields, checked here). The server's arguments are ``build_app``'s, as ``minfer serve``
    takes them: ``chat_template`` is a file or the template's text, ``lora_modules`` ``LoRAModulePath``s or
    ``name=path`` strings (adapter folders must exist where the replicas run). ``allowed_hosts`` None: any Host,
    since Serve's proxy, not this app, decides which interfaces listen (``serve.start(http_options=...)``).

    Serve's side: ``num_replicas`` (an int, or ``"auto"``) or ``autoscaling_config`` (Serve's dict: set its
    ``target_ongoing_requests`` near ``max_num_seqs``, as Serve's default of 2 would add a replica for every two
    requests); ``ray_actor_options`` (default: ``num_gpus`` = ``tensor_parallel_size``, none with
    ``device="cpu"``: the tensor-parallel ranks run as processes inside the replica, so its GPUs must share a
    node); ``max_ongoing_requests`` (default: ``max_num_seqs``, what the engine runs at once, so the rest wait in
    Serve's queue for the first replica with room); ``deployment_options``: any other ``serve.deployment`` option.
    """
    require_ray()
    require_server_extra()
    from ray import serve

    check_tool_flags(enable_auto_tool_choice, tool_call_parser)
    check_reasoning_flag(reasoning_parser)
    hosts = list(allowed_hosts) if allowed_hosts is not None else ["*"]
    HostAllowList(hosts)
    origins = check_origins(list(allowed_origins or ()))
    names = list(served_model_names or [model or BUILTIN_NAME])  # the model as given, as `minfer serve` names it
    model = _absolute(model) if model is not None else None
    modules = [_lora_module(m) for m in lora_modules or ()]
    check_lora_modules(modules, names, bool(engine_kwargs.get("enable_lora", False)))
    config = EngineConfig.from_kwargs(model=model or builtin_model(), **engine_kwargs)  # a bad field fails here
    if config.data_parallel_size != 1:
        raise ValueError("serve_app runs one engine per Serve replica: pass num_replicas (or autoscaling_config) "
                         "instead of data_parallel_size")
    app_kwargs = dict(served_model_names=names, max_waiting_requests=max_waiting_requests or None, api_key=api_key,
                      chat_template=load_chat_template(chat_template) if chat_template is not None else None,
                      enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                      trust_request_chat_template=trust_request_chat_template, reasoning_parser=reasoning_parser,
                      allowed_hosts=hosts, allowed_origins=origins, lora_modules=modules,
                      allow_runtime_lora_updating=allow_runtime_lora_updating)
    if max_request_bytes is not None:
        app_kwargs["max_request_bytes"] = max_request_bytes or None  # 0: no cap, as `minfer serve` reads it
    gpus = 0 if config.device == "cpu" else config.tensor_parallel_size
    options: dict[str, Any] = {"ray_actor_options": {"num_gpus": gpus, **(ray_actor_options or {})},
                               "max_ongoing_requests": max_ongoing_requests or config.max_num_seqs}
    if num_replicas is not None:
        options["num_replicas"] = num_replicas
    if autoscaling_config is not None:
        options["autoscaling_config"] = dict(autoscaling_config)
    options.update(deployment_options or {})
    ingress = serve.ingress(_replica_builder(model, engine_kwargs, app_kwargs))(MinferServer)
    return serve.deployment(ingress, **options).bind()


class MinferServer:
    """A Serve replica of the OpenAI server. Serve's ingress wrapper subclasses it and sets ``app`` to the
    replica's FastAPI app; Serve calls ``check_health`` every ``health_check_period_s``."""

    def check_health(self) -> None:
        """A dead engine (a tensor-parallel worker gone, a device error) fails the check: Serve then replaces
        the replica, where its /health would answer 503 and its requests 500 for good."""
        serving = self.app.state.ctx.engine  # type: ignore[attr-defined]  # AsyncLLMEngine
        if not serving.healthy:
            raise RuntimeError(f"the minfer engine has stopped: {serving.failure or serving.error}")


def _replica_builder(model: str | None, engine_kwargs: dict[str, Any],
                     app_kwargs: dict[str, Any]) -> Callable[[], FastAPI]:
    """A plain function (Serve tells a builder from an ASGI app by that) that carries the arguments to the
    replica, pickled with the deployment."""

    def build() -> FastAPI:
        return build_replica_app(model, engine_kwargs, app_kwargs)

    return build


def build_replica_app(model: str | None, engine_kwargs: dict[str, Any], app_kwargs: dict[str, Any]) -> FastAPI:
    """Inside a replica: load the engine (streaming deltas, as ``minfer serve``'s) and wrap it in ``build_app``;
    the app's lifespan also stops the engine's workers, since no ``run_server`` is there to."""
    from minfer.engine.llm_engine import LLMEngine
    from minfer.outputs import RequestOutputKind
    from minfer.server.app import build_app

    config = EngineConfig.from_kwargs(model=model or builtin_model(), **engine_kwargs)
    engine = LLMEngine(config, RequestOutputKind.DELTA)
    try:
        app = build_app(engine, **app_kwargs)
    except BaseException:
        engine.shutdown()
        raise
    serving_lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(asgi_app: Any) -> AsyncIterator[Any]:
        try:
            async with serving_lifespan(asgi_app) as state:
                yield state
        finally:
            engine.shutdown()

    app.router.lifespan_context = lifespan
    return app


def app_builder(args: dict[str, Any]) -> Application:
    """Serve's application builder (``serve run minfer.ray:app_builder key=value ...``, or ``import_path`` and
    ``args`` in a Serve config file): ``serve_app`` with ``serve_app_kwargs(args)``."""
    return serve_app(**serve_app_kwargs(args))


def serve_app_kwargs(args: Mapping[str, Any]) -> dict[str, Any]:
    """``serve_app``'s keywords, engine arguments included, from text (Serve's command line: ``true``/``false``,
    numbers, JSON lists and objects, comma-separated lists, ``none``) or typed values (a YAML config file). Dashes
    may stand for underscores; ``served_model_name`` is ``minfer serve``'s spelling. An unknown name is left for
    ``serve_app`` to refuse, naming it."""
    hints = {**typing.get_type_hints(EngineConfig),
             **typing.get_type_hints(serve_app, localns={"Application": Any})}
    kwargs = {}
    for key, value in args.items():
        name = key.replace("-", "_")
        name = ALIASES.get(name, name)
        kwargs[name] = _from_text(name, value, hints[name]) if name in hints else value
    return kwargs


def _from_text(name: str, value: Any, hint: Any) -> Any:
    """``value`` as the type ``hint`` names, when it came as text; anything else as it came (the checks in
    ``serve_app`` and ``EngineConfig`` name a wrong value)."""
    if not isinstance(value, str):
        return value
    kinds = [k for k in typing.get_args(hint) if k is not type(None)] if typing.get_args(hint) else [hint]
    if type(None) in typing.get_args(hint) and value.strip().lower() in ("none", "null", ""):
        return None
    for kind in kinds:
        origin = typing.get_origin(kind) or kind
        if origin is bool:
            if value.strip().lower() in ("true", "1", "yes", "on"):
                return True
            if value.strip().lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError(f"{name} must be true or false, got {value!r}")
        if origin in (int, float):
            try:
                return origin(value)
            except ValueError:
                continue
        if origin in (list, tuple, collections.abc.Sequence):
            return json.loads(value) if value.lstrip().startswith("[") else [v for v in value.split(",") if v]
        if origin in (dict, collections.abc.Mapping):
            return json.loads(value)
    return value


def _absolute(model: str) -> str:
    """A local folder as an absolute path (a replica's working directory is not the driver's); a hub id as is."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def _lora_module(module: LoRAModulePath | str) -> LoRAModulePath:
    module = parse_lora_module(module) if isinstance(module, str) else module
    return dataclasses.replace(module, path=_absolute(module.path))
