"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A response is a chat completion underneath: the request becomes a ``ChatCompletionRequest`` (``instructions`` a
system message, then the stored conversation of ``previous_response_id``, then the input's items as chat messages;
flat function tools nested as chat's; ``text.format`` as ``response_format``; ``max_output_tokens`` as
``max_completion_tokens``; ``reasoning.effort`` as ``reasoning_effort``) and runs through ``chat.start_chat``: the
same model and LoRA names, checks, template, tool plan, constraints, sampling fields and queueing as chat. An
error found there names the Responses API's field (``input``, ``text.format``, ``tools[0].parameters``, ...).
Its output is read by ``responses_stream.ResponseBuilder`` (chat's reasoning and tool parsers) into output items,
whole or as the Responses API's event stream.

``text.format`` shapes the message's text; with ``tool_choice`` ``required`` or a named function the output is
the call and no message, so the format does not apply to that turn (chat would refuse the two constraints
together; an agent that wants both a forced tool call and a typed final answer sends exactly that). The
conversation is kept (``store``, the default) in ``responses_store.ResponseStore``, bounded and in memory, once
the response is whole (a stream its client left early is not kept). A cut stream ends with ``response.incomplete``,
as OpenAI's does (the client's ``stream.get_final_response()`` then raises; the event carries the response).
"""
from __future__ import annotations

import re
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from minfer.outputs import RequestOutput
from minfer.server.chat import start_chat
from minfer.server.errors import APIError
from minfer.server.offload import OffloadedBodyRoute
from minfer.server.protocol import ChatCompletionRequest
from minfer.server.request_fields import SamplingFields
from minfer.server.responses import ErrorResponse
from minfer.server.responses_protocol import FunctionChoice, ResponsesRequest, input_messages
from minfer.server.responses_store import ResponseStore
from minfer.server.responses_stream import ResponseBuilder, event_sse, item_id, output_messages
from minfer.server.serving import ServerContext, collect, stream_response
from minfer.server.stream import DeltaTracker, holdback_for

# The sampling fields (OpenAI's and vLLM's extras) a response passes to chat as they are.
_PASSED = frozenset(SamplingFields.model_fields) - {"n", "stream_options", "response_format", "model", "stream"}
# Chat's parameter names in an error, as the Responses API names them.
_RENAMES = [(re.compile(r"^messages(\[.*)?$"), "input"),
            (re.compile(r"^max_(completion_)?tokens$"), "max_output_tokens"),
            (re.compile(r"^response_format\.json_schema\.schema$"), "text.format.schema"),
            (re.compile(r"^response_format(\..*)?$"), "text.format"),
            (re.compile(r"^tools\[(\d+)\]\.function\.(.*)$"), r"tools[\1].\2"),
            (re.compile(r"^reasoning_effort$"), "reasoning.effort")]
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 404, 500, 503)}


def chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion a response runs as (``conversation``: the earlier turns' messages and the input's)."""
    body = req.model_dump(include=set(_PASSED & req.model_fields_set), by_alias=True)
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body.update(model=req.model, stream=req.stream, messages=system + conversation)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools is not None:  # chat's rules then apply: "required" with no tools is "none"
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tools and req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        body["tool_choice"] = choice
    fmt = req.format()
    forced_call = bool(req.tools) and (choice == "required" or isinstance(choice, FunctionChoice))
    if fmt is not None and not forced_call:
        body["response_format"] = {"type": "json_object"} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {k: v for k, v in {"name": fmt.name, "schema": fmt.schema_,
                                                                     "description": fmt.description,
                                                                     "strict": fmt.strict}.items() if v is not None}}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in first["loc"]).replace(".[", "[")
        message = str(first["msg"]).removeprefix("Value error, ")
        raise renamed(APIError(400, f"{param}: {message}" if param else message, param or None)) from None


def renamed(exc: APIError) -> APIError:
    """``exc`` with chat's parameter name (at the start of its message too) replaced by the Responses API's."""
    if exc.param is None:
        return exc
    for pattern, replacement in _RENAMES:
        if pattern.match(exc.param):
            param = pattern.sub(replacement, exc.param)
            message = param + exc.message[len(exc.param):] if exc.message.startswith(exc.param) else exc.message
            return APIError(exc.status, message, param, exc.code, exc.headers)
    return exc


