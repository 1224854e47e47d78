"""POST /v1/completions: text or token-id prompts (one or a batch), streamed or whole.

``echo`` returns the prompt before the completion and, with ``logprobs``, the prompt tokens' logprobs
first (the first token's None): the request lm-evaluation-harness scores loglikelihoods with. With
``max_tokens: 0`` and ``echo`` nothing is generated (one token is computed and dropped).
"""
from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minfer.engine.processor import Processor
from minfer.outputs import RequestOutput
from minfer.server.beam_search import run_beam_search
from minfer.server.protocol import CompletionRequest
from minfer.server.serving import ServerContext, collect, process, request_id, stream_response
from minfer.server.stream import (DeltaTracker, TextChunks, TokenText, completion_logprobs, echo_logprobs, holdback_for,
                                  join_logprobs, prompt_logprobs_entries, sse, usage)


def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw: Request) -> Response:
    model = ctx.check_model(req.model)
    lora = ctx.lora_request(model)  # None: the base model
    prompts = _prompts(req.prompt)
    ctx.check_count(len(prompts), req.n)  # before any work that grows with the batch
    if any(isinstance(p, str) for p in prompts):
        ctx.require_tokenizer("a text prompt", "prompt")
    max_tokens = req.output_tokens
    lp_param = req.prompt_logprobs if not req.echo or req.logprobs is None else max(req.logprobs,
                                                                                    req.prompt_logprobs or 0)
    params = ctx.sampling_params(req, 1 if max_tokens == 0 else max_tokens, req.logprobs, lp_param,
                                 await ctx.constraint(req))
    cid, created, n = request_id("cmpl"), int(time.time()), req.n

    def prepare(p: Processor) -> list[Any]:
        return [process(p, f"{cid}-{i}", prompt if isinstance(prompt, str) else None,
                        None if isinstance(prompt, str) else prompt, params,
                        "prompt" if len(prompts) == 1 else f"prompt[{i}]", req.add_special_tokens, lora)
                for i, prompt in enumerate(prompts)]

    requests = await ctx.offload(prepare)
    num_prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    if req.use_beam_search:  # rounds of one-token requests (server/beam_search.py); never streamed
        finals = await run_beam_search(ctx, raw, requests, req)
        return JSONResponse(_response(cid, created, model, finals, req, num_prompt_tokens, TokenText(ctx.tokenizer)))
    streams = ctx.submit(requests)

    if not req.stream:
        finals = await collect(ctx, raw, streams)
        if req.echo or req.prompt_logprobs is not None:  # decodes every prompt token: off the loop
            body = await ctx.offload(lambda p: _response(cid, created, model, finals, req, num_prompt_tokens,
                                                         TokenText(p.tokenizer)))
        else:
            body = _response(cid, created, model, finals, req, num_prompt_tokens, TokenText(ctx.tokenizer))
        return JSONResponse(body)

    tok = TokenText(ctx.tokenizer)
    tracker = DeltaTracker(holdback_for(req.stop))
    opts = req.stream_options
    want_usage = opts is not None and opts.include_usage
    every_chunk_usage = opts is not None and opts.continuous_usage_stats
    header = {"id": cid, "object": "text_completion", "created": created, "model": model}
    # Per choice, the characters of the token strings sent so far: ``text_offset`` counts those, as in
    # the non-streamed response (the text sent may lag behind while stop strings hold some back).
    token_chars: dict[int, int] = {}

    def text_choice(index: int, text: str) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}

    text_chunks = TextChunks(lambda index, text: {**header, "choices": [text_choice(index, text)], "usage": None})

    def render(i: int, out: RequestOutput) -> list[bytes]:
        choices = []
        for c in out.outputs:
            key = i * n + c.index
            d = tracker.delta(key, c)
            if d is None:
                continue
            lp = None
            if d.logprobs is not None:
                lp = completion_logprobs(d.logprobs, d.token_ids, tok, token_chars.get(key, 0))
                token_chars[key] = token_chars.get(key, 0) + sum(map(len, lp["tokens"]))
            choices.append({"index": key, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason,
                            "stop_reason": d.stop_reason})
        if not choices:
            return []
        chunk_usage = usage(num_prompt_tokens, sum(tracker.sent_tokens.values())) if every_chunk_usage else None
        only = choices[0]
        if len(choices) == 1 and chunk_usage is None and only == text_choice(only["index"], only["text"]):
            return [text_chunks(only["index"], only["text"])]  # the common event (stream.TextChunks)
        return [sse({**header, "choices": choices, "usage": chunk_usage})]

    def tail() -> list[bytes]:
        if not want_usage:
            return []
        return [sse({**header, "choices": [], "usage": usage(num_prompt_tokens, sum(tracker.sent_tokens.values()))})]

    return await stream_response(ctx, raw, streams, render, tail)


def _response(cid: str, created: int, model: str, finals: list[RequestOutput], req: CompletionRequest,
              num_prompt_tokens: int, tok: TokenText) -> dict[str, Any]:
    n, choices, completion_tokens = req.n, [], 0
    generate = req.output_tokens != 0
    for i, out in enumerate(finals):
        prompt_text = _prompt_text(out, tok, req.skip_special_tokens) if req.echo else ""
        head = None
        if req.echo and req.logprobs is not None:
            head = echo_logprobs(out.prompt_token_ids, out.prompt_logprobs or [None], tok, req.logprobs)
        prompt_lps = prompt_logprobs_entries(out.prompt_logprobs, tok) if req.prompt_logprobs is not None else None
        for c in out.outputs:
            ids, text, lp = (c.token_ids, c.text, None) if generate else ([], "", None)
            completion_tokens += len(ids)
            if req.logprobs is not None and c.logprobs is not None and generate:
                lp = completion_logprobs(c.logprobs, ids, tok, 0)
            if head is not None:
                lp = join_logprobs(head, lp)
            choices.append({"index": i * n + c.index, "text": prompt_text + text, "logprobs": lp,
                            "finish_reason": c.finish_reason if generate else "length",
                            "stop_reason": c.stop_reason if generate else None,
                            **({"prompt_logprobs": prompt_lps} if prompt_lps is not None else {})})
    choices.sort(key=lambda ch: ch["index"])
    return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(num_prompt_tokens, completion_tokens), "system_fingerprint": None}


def _prompt_text(out: RequestOutput, tok: TokenText, skip_special_tokens: bool) -> str:
    if out.prompt is not None:
        return out.prompt
    if tok.tokenizer is None:
        return "".join(map(tok, out.prompt_token_ids))
    return tok.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=skip_special_tokens)
