"""``use_beam_search`` on /v1/completions and /v1/chat/completions: ``minfer.beam_search`` over the async engine.

The request is checked and tokenized as any other (``process``: its prompt, ``max_tokens`` against the context), then
never queued itself: each round of the search is a batch of one-token requests, tokenized on the pool, queued,
collected (a client that leaves aborts the round and the search), and sent back into the search. The result is one
finished ``RequestOutput`` per prompt, a choice per sequence, which the endpoint renders as it renders any other
(vLLM's shape: ``n`` choices, best first). Fields a search does not honour were refused with the request
(``request_fields.BEAM_SEARCH_UNSUPPORTED``); streaming among them.
"""
from __future__ import annotations

from typing import Any

from fastapi import Request

from minfer.beam_search import BeamSearch, BeamSearchParams, beam_search_rounds
from minfer.engine.processor import EngineRequest, Processor
from minfer.outputs import RequestOutput
from minfer.sampling_params import SamplingParams
from minfer.server.request_fields import SamplingFields
from minfer.server.serving import ServerContext, collect, process


async def run_beam_search(ctx: ServerContext, raw: Request, requests: list[EngineRequest],
                          req: SamplingFields) -> list[RequestOutput]:
    """Search from each checked request's prompt (``n`` beams, its ``max_tokens`` or the rest of the context) and
    return its result under its request id; the rounds run through the engine like any request."""
    first = requests[0]
    limits = [r.max_total_tokens - len(r.prompt_token_ids) for r in requests]
    params = BeamSearchParams(beam_width=req.n, max_tokens=max(limits), ignore_eos=req.ignore_eos,
                              temperature=req.temperature or 0.0, length_penalty=req.length_penalty,
                              early_stopping=req.early_stopping)
    eos = ctx.engine.engine.eos_token_ids  # fixed at the engine's start: safe to read here
    searches = [BeamSearch(r.prompt_token_ids, params, eos, limit) for r, limit in zip(requests, limits)]
    rounds = beam_search_rounds(searches)
    ask, number = next(rounds, None), 0
    while ask is not None:
        prompts, step = ask
        prefix = f"{first.request_id}-beam{number}"
        batch = await ctx.offload(lambda p, prompts=prompts, step=step, prefix=prefix:
                                  _round_requests(p, prompts, step, prefix, first.lora_request))
        finals = await collect(ctx, raw, ctx.submit(batch))
        ask = _send(rounds, [out.outputs[0].logprobs[0] for out in finals])
        number += 1
    skip = first.params.skip_special_tokens

    def outputs(p: Processor) -> list[RequestOutput]:  # decoding grows with the output: on the pool
        decode = None if p.tokenizer is None else (lambda ids: p.tokenizer.decode(ids, skip_special_tokens=skip))
        return [s.request_output(r.request_id, r.prompt, decode) for s, r in zip(searches, requests)]

    return await ctx.offload(outputs)


def _round_requests(processor: Processor, prompts: list[list[int]], step: SamplingParams, prefix: str,
                    lora_request: Any) -> list[EngineRequest]:
    return [process(processor, f"{prefix}-{i}", None, ids, step, "prompt", lora_request=lora_request)
            for i, ids in enumerate(prompts)]


def _send(rounds: Any, tops: list[dict[int, float]]) -> tuple[list[list[int]], SamplingParams] | None:
    """The search's next round, or None when it is over."""
    try:
        return rounds.send(tops)
    except StopIteration:
        return None