def _head(req: ResponsesRequest, rid: str, created: int, model: str, params: Any) -> dict[str, Any]:
    """The response object's fixed fields: the request's settings echoed (temperature and top_p as they apply,
    the model's defaults filled in)."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice
    return {"id": rid, "object": "response", "created_at": created, "model": model, "error": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None, "store": req.store,
            "temperature": getattr(params, "temperature", None), "top_p": getattr(params, "top_p", None),
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else
            choice or ("auto" if req.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "truncation": "disabled",
            "user": req.user, "background": False}


async def create_response(ctx: ServerContext, store: ResponseStore, req: ResponsesRequest, raw: Request) -> Response:
    earlier: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        entry = store.get(req.previous_response_id)
        if entry is None:
            raise APIError(404, f"previous_response_id: no stored response has the id {req.previous_response_id!r} "
                                f"(never stored, deleted, or evicted from this server's bounded store)",
                           "previous_response_id", "previous_response_not_found")
        earlier = entry.messages

    def convert() -> tuple[list[dict[str, Any]], ChatCompletionRequest]:
        conversation = earlier + input_messages(req.input)
        return conversation, chat_request(req, conversation)

    # the conversation grows with every turn: converted and validated on the constraint pool, off the event loop
    conversation, chat = await ctx.offload_check(convert)
    rid, created = item_id("resp"), int(time.time())
    try:
        run = await start_chat(ctx, chat, raw, rid)
    except APIError as exc:
        raise renamed(exc) from None
    builder = ResponseBuilder(_head(req, rid, created, run.model, run.request.params), run.plan, ctx.reasoning_parser)
    prompt_tokens = len(run.request.prompt_token_ids)

    def keep() -> None:
        if req.store:
            store.put(builder.response(), conversation + output_messages(builder.output))

    if not req.stream:
        (final,) = await collect(ctx, raw, run.streams)
        choice = final.outputs[0]
        builder.start()
        builder.feed(choice.text, True)
        builder.finish(choice.finish_reason, prompt_tokens, len(choice.token_ids))
        keep()
        return JSONResponse(builder.response())

    tracker = DeltaTracker(holdback_for(req.stop))
    started = False

    def render(_: int, out: RequestOutput) -> list[bytes]:
        nonlocal started
        events = [] if started else builder.start()
        started = True
        delta = tracker.delta(0, out.outputs[0])
        if delta is not None:
            last = delta.finish_reason is not None
            events += builder.feed(delta.text, last)
            if last:
                events += builder.finish(delta.finish_reason, prompt_tokens, tracker.sent_tokens[0])
                keep()
        return [event_sse(event) for event in events]

    return await stream_response(ctx, raw, run.streams, render, list)


def responses_router(ctx: ServerContext, store: ResponseStore | None = None) -> APIRouter:
    """The routes, over ``store`` (a fresh ``ResponseStore`` with the default bounds if None)."""
    kept = store if store is not None else ResponseStore()
    router = APIRouter()
    posts = APIRouter(route_class=OffloadedBodyRoute)  # the body parsed off the event loop

    @posts.post("/v1/responses", responses={**_ERRORS, 200: {"content": {"text/event-stream": {
        "schema": {"type": "string", "description": "Responses API events"}}}}})
    async def create(req: ResponsesRequest, raw: Request) -> Response:
        return await create_response(ctx, kept, req, raw)

    router.include_router(posts)

    def stored(response_id: str) -> dict[str, Any]:
        entry = kept.get(response_id)
        if entry is None:
            raise APIError(404, f"no stored response has the id {response_id!r}", "response_id", "response_not_found")
        return entry.body

    @router.get("/v1/responses/{response_id}", responses={404: {"model": ErrorResponse}})
    async def retrieve(response_id: str) -> JSONResponse:
        return JSONResponse(stored(response_id))

    @router.delete("/v1/responses/{response_id}", responses={404: {"model": ErrorResponse}})
    async def delete(response_id: str) -> JSONResponse:
        stored(response_id)
        kept.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return router
