"""Delta outputs (``RequestOutputKind.DELTA``, the server's mode): each step's partial outputs carry
only new tokens, and joined back together they are exactly the whole outputs of the default mode."""
from __future__ import annotations

import asyncio
import copy
from typing import Any

from minfer import LLM, SamplingParams
from minfer.config import EngineConfig
from minfer.engine.async_engine import RequestStream, join_outputs
from minfer.engine.llm_engine import LLMEngine
from minfer.outputs import RequestOutput, RequestOutputKind

PROMPT = "def fibonacci(n):"


def _run(path: Any, delta: bool, params: dict[str, SamplingParams]) -> list[list[RequestOutput]]:
    """Every step's outputs, until all requests finish."""
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64), RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE)
    for rid, p in params.items():
        engine.add_request(rid, PROMPT if rid != "ids" else {"prompt_token_ids": list(range(2, 30))}, p)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return steps


def _fields(out: RequestOutput) -> tuple:
    return (out.request_id, out.finished, out.prompt_logprobs,
            [(c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason,
              c.token_offset) for c in out.outputs])


def test_deltas_join_to_the_whole_outputs(checkpoints):
    path = checkpoints["llama3"]
    base = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=30, logprobs=2, ignore_eos=True)
    free = LLM(str(path), num_kv_blocks=64).generate(PROMPT, base, use_tqdm=False)[0]
    text = free.outputs[1].text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip())
    params = {"stop": SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=30, logprobs=2, ignore_eos=True,
                                     stop=[stop]),
              "ids": SamplingParams(max_tokens=12, temperature=0, logprobs=1, prompt_logprobs=1, ignore_eos=True)}
    whole, deltas = _run(path, False, params), _run(path, True, params)
    assert len(whole) == len(deltas)
    pending: dict[str, RequestOutput] = {}  # every delta so far, joined as an unread RequestStream holds them
    finals = {}
    for full_step, delta_step in zip(whole, deltas):
        assert [o.request_id for o in full_step] == [o.request_id for o in delta_step]
        for full, delta in zip(full_step, delta_step):
            if full.finished:  # the last output is whole in both modes
                assert _fields(delta) == _fields(full)
                finals[full.request_id] = full
            else:
                prev = pending.get(delta.request_id)
                for i, c in enumerate(delta.outputs):  # it starts where the last one ended
                    assert c.token_offset == (prev.outputs[i].token_offset + len(prev.outputs[i].token_ids)
                                              if prev else 0)
                assert (delta.prompt_logprobs is None) == (prev is not None or delta.request_id == "stop")
                joined = copy.deepcopy(delta) if prev is None else join_outputs(prev, copy.deepcopy(delta))
                pending[delta.request_id] = joined
                assert _fields(joined) == _fields(full)
    assert finals["stop"].outputs[1].stop_reason == stop
    # ...and the offline API, whose outputs are whole, agrees with both
    offline = LLM(str(path), num_kv_blocks=64).generate([PROMPT, {"prompt_token_ids": list(range(2, 30))}],
                                                        list(params.values()), use_tqdm=False)
    assert [_fields(o)[1:] for o in offline] == [_fields(finals[rid])[1:] for rid in params]


def test_request_stream_joins_unread_deltas(checkpoints):
    """A slow reader gets one output holding every token it missed; the finished output replaces it."""
    params = {"stop": SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=20, logprobs=1, ignore_eos=True)}
    whole = [o for step in _run(checkpoints["llama3"], False, params) for o in step]
    deltas = [o for step in _run(checkpoints["llama3"], True, params) for o in step]

    async def read() -> list[RequestOutput]:
        stream, got = RequestStream("stop"), []
        for i, out in enumerate(deltas):
            stream.put(out)
            if i % 3 == 1 or out.finished:  # the reader wakes every third output
                got.append(await stream.__anext__())
        return got

    got = asyncio.run(read())
    expected = [whole[i] for i, out in enumerate(deltas) if i % 3 == 1 or out.finished]
    assert len(got) > 2 and got[-1].finished
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for g, w in zip(got, expected):  # each read continues the previous one and ends at the whole snapshot
        for c, cw in zip(g.outputs, w.outputs):
            assert c.token_offset in (0, len(tokens[c.index]))
            tokens[c.index] = tokens[c.index][:c.token_offset] + c.token_ids
            assert (tokens[c.index], c.text, c.finish_reason) == (cw.token_ids, cw.text, cw.finish_reason)


def test_request_stream_interval_wakes_the_reader_every_n_tokens(checkpoints):
    """With ``interval`` n the reader wakes for the first output, then once n new tokens are unread, and for the
    last; 0 wakes it for the first and the last only. What it reads joins to the whole output either way."""
    params = {"stop": SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=19, ignore_eos=True)}
    whole = [o for step in _run(checkpoints["llama3"], False, params) for o in step]
    deltas = [o for step in _run(checkpoints["llama3"], True, params) for o in step]
    # the second sample forks a step later: 20 outputs, the middle ones a token each for either sample at most
    assert len(deltas) == 20 and all(max(len(c.token_ids) for c in o.outputs) == 1 for o in deltas[:-1])

    async def read(interval: int) -> list[tuple[int, RequestOutput]]:
        stream, got = RequestStream("stop", interval), []
        for i, out in enumerate(copy.deepcopy(deltas)):
            stream.put(out)
            if stream._event.is_set():  # the reader would wake now: read as it would
                got.append((i, await stream.__anext__()))
        return got

    for interval, woken_at in ((1, list(range(20))), (4, [0, 4, 8, 12, 16, 19]), (7, [0, 7, 14, 19]), (0, [0, 19])):
        got = asyncio.run(read(interval))
        assert [i for i, _ in got] == woken_at, interval
        assert got[-1][1].finished
        for c, cw in zip(got[-1][1].outputs, whole[-1].outputs):
            assert (c.token_ids, c.text, c.finish_reason) == (cw.token_ids, cw.text, cw.finish_reason)
        for (i, g), w in zip(got[1:-1], [whole[i] for i, _ in got[1:-1]]):  # a middle read holds the tokens since
            for c, cw in zip(g.outputs, w.outputs):
                assert c.token_ids == cw.token_ids[c.token_offset:] and len(c.token_ids) == interval
