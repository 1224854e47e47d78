"""POST /v1/chat/completions: the tokenizer's chat template (or the request's, with
``--trust-request-chat-template``) over the messages, then generation. Rendering and tokenizing run on the
tokenizer pool (a request's own template on a pool of its own), after bounds on the messages' count and size,
and a render is bounded in time (``chat_template.RenderBudget``) and stopped when the client leaves.

With tools (``server/tools.py``) each choice's text goes through a ``ToolParser``, the same one for a stream
and a whole response; without them the text is the content, and streaming pays nothing for tools. With
``--reasoning-parser`` (``server/reasoning.py``) the reasoning is split off first: the tool parser reads the
content only. A parser that reads special-token markers (``gpt_oss``: gpt-oss's harmony format) has the request's
choices decoded with them kept (``skip_special_tokens`` off, whatever the request said: the parser takes every marker
out of what the client sees), and such a tool parser reads the choice's own text."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import jinja2

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minfer.engine.processor import EngineRequest, Processor
from minfer.engine.request_stream import RequestStream
from minfer.outputs import RequestOutput
from minfer.reasoning import grammar_gate
from minfer.server.beam_search import run_beam_search
from minfer.server.chat_template import RenderBudget, RenderStopped
from minfer.server.errors import APIError
from minfer.server.protocol import ChatCompletionRequest
from minfer.server.reasoning import StreamSplitter, needs_special_tokens, split_whole
from minfer.server.serving import ServerContext, collect, process, request_id, stream_response
from minfer.server.stream import (DeltaTracker, TextChunks, TokenText, chat_logprobs, holdback_for,
                                  prompt_logprobs_entries, sse, usage)
from minfer.server.tool_parsers import ToolParser, parse_whole
from minfer.server.tools import ToolPlan, finish_reason, plan_tools, tool_constraint

logger = logging.getLogger("minfer.server")
# The server's own template renders untraced up to this many messages + tools (and no chat_template_kwargs):
# even a template quadratic in them stays in the thousands of steps, and tracing triples a render's time.
TRACE_ABOVE_ITEMS = 64


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
    chars = sum(len(m.text()) + len(m.name or "") + sum(len(c.function.arguments) for c in m.tool_calls or ())
                for m in req.messages)
    if chars > ctx.processor.max_prompt_chars:
        raise APIError(400, f"messages: {chars} characters of messages cannot fit in the {ctx.max_model_len}-token "
                            f"context", "messages")
    bad = _RESERVED.intersection(req.chat_template_kwargs or {})
    if bad:
        raise APIError(400, f"chat_template_kwargs may not set {sorted(bad)} (send them as request fields)",
                       "chat_template_kwargs")


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as chat templates read them. A call's ``arguments`` arrive as JSON text and are handed
    over decoded, as transformers' templates expect (and vLLM does)."""
    messages = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls is not None:
            msg["tool_calls"] = [{"id": c.id, "type": c.type,
                                  "function": {"name": c.function.name,
                                               "arguments": _decoded_arguments(c.function.arguments,
                                                                               f"messages[{i}].tool_calls[{j}]")}}
                                 for j, c in enumerate(m.tool_calls)]
        messages.append(msg)
    return messages


def _decoded_arguments(text: str, where: str) -> Any:
    if not text.strip():
        return {}
    param = f"{where}.function.arguments"
    try:
        return json.loads(text)
    except ValueError as exc:
        raise APIError(400, f"{param}: not valid JSON ({exc})", param) from None
    except RecursionError:  # brackets nested past Python's stack
        raise APIError(400, f"{param}: nested too deeply", param) from None


def render_chat(tok: Any, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None = None,
                budget: RenderBudget | None = None) -> str:
    """Render the conversation (on a pool thread) with ``tools`` shown to the template, under ``budget``
    (None: untraced). A template's refusal, or a render past its time, is the caller's 400."""
    messages = template_messages(req)
    param = "chat_template" if req.chat_template else "messages"
    variables = {**({"reasoning_effort": req.reasoning_effort} if req.reasoning_effort else {}),
                 **(req.chat_template_kwargs or {})}

    def render() -> Any:
        return tok.apply_chat_template(messages, chat_template=req.chat_template, tokenize=False, tools=tools,
                                       add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message, **variables)

    try:
        text = budget.run(render) if budget is not None else render()
    except RenderStopped as exc:
        assert budget is not None
        if exc.reason == "cancelled":  # the client left (nobody reads this) or the server is stopping
            raise APIError(503, "the server is shutting down", code="shutting_down") from None
        whose = "the chat template" if req.chat_template else "the server's chat template"
        raise APIError(400, f"{param}: {whose} did not finish rendering these messages within "
                            f"{budget.timeout_s:g} s", param, code="chat_template_timeout") from None
    except jinja2.TemplateError as exc:  # raise_exception(...) in a template speaks to the caller
        raise APIError(400, f"{param}: the chat template rejected the messages: {exc}", param) from exc
    except Exception as exc:  # noqa: BLE001 - a template failing on this input
        logger.info("the chat template failed: %r", exc)
        raise APIError(400, f"{param}: the chat template could not render these messages ({type(exc).__name__})",
                       param) from exc
    if not isinstance(text, str):
        raise APIError(400, f"{param}: the chat template did not render text", param)
    return text


