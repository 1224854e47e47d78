"""The FastAPI app: OpenAI routes, health, metrics, engine state, and the demo web page."""
from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from minfer.engine.async_engine import AsyncLLMEngine
from minfer.engine.llm_engine import LLMEngine
from minfer.server.chat import create_chat_completion
from minfer.server.completions import create_completion
from minfer.server.errors import install_error_handlers
from minfer.server.metrics import ServerMetrics
from minfer.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                    CompletionResponse, ErrorResponse, ModelCard, ModelList)
from minfer.server.serving import ClientGone, ServerContext

STATIC_DIR = Path(__file__).parent / "static"
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 404, 500, 503)}
_STREAMED = {"text/event-stream": {"schema": {"type": "string", "description": "SSE chunks, then [DONE]"}}}


def build_app(engine: LLMEngine, served_model_names: list[str] | None = None,
              max_waiting_requests: int | None = 1024) -> FastAPI:
    """Wrap ``engine`` (which the app's engine thread then owns) in the HTTP API.

    The engine thread starts and stops with the app's lifespan, on the server's event loop.
    """
    async_engine = AsyncLLMEngine(engine, max_waiting_requests)
    metrics = ServerMetrics(async_engine.stats, lambda: async_engine.healthy)
    async_engine.observer = metrics
    ctx = ServerContext(async_engine, served_model_names or [str(engine.config.model)])

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="minfer", summary="OpenAI-compatible serving of a minfer engine", lifespan=lifespan)
    app.state.ctx = ctx
    app.state.metrics = metrics
    install_error_handlers(app)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nobody is left to read it

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**_ERRORS, 200: {"content": _STREAMED}})
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, req, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERRORS, 200: {"content": _STREAMED}})
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, req, raw)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=ctx.created, max_model_len=ctx.max_model_len)
                               for name in ctx.served_model_names])

    @app.get("/health", responses={503: {"description": "the engine loop has died"}})
    async def health() -> JSONResponse:
        if async_engine.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "error": repr(async_engine.error)}, status_code=503)

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """Engine state for the web page's live panel (cheap: a snapshot, no engine call)."""
        return dict(async_engine.stats(), healthy=async_engine.healthy, model=ctx.model_name, max_model_len=ctx.max_model_len,
                    has_chat_template=bool(getattr(ctx.tokenizer, "chat_template", None)))

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
