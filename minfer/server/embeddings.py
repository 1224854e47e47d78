"""POST /v1/embeddings, OpenAI's shape (the official client's ``client.embeddings.create`` works), on a server whose
engine runs ``--runner pooling``.

``input`` is a text, a list of texts, token ids or a list of token-id lists (the completions' ``Prompt``), each
one request through the scheduler (``engine/pooling.py``); ``encoding_format`` "float" (lists of floats) or
"base64" (each vector's float32 little-endian bytes, which the client asks for by default and decodes itself);
``dimensions`` only where the model is a Matryoshka one (its config.json says so), else a 400 naming the field;
``usage.prompt_tokens`` counts every input's tokens. vLLM's ``add_special_tokens`` is accepted. A server that
generates answers this route with a 400, as a pooling one answers completions and chat (``ServerContext.submit``).
"""
from __future__ import annotations

import base64
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from minfer.engine.processor import Processor
from minfer.pooling_params import PoolingParams
from minfer.server.errors import APIError
from minfer.server.offload import OffloadedBodyRoute
from minfer.server.protocol import Prompt
from minfer.server.request_fields import RequestModel, Text
from minfer.server.responses import ErrorResponse
from minfer.server.serving import ServerContext, collect, process, request_id

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 404, 500, 503)}


class EmbeddingRequest(RequestModel):
    """POST /v1/embeddings (OpenAI's fields, and vLLM's ``add_special_tokens``)."""

    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="a Matryoshka model's first k dimensions")
    user: Text | None = None
    add_special_tokens: bool = Field(True, description="vLLM's: BOS etc. when tokenizing a text input")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def embeddings_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(route_class=OffloadedBodyRoute)  # bodies parsed off the event loop

    @router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def embeddings(req: EmbeddingRequest, raw: Request) -> JSONResponse:
        return await create_embedding(ctx, req, raw)

    return router


async def create_embedding(ctx: ServerContext, req: EmbeddingRequest, raw: Request) -> JSONResponse:
    model = ctx.check_model(req.model)
    if not ctx.pooling:
        raise APIError(400, "this server generates text: /v1/embeddings needs a server started with --runner pooling")
    inputs = [req.input] if isinstance(req.input, str) or isinstance(req.input[0], int) else list(req.input)
    ctx.check_count(len(inputs), 1, "input")
    if any(isinstance(i, str) for i in inputs):
        ctx.require_tokenizer("a text input", "input")
    params = PoolingParams(dimensions=req.dimensions)
    try:
        ctx.engine.engine.pooler.config.check(params)  # fixed facts of the model: safe off the engine thread
    except ValueError as exc:
        raise APIError(400, str(exc), "dimensions") from exc
    eid, created = request_id("embd"), int(time.time())

    def prepare(p: Processor) -> list[Any]:
        return [process(p, f"{eid}-{i}", text if isinstance(text, str) else None,
                        None if isinstance(text, str) else text, params,
                        "input" if len(inputs) == 1 else f"input[{i}]", req.add_special_tokens)
                for i, text in enumerate(inputs)]

    requests = await ctx.offload(prepare)
    finals = await collect(ctx, raw, ctx.submit(requests))
    num_tokens = sum(len(r.prompt_token_ids) for r in requests)
    data = [{"object": "embedding", "index": i, "embedding": _encode(out.data, req.encoding_format)}
            for i, out in enumerate(finals)]
    return JSONResponse({"id": eid, "object": "list", "created": created, "model": model, "data": data,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def _encode(vector: Any, encoding_format: str) -> list[float] | str:
    """A float32 CPU tensor as a list of floats, or as base64 of its little-endian float32 bytes."""
    if encoding_format == "float":
        return vector.tolist()
    return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