def needs_trace(req: ChatCompletionRequest) -> bool:
    """Whether a render is traced (``RenderBudget``): always for the request's own template or template
    variables, for the server's when the chat is large (``TRACE_ABOVE_ITEMS``)."""
    return bool(req.chat_template or req.chat_template_kwargs or
                len(req.messages) + len(req.tools or ()) > TRACE_ABOVE_ITEMS)


@dataclass(slots=True)
class ChatRun:
    """A chat request checked, rendered and queued: what a response is built from (the chat completion's, and
    the Responses API's, which runs its conversation through here)."""

    model: str  # the served name the request named
    plan: ToolPlan
    request: EngineRequest
    streams: list[RequestStream]
    top_k: int | None  # logprobs' top k (None: no logprobs)


async def start_chat(ctx: ServerContext, req: ChatCompletionRequest, raw: Request, cid: str) -> ChatRun:
    """Every check, the constraint, the render and the tokenizing (on the pools), then the engine request
    ``cid`` queued; any refusal is an ``APIError`` before anything is queued."""
    model = ctx.check_model(req.model)
    lora = ctx.lora_request(model)  # None: the base model
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top_k = (req.top_logprobs or 0) if req.logprobs else None
    tok = ctx.require_tokenizer("chat", "messages")
    own_template = req.chat_template is not None
    if own_template and not ctx.trust_request_chat_template:
        raise APIError(400, "chat_template: this server does not run chat templates sent with a request (it "
                            "would need --trust-request-chat-template); drop chat_template", "chat_template")
    template = req.chat_template or getattr(tok, "chat_template", None)
    if not template:
        raise APIError(400, "messages: this model's tokenizer has no chat template; use /v1/completions",
                       "messages")
    # The tools (their schemas grow with the request) are read on the constraint pool, not on the event loop.
    plan = await ctx.offload_check(lambda: plan_tools(req, template, ctx.auto_tool_parser)) if req.tools else \
        plan_tools(req, template, ctx.auto_tool_parser)
    if plan.mode in ("required", "named"):
        constraint = await ctx.offload_check(lambda: tool_constraint(req, plan))
    else:
        constraint = await ctx.constraint(req)
    params = ctx.sampling_params(req, max_tokens, top_k, req.prompt_logprobs, constraint)
    if needs_special_tokens(ctx.reasoning_parser) or plan.needs_special_tokens:  # the parsers read the markers
        params.skip_special_tokens = False
    traced = needs_trace(req)

    def prepare(p: Processor, budget: RenderBudget) -> EngineRequest:
        check_chat_size(ctx, req)
        text = render_chat(p.tokenizer, req, plan.tools, budget if traced else None)
        # the template places BOS itself: no special tokens are added unless the request asks for them
        request = process(p, cid, text, None, params, "messages", req.add_special_tokens, lora)
        if ctx.reasoning_parser is not None and params.structured_outputs is not None:  # reasoning runs free
            request.grammar_after = grammar_gate(p.tokenizer, request.prompt_token_ids, ctx.reasoning_parser)
        return request

    request = await ctx.render(raw, prepare, own_template)
    # a beam search queues its own rounds (server/beam_search.py), never this request
    return ChatRun(model, plan, request, [] if req.use_beam_search else ctx.submit([request]), top_k)


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Request) -> Response:
    cid, created = request_id("chatcmpl"), int(time.time())
    run = await start_chat(ctx, req, raw, cid)
    model, plan, request, streams, top_k = run.model, run.plan, run.request, run.streams, run.top_k
    if req.use_beam_search:  # never streamed
        (final,) = await run_beam_search(ctx, raw, [request], req)
        return JSONResponse(_response(cid, created, model, final, TokenText(ctx.tokenizer), None, False, plan,
                                      ctx.reasoning_parser))
    num_prompt_tokens = len(request.prompt_token_ids)
    tok = TokenText(ctx.tokenizer)

    if not req.stream:
        (final,) = await collect(ctx, raw, streams)
        if req.prompt_logprobs is not None:  # decodes every prompt token: off the loop
            body = await ctx.offload(lambda p: _response(cid, created, model, final, TokenText(p.tokenizer), top_k,
                                                         True, plan, ctx.reasoning_parser))
        else:
            body = _response(cid, created, model, final, tok, top_k, False, plan, ctx.reasoning_parser)
        return JSONResponse(body)

    tracker = DeltaTracker(holdback_for(req.stop))
    opts = req.stream_options
    want_usage = opts is not None and opts.include_usage
    every_chunk_usage = opts is not None and opts.continuous_usage_stats
    header = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    parsers: dict[int, ToolParser] = {}  # per choice, with tools
    splitter = StreamSplitter(ctx.reasoning_parser)

    def text_choice(index: int, text: str | None) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None,
                "stop_reason": None}

    text_chunks = TextChunks(lambda index, text: {**header, "choices": [text_choice(index, text)], "usage": None})

    def render(_: int, out: RequestOutput) -> list[bytes]:
        choices = []
        for c in out.outputs:
            d = tracker.delta(c.index, c)
            if d is None:
                continue
            lp = {"content": chat_logprobs(d.logprobs, d.token_ids, tok, top_k)} if top_k is not None else None
            reason = d.finish_reason
            thought, text = splitter.split(c.index, d.text, reason is not None)
            if plan.mode == "none" and not splitter.active:
                delta: dict[str, Any] = {"role": "assistant", "content": d.text} if d.first else {"content": d.text}
            elif plan.mode == "none":
                delta = {"role": "assistant"} if d.first else {}
                if text:
                    delta["content"] = text
            else:
                parser = parsers.get(c.index)
                if parser is None:
                    parser = parsers[c.index] = plan.new_parser()
                delta, reason = _tool_delta(parser, d.text if parser.needs_special_tokens else text, d.first, reason)
            if thought:
                delta["reasoning_content"] = thought
            if not delta and reason is None and lp is None:
                continue
            choices.append({"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": reason,
                            "stop_reason": d.stop_reason})
        if not choices:
            return []
        chunk_usage = usage(num_prompt_tokens, sum(tracker.sent_tokens.values())) if every_chunk_usage else None
        only, content = choices[0], choices[0]["delta"].get("content")
        if len(choices) == 1 and chunk_usage is None and only == text_choice(only["index"], content):
            return [text_chunks(only["index"], content)]  # the common event (stream.TextChunks)
        return [sse({**header, "choices": choices, "usage": chunk_usage})]

    def tail() -> list[bytes]:
        if not want_usage:
            return []
        return [sse({**header, "choices": [], "usage": usage(num_prompt_tokens, sum(tracker.sent_tokens.values()))})]

    return await stream_response(ctx, raw, streams, render, tail)


