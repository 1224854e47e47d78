"""POST /v1/chat/completions: the tokenizer's chat template over the messages, then generation."""
from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minfer.outputs import RequestOutput
from minfer.server.errors import APIError
from minfer.server.protocol import ChatCompletionRequest
from minfer.server.serving import ServerContext, collect, request_id, stream_response
from minfer.server.stream import DeltaTracker, TokenText, chat_logprobs, holdback_for, sse, usage


def chat_prompt(ctx: ServerContext, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    """Render the conversation; the template places BOS itself, so encoding adds no special tokens."""
    tok = ctx.require_tokenizer("chat", "messages")
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages")
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in req.messages]
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - template errors (e.g. roles out of order) are the caller's
        raise APIError(400, f"the chat template rejected the messages: {exc}", "messages") from exc
    return text, tok.encode(text, add_special_tokens=False)


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Request) -> Response:
    model = ctx.check_model(req.model)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    params = ctx.sampling_params(req, max_tokens, top_k)
    text, ids = chat_prompt(ctx, req)
    cid, created = request_id("chatcmpl"), int(time.time())
    streams = ctx.submit([ctx.process(cid, text, ids, params, "messages")])
    tok = TokenText(ctx.tokenizer)

    if not req.stream:
        (final,) = await collect(ctx, raw, streams)
        return JSONResponse(_response(cid, created, model, final, tok, top_k))

    tracker = DeltaTracker(holdback_for(req.stop))
    want_usage = req.stream_options is not None and req.stream_options.include_usage
    header = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}

    def render(_: int, out: RequestOutput) -> list[bytes]:
        choices = []
        for c in out.outputs:
            d = tracker.delta(c.index, c)
            if d is None:
                continue
            delta: dict[str, Any] = {"role": "assistant", "content": d.text} if d.first else {"content": d.text}
            lp = {"content": chat_logprobs(d.logprobs, d.token_ids, tok, top_k)} if top_k is not None else None
            choices.append({"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason,
                            "stop_reason": d.stop_reason})
        if not choices:
            return []
        return [sse({**header, "choices": choices, "usage": None})]

    def tail() -> list[bytes]:
        if not want_usage:
            return []
        return [sse({**header, "choices": [], "usage": usage(len(ids), sum(tracker.sent_tokens.values()))})]

    return await stream_response(ctx, raw, streams, render, tail)


def _response(cid: str, created: int, model: str, out: RequestOutput, tok: TokenText,
              top_k: int | None) -> dict[str, Any]:
    choices, completion_tokens = [], 0
    for c in out.outputs:
        completion_tokens += len(c.token_ids)
        lp = {"content": chat_logprobs(c.logprobs, c.token_ids, tok, top_k)} \
            if top_k is not None and c.logprobs is not None else None
        choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": cid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(len(out.prompt_token_ids), completion_tokens), "system_fingerprint": None}
