"""POST /v1/chat/completions: the tokenizer's chat template (or the request's) over the messages, then
generation. Rendering and tokenizing run on the tokenizer pool, after bounds on the messages' count and size."""
from __future__ import annotations

import logging
import time
from typing import Any

import jinja2

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minfer.engine.processor import EngineRequest, Processor
from minfer.outputs import RequestOutput
from minfer.server.errors import APIError
from minfer.server.protocol import ChatCompletionRequest
from minfer.server.serving import ServerContext, collect, process, request_id, stream_response
from minfer.server.stream import (DeltaTracker, TokenText, chat_logprobs, holdback_for, prompt_logprobs_entries, sse,
                                  usage)

logger = logging.getLogger("minfer.server")


# apply_chat_template's own arguments: chat_template_kwargs may not set them (they are request fields)
_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                       "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_chat_size(ctx: ServerContext, req: ChatCompletionRequest) -> None:
    """O(messages) bounds before rendering: every message renders to at least one token, and no token is
    longer than ``max_token_chars``, so a chat past either bound cannot fit in the context."""
    if len(req.messages) >= ctx.max_model_len:
        raise APIError(400, f"messages: {len(req.messages)} messages cannot fit in the {ctx.max_model_len}-token "
                            f"context", "messages")
    chars = sum(len(m.text()) + len(m.name or "") for m in req.messages)
    if chars > ctx.processor.max_prompt_chars:
        raise APIError(400, f"messages: {chars} characters of messages cannot fit in the {ctx.max_model_len}-token "
                            f"context", "messages")
    bad = _RESERVED.intersection(req.chat_template_kwargs or {})
    if bad:
        raise APIError(400, f"chat_template_kwargs may not set {sorted(bad)} (send them as request fields)",
                       "chat_template_kwargs")


def chat_prompt(tok: Any, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    """Render the conversation (on the tokenizer pool); the template places BOS itself, so encoding adds no
    special tokens unless the request asks for them. A template's refusal is the caller's 400."""
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in req.messages]
    param = "chat_template" if req.chat_template else "messages"
    try:
        text = tok.apply_chat_template(messages, chat_template=req.chat_template, tokenize=False,
                                       add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message,
                                       **(req.chat_template_kwargs or {}))
    except jinja2.TemplateError as exc:  # raise_exception(...) in a template speaks to the caller
        raise APIError(400, f"{param}: the chat template rejected the messages: {exc}", param) from exc
    except Exception as exc:  # noqa: BLE001 - a template failing on this input
        logger.info("the chat template failed: %r", exc)
        raise APIError(400, f"{param}: the chat template could not render these messages ({type(exc).__name__})",
                       param) from exc
    if not isinstance(text, str):
        raise APIError(400, f"{param}: the chat template did not render text", param)
    try:
        return text, tok.encode(text, add_special_tokens=req.add_special_tokens)
    except Exception as exc:  # noqa: BLE001
        logger.info("the tokenizer rejected a rendered chat: %r", exc)
        raise APIError(400, "messages: the tokenizer could not encode the rendered chat", "messages") from exc


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Request) -> Response:
    model = ctx.check_model(req.model)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    params = ctx.sampling_params(req, max_tokens, top_k, req.prompt_logprobs)
    tok = ctx.require_tokenizer("chat", "messages")
    if not (req.chat_template or getattr(tok, "chat_template", None)):
        raise APIError(400, "messages: this model's tokenizer has no chat template; send chat_template or use "
                            "/v1/completions", "messages")
    check_chat_size(ctx, req)
    cid, created = request_id("chatcmpl"), int(time.time())

    def prepare(p: Processor) -> EngineRequest:
        text, ids = chat_prompt(p.tokenizer, req)
        return process(p, cid, text, ids, params, "messages")

    request = await ctx.offload(prepare)
    streams = ctx.submit([request])
    num_prompt_tokens = len(request.prompt_token_ids)
    tok = TokenText(ctx.tokenizer)

    if not req.stream:
        (final,) = await collect(ctx, raw, streams)
        if req.prompt_logprobs is not None:  # decodes every prompt token: off the loop
            body = await ctx.offload(lambda p: _response(cid, created, model, final, TokenText(p.tokenizer), top_k,
                                                         True))
        else:
            body = _response(cid, created, model, final, tok, top_k, False)
        return JSONResponse(body)

    tracker = DeltaTracker(holdback_for(req.stop))
    opts = req.stream_options
    want_usage = opts is not None and opts.include_usage
    every_chunk_usage = opts is not None and opts.continuous_usage_stats
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
        chunk_usage = usage(num_prompt_tokens, sum(tracker.sent_tokens.values())) if every_chunk_usage else None
        return [sse({**header, "choices": choices, "usage": chunk_usage})]

    def tail() -> list[bytes]:
        if not want_usage:
            return []
        return [sse({**header, "choices": [], "usage": usage(num_prompt_tokens, sum(tracker.sent_tokens.values()))})]

    return await stream_response(ctx, raw, streams, render, tail)


def _response(cid: str, created: int, model: str, out: RequestOutput, tok: TokenText,
              top_k: int | None, with_prompt_logprobs: bool) -> dict[str, Any]:
    choices, completion_tokens = [], 0
    prompt_lps = prompt_logprobs_entries(out.prompt_logprobs, tok) if with_prompt_logprobs else None
    for c in out.outputs:
        completion_tokens += len(c.token_ids)
        lp = {"content": chat_logprobs(c.logprobs, c.token_ids, tok, top_k)} \
            if top_k is not None and c.logprobs is not None else None
        choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                        **({"prompt_logprobs": prompt_lps} if prompt_lps is not None else {})})
    return {"id": cid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(len(out.prompt_token_ids), completion_tokens), "system_fingerprint": None}