def _tool_delta(parser: ToolParser, text: str, first: bool, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A streamed choice's delta through its parser: content and tool-call entries as they become known,
    everything held back released with the finish."""
    content, calls = parser.feed(text)
    if reason is not None:
        more, later = parser.finish()
        content, calls = content + more, calls + later
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta, finish_reason(reason, parser)


def _message(text: str, reason: str | None, plan: ToolPlan,
             reasoning_parser: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole choice's message: its reasoning split off first (with a reasoning parser: ``reasoning_content``,
    null when it did not think, and a content that is null when empty), then its tool calls out of the content."""
    thought, content_text = split_whole(reasoning_parser, text)
    extra = {} if reasoning_parser is None else {"reasoning_content": thought}
    if plan.mode == "none":
        content = content_text if reasoning_parser is None else content_text or None
        return {"role": "assistant", "content": content, **extra}, reason
    parser = plan.new_parser()
    content, calls = parse_whole(parser, text if parser.needs_special_tokens else content_text)
    message: dict[str, Any] = {"role": "assistant", "content": content, **extra}
    if calls:
        message["tool_calls"] = [call.to_dict() for call in calls]
    return message, finish_reason(reason, parser)


def _response(cid: str, created: int, model: str, out: RequestOutput, tok: TokenText,
              top_k: int | None, with_prompt_logprobs: bool, plan: ToolPlan,
              reasoning_parser: str | None = None) -> dict[str, Any]:
    choices, completion_tokens = [], 0
    prompt_lps = prompt_logprobs_entries(out.prompt_logprobs, tok) if with_prompt_logprobs else None
    for c in out.outputs:
        completion_tokens += len(c.token_ids)
        lp = {"content": chat_logprobs(c.logprobs, c.token_ids, tok, top_k)} \
            if top_k is not None and c.logprobs is not None else None
        message, reason = _message(c.text, c.finish_reason, plan, reasoning_parser)
        choices.append({"index": c.index, "message": message, "logprobs": lp,
                        "finish_reason": reason, "stop_reason": c.stop_reason,
                        **({"prompt_logprobs": prompt_lps} if prompt_lps is not None else {})})
    return {"id": cid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(len(out.prompt_token_ids), completion_tokens), "system_fingerprint": None}
