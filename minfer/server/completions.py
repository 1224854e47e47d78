"""POST /v1/completions: text or token-id prompts (one or a batch), streamed or whole."""
from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minfer.outputs import RequestOutput
from minfer.server.errors import APIError
from minfer.server.protocol import CompletionRequest
from minfer.server.serving import ServerContext, collect, request_id, stream_response
from minfer.server.stream import DeltaTracker, TokenText, completion_logprobs, holdback_for, sse, usage


def _prompts(ctx: ServerContext, prompt: Any) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) per prompt; text prompts are tokenized here, not on the engine thread."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append((p, ctx.require_tokenizer("a text prompt", "prompt").encode(p)))
        else:
            out.append((None, list(p)))
    return out


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw: Request) -> Response:
    model = ctx.check_model(req.model)
    prompts = _prompts(ctx, req.prompt)
    if len(prompts) * req.n > 1024:
        raise APIError(400, f"a batch of {len(prompts)} prompts with n={req.n} is over 1024 sequences", "prompt")
    params = ctx.sampling_params(req, req.max_tokens, req.logprobs)
    cid, created, n = request_id("cmpl"), int(time.time()), req.n
    streams = ctx.submit([ctx.process(f"{cid}-{i}", text, ids, params,
                                      "prompt" if len(prompts) == 1 else f"prompt[{i}]")
                          for i, (text, ids) in enumerate(prompts)])
    tok = TokenText(ctx.tokenizer)
    num_prompt_tokens = sum(len(ids) for _, ids in prompts)

    if not req.stream:
        finals = await collect(ctx, raw, streams)
        return JSONResponse(_response(cid, created, model, finals, n, num_prompt_tokens, tok, req.logprobs))

    tracker = DeltaTracker(holdback_for(req.stop))
    want_usage = req.stream_options is not None and req.stream_options.include_usage
    header = {"id": cid, "object": "text_completion", "created": created, "model": model}
    # Per choice, the characters of the token strings sent so far: ``text_offset`` counts those, as in
    # the non-streamed response (the text sent may lag behind while stop strings hold some back).
    token_chars: dict[int, int] = {}

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
        return [sse({**header, "choices": choices, "usage": None})]

    def tail() -> list[bytes]:
        if not want_usage:
            return []
        return [sse({**header, "choices": [], "usage": usage(num_prompt_tokens, sum(tracker.sent_tokens.values()))})]

    return await stream_response(ctx, raw, streams, render, tail)


def _response(cid: str, created: int, model: str, finals: list[RequestOutput], n: int, num_prompt_tokens: int,
              tok: TokenText, logprobs: int | None) -> dict[str, Any]:
    choices, completion_tokens = [], 0
    for i, out in enumerate(finals):
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            lp = None
            if logprobs is not None and c.logprobs is not None:
                lp = completion_logprobs(c.logprobs, c.token_ids, tok, 0)
            choices.append({"index": i * n + c.index, "text": c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    choices.sort(key=lambda ch: ch["index"])
    return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(num_prompt_tokens, completion_tokens), "system_fingerprint": None}
