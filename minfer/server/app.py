"""The FastAPI app: OpenAI routes, tokenize/detokenize, health, metrics, engine state, the demo web page and
the API docs (served from a packaged copy, so /docs works offline)."""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline

from minfer.engine.async_engine import AsyncLLMEngine
from minfer.engine.dp.client import DataParallelEngine
from minfer.engine.dp.engine import DataParallelLLMEngine
from minfer.engine.llm_engine import LLMEngine
from minfer.server.auth import APIKeyMiddleware
from minfer.server.chat import create_chat_completion
from minfer.server.completions import create_completion
from minfer.server.embeddings import embeddings_router
from minfer.server.errors import install_error_handlers
from minfer.server.hosts import HostAllowList, HostOriginMiddleware, check_origins
from minfer.server.limits import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimitMiddleware
from minfer.server.lora import lora_router
from minfer.server.lora_modules import LoRAModulePath, check_lora_modules, runtime_updating_allowed
from minfer.server.metrics import ServerMetrics
from minfer.server.offload import ClientGone, OffloadedBodyRoute
from minfer.server.protocol import ChatCompletionRequest, CompletionRequest
from minfer.server.reasoning import check_reasoning_flag
from minfer.server.responses import ChatCompletionResponse, CompletionResponse, ErrorResponse, ModelCard, ModelList
from minfer.server.responses_api import responses_router
from minfer.server.routes_tokenize import tokenize_router
from minfer.server.serving import ServerContext, check_stream_interval
from minfer.server.tool_parsers import check_tool_flags
from minfer.version import __version__

STATIC_DIR = Path(__file__).parent / "static"
DOCS_STATIC = "/docs-static"  # Swagger UI and ReDoc from the fastapi-offline package: /docs works offline
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 404, 500, 503)}
_STREAMED = {"text/event-stream": {"schema": {"type": "string", "description": "SSE chunks, then [DONE]"}}}


