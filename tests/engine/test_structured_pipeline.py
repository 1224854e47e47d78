"""The constrained step's order (engine/llm_engine.py): a step with constrained rows queues its forward,
completes the previous step, schedules and prepares the next one (``_ready``), fills the bitmask, then
samples. These tests hold that order to the plain one: the same seeded tokens as sync scheduling (where
nothing is prepared early), and no state left behind when a request is aborted, or a penalized one
arrives, while a prepared step waits."""
from __future__ import annotations

import json

import pytest

from minfer import SamplingParams, StructuredOutputsParams
from minfer.config import EngineConfig
from minfer.engine.llm_engine import LLMEngine
from minfer.llm import builtin_model_path
from minfer.outputs import RequestOutputKind

SCHEMA = {"type": "array", "minItems": 1, "maxItems": 3, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "tag"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "b"]}}}}


def _engine(async_scheduling: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(builtin_model_path()), num_kv_blocks=256,
                                  async_scheduling=async_scheduling), RequestOutputKind.FINAL_ONLY)


def _params(i: int, **kw) -> SamplingParams:
    if i % 3 == 2:  # an unconstrained request between the constrained ones
        return SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True, **kw)
    return SamplingParams(temperature=1.0, seed=i, max_tokens=96, **kw,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))


def _run(engine: LLMEngine, n: int, on_step=None) -> dict[str, list[int]]:
    for i in range(n):
        engine.add_request(f"r{i}", f"def f{i}(x):\n    return ", _params(i))
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if on_step is not None:
            on_step(engine, steps)
        assert steps < 2000
    return done


@pytest.fixture(scope="module")
def engines():
    pair = _engine(True), _engine(False)
    yield pair
    for e in pair:
        e.shutdown()


def test_prepared_steps_give_the_sync_tokens(engines):
    fast, sync = engines
    prepared = []
    out_fast = _run(fast, 6, lambda e, _: prepared.append(e._ready is not None))
    assert any(prepared), "no step was prepared early: the path under test did not run"
    assert out_fast == _run(sync, 6)
    tok = fast.tokenizer
    for i in (0, 1, 3, 4):
        json.loads(tok.decode(out_fast[f"r{i}"], skip_special_tokens=True))


def test_abort_and_penalties_while_a_step_is_prepared(engines):
    engine = engines[0]
    events = []

    def poke(e: LLMEngine, step: int) -> None:
        if e._ready is not None and "abort" not in events:
            e.abort_request("r0")  # drops the prepared step with it
            assert e._ready is None
            events.append("abort")
        elif e._ready is not None and "penalty" not in events:
            e.add_request("pen", "x = ", SamplingParams(max_tokens=8, repetition_penalty=1.3, ignore_eos=True))
            assert e._ready is None
            events.append("penalty")

    done = _run(engine, 5, poke)
    assert events == ["abort", "penalty"]
    assert "r0" not in done and len(done["pen"]) == 8 and all(f"r{i}" in done for i in range(1, 5))
    bm = engine.block_manager
    assert not engine.requests and bm.num_free_blocks == bm.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_a_constrained_prompt_mid_prefill_does_not_defer_the_step():
    """Only the rows that sample this step decide whether it waits for a bitmask: while a constrained
    request's long prompt is computed in chunks (it samples nothing yet), the decoding unconstrained
    request's draws are queued with the forward, and no mask is filled for them."""
    engine = LLMEngine(EngineConfig(model=str(builtin_model_path()), num_kv_blocks=256, max_num_seqs=4,
                                    max_num_batched_tokens=16), RequestOutputKind.FINAL_ONLY)
    try:
        engine.add_request("plain", "x = ", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        engine.step()
        engine.add_request("json", "def f(x):\n    return x\n" * 8, _params(0))
        engine._compiling["json"][0].result(timeout=120)  # admitted at the next step, while "plain" decodes
        launches, fills = [], []
        launch, fill = engine.runner.launch, engine._bitmask.fill

        def record_launch(batch, *args, **kwargs):
            step = launch(batch, *args, **kwargs)
            launches.append((any(s.grammar is not None for s in batch.seqs),
                             any(s.grammar is not None for s in step.sampled), bool(step.sampled),
                             step.deferred is not None))
            return step

        def record_fill(seqs, *args):
            fills.append(len(launches))
            return fill(seqs, *args)

        engine.runner.launch, engine._bitmask.fill = record_launch, record_fill
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o for o in engine.step()}
        mid_prefill = [i for i, (in_batch, constrained, samples, _) in enumerate(launches, 1)
                       if in_batch and not constrained and samples]
        assert mid_prefill, "no step sampled beside a constrained prompt chunk: the path under test did not run"
        for i in mid_prefill:
            assert not launches[i - 1][3] and i not in fills, f"launch {i} deferred its sampling for a mask"
        assert all(deferred == constrained for _, constrained, _, deferred in launches)
        assert len(fills) == sum(constrained for _, constrained, _, _ in launches)
        json.loads(engine.tokenizer.decode(done["json"].outputs[0].token_ids, skip_special_tokens=True))
        assert len(done["plain"].outputs[0].token_ids) == 24
    finally:
        engine.shutdown()
