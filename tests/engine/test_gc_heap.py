"""The engine loops run with the heap alive at their start frozen out of Python's cyclic collector
(``minfer/engine/gc_heap.py``), and hand it back when they end: ``LLM.generate``'s loop and ``AsyncLLMEngine``'s
engine thread, on the built-in model."""
from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from minfer import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from minfer.engine.gc_heap import heap_frozen
from minfer.llm import LLM, builtin_model_path

MODEL = str(builtin_model_path())
ARGS: dict[str, Any] = dict(max_model_len=256, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _record_freeze_counts(engine: Any) -> list[int]:
    """Wrap ``engine.step`` to note the frozen object count at each step."""
    counts: list[int] = []
    step = engine.step

    def counted() -> Any:
        counts.append(gc.get_freeze_count())
        return step()

    engine.step = counted
    return counts


def test_heap_frozen_freezes_for_the_block_only() -> None:
    keep = [[] for _ in range(10)]  # tracked containers alive at the freeze
    with heap_frozen():
        assert gc.get_freeze_count() >= len(keep)
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), heap_frozen():
        raise RuntimeError("a failing loop")
    assert gc.get_freeze_count() == 0  # unfrozen on the way out of a failure too


def test_generate_steps_with_the_heap_frozen() -> None:
    with LLM(MODEL, **ARGS) as llm:
        counts = _record_freeze_counts(llm.llm_engine)
        out = llm.generate(["def f(x):"], PARAMS, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
        assert counts and min(counts) > 0
        assert gc.get_freeze_count() == 0


def test_async_engine_thread_steps_with_the_heap_frozen() -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=MODEL, **ARGS))
    counts = _record_freeze_counts(engine.engine)

    async def run() -> list[Any]:
        return [out async for out in engine.generate("def f(x):", PARAMS, "r")]

    try:
        outs = asyncio.run(run())
        assert outs[-1].finished and counts and min(counts) > 0
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0  # the thread has ended: everything is the collector's again