def build_app(engine: LLMEngine | DataParallelLLMEngine, served_model_names: list[str] | None = None,
              max_waiting_requests: int | None = 1024, api_key: str | None = None,
              chat_template: str | None = None,
              max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None, on_engine_dead: Callable[[str], None] | None = None,
              trust_request_chat_template: bool = False, reasoning_parser: str | None = None,
              allowed_hosts: Sequence[str] = (), allowed_origins: Sequence[str] = (),
              lora_modules: Sequence[LoRAModulePath] = (), allow_runtime_lora_updating: bool | None = None,
              stream_interval: int = 1) -> FastAPI:
    """Wrap ``engine`` (which the app's engine thread then owns) in the HTTP API; a ``DataParallelLLMEngine``'s
    replicas are served through a ``DataParallelEngine`` (``engine/dp/client.py``) in place of that thread.

    The engine thread starts and stops with the app's lifespan, on the server's event loop.
    ``api_key``: every route but the probes and pages (``auth.OPEN_PATHS``) then needs it as a bearer
    token. ``chat_template``: the template text, set on the engine's tokenizer before any copy of it
    is made, so every copy (the event loop's, the tokenizer pool's) renders chats with it.
    ``max_request_bytes``: larger bodies get a 413 before anything parses them (None: no cap).
    ``enable_auto_tool_choice``, ``tool_call_parser``: ``tool_choice="auto"`` is allowed, its answers read by
    that parser (a name in ``tool_parsers.TOOL_PARSERS``); vLLM's pair of flags, the first needing the second.
    ``on_engine_dead``: called on the event loop, with the failure's summary, once the engine has died and the
    requests in flight have failed (``minfer serve`` exits there, so that a supervisor restarts it); without
    it the app goes on answering 503 on /health and 500 to requests.
    ``trust_request_chat_template``: a request may send its own ``chat_template`` (vLLM's
    ``--trust-request-chat-template``); without it that field is a 400.
    ``reasoning_parser``: chat answers' ``<think>`` text goes to ``reasoning_content`` (vLLM's
    ``--reasoning-parser``: a name in ``minfer.reasoning.REASONING_PARSERS``); None: all of it is content.
    ``allowed_hosts``: the Host names the server answers to beside the loopback ones (``hosts.HostAllowList``:
    names, addresses, ``.suffix`` patterns, ``*``); any other is a 400 before anything else runs (DNS rebinding).
    ``allowed_origins``: pages on other origins (``scheme://host[:port]``, or ``*``) that may call the API from a
    browser: they get CORS headers; a browser request from any other origin but the server's own is a 400.
    ``lora_modules``: LoRA adapters (``--lora-modules``, the engine built with ``enable_lora``) loaded here, before
    the engine thread starts, with ids 1, 2, ...; a request's ``model`` names one to run through it. The first that
    fails stops start-up with a ValueError naming it. ``allow_runtime_lora_updating``: POST /v1/load_lora_adapter and
    /v1/unload_lora_adapter work (with ``enable_lora``); None: as ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (or
    ``MINFER_ALLOW_RUNTIME_LORA_UPDATING``) says.
    ``stream_interval``: a streamed response's chunk waits for this many new tokens (the first and the last
    excepted): fewer chunks cost the event loop less per token at high concurrency, the price being coarser
    streaming (vLLM's ``--stream-interval``; 1 to ``serving.MAX_STREAM_INTERVAL``).
    """
    check_stream_interval(stream_interval)
    allowed_hosts, allowed_origins = tuple(allowed_hosts), check_origins(allowed_origins)
    HostAllowList(allowed_hosts)  # a bad pattern fails here, before the engine thread starts
    check_tool_flags(enable_auto_tool_choice, tool_call_parser)
    check_reasoning_flag(reasoning_parser)
    served_names = served_model_names or [str(engine.config.model)]
    check_lora_modules(lora_modules, served_names, engine.config.enable_lora)
    runtime_lora = runtime_updating_allowed() if allow_runtime_lora_updating is None else allow_runtime_lora_updating
    if chat_template is not None:
        if engine.processor.tokenizer is None:
            raise ValueError("--chat-template needs a tokenizer, but the server runs with --skip-tokenizer-init")
        engine.processor.tokenizer.chat_template = chat_template
    serving = DataParallelEngine if isinstance(engine, DataParallelLLMEngine) else AsyncLLMEngine
    async_engine = serving(engine, max_waiting_requests)  # type: ignore[arg-type]
    ctx = ServerContext(async_engine, served_names,
                        auto_tool_parser=tool_call_parser if enable_auto_tool_choice else None,
                        trust_request_chat_template=trust_request_chat_template,
                        reasoning_parser=reasoning_parser, stream_interval=stream_interval)
    try:
        ctx.loras.load_static(engine, lora_modules)
    except BaseException:
        ctx.close()
        raise
    if runtime_lora and engine.config.enable_lora:
        logging.getLogger("minfer.server").warning(
            "runtime LoRA updating is on: a client with the API key can load any adapter folder on this machine")
    metrics = ServerMetrics(async_engine.stats, lambda: async_engine.healthy, ctx.model_name, ctx.max_model_len)
    async_engine.observer = metrics
    async_engine.on_dead = on_engine_dead

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()
            ctx.close()

    app = FastAPIOffline(title="minfer", summary="OpenAI-compatible serving of a minfer engine", lifespan=lifespan,
                         version=__version__, static_url=DOCS_STATIC)
    app.state.ctx = ctx
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_request_bytes=max_request_bytes)
    if api_key is not None:  # added later, so it runs earlier: a bad key is a 401 before the body is read
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_prefixes=("/static/", DOCS_STATIC + "/"))
    if allowed_origins:  # outside the key: preflights are answered, and a 401 carries the CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(HostOriginMiddleware, allowed_hosts=allowed_hosts,  # added last, so it runs first
                       allowed_origins=allowed_origins)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nobody is left to read it

    openai_routes = APIRouter(route_class=OffloadedBodyRoute)  # bodies parsed off the event loop

    @openai_routes.post("/v1/completions", response_model=CompletionResponse,
                        responses={**_ERRORS, 200: {"content": _STREAMED}})
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, req, raw)

    @openai_routes.post("/v1/chat/completions", response_model=ChatCompletionResponse,
                        responses={**_ERRORS, 200: {"content": _STREAMED}})
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, req, raw)

    app.include_router(openai_routes)
    app.include_router(lora_router(ctx.loras, runtime_lora))
    app.include_router(responses_router(ctx))  # POST /v1/responses, GET and DELETE /v1/responses/{id}

    def card(name: str) -> ModelCard:
        """vLLM's fields: an adapter's ``root`` is its folder and its ``parent`` the served model it adapts."""
        adapter = ctx.loras.adapters.get(name) if name not in ctx.served_model_names else None
        if adapter is not None:
            return ModelCard(id=name, created=ctx.created, max_model_len=ctx.max_model_len,
                             root=adapter.request.lora_path, parent=adapter.parent)
        return ModelCard(id=name, created=ctx.created, max_model_len=ctx.max_model_len, root=str(engine.config.model))

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in [*ctx.served_model_names, *ctx.loras.names()]])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
    async def model(model_id: str) -> ModelCard:
        """A path parameter: hub ids hold a slash (``client.models.retrieve("org/name")``)."""
        return card(ctx.check_model(model_id))

    app.include_router(tokenize_router(ctx))
    app.include_router(embeddings_router(ctx))  # POST /v1/embeddings (--runner pooling)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/health", responses={503: {"description": "the engine has died"}})
    async def health() -> JSONResponse:
        failure = async_engine.failure  # open to all (a probe): what failed, never the error's text (paths)
        if failure is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine_dead", "error": failure}, status_code=503)

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """Engine state for the web page's live panel (cheap: a snapshot, no engine call)."""
        return dict(async_engine.stats(), healthy=async_engine.healthy, model=ctx.model_name, max_model_len=ctx.max_model_len,
                    vocab_size=ctx.processor.vocab_size,
                    has_chat_template=bool(getattr(ctx.tokenizer, "chat_template", None)))

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
