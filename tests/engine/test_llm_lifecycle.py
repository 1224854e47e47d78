"""An ``LLM``'s end: ``shutdown()``, a ``with`` block, or its last reference dropped each stop its
tensor-parallel workers, leave the process group and stop the grammar threads, so that a second LLM
(tensor-parallel or not) runs in the same process; an LLM that was shut down says so when called."""
from __future__ import annotations

import gc
import multiprocessing

import pytest
import torch

from minfer import LLM, SamplingParams, StructuredOutputsParams

PROMPTS = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(2, 18))}]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
REGEX = SamplingParams(max_tokens=6, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-c]{2,4}"))


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _assert_released(workers: list, grammar_pool: object) -> None:
    assert not any(p.is_alive() for p in workers), workers
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("minfer-tp")]
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError):  # the grammar compiler's thread pool was shut down
        grammar_pool.submit(print)


def test_a_dropped_tp_llm_releases_its_workers_so_another_runs(checkpoints):
    """``del llm`` (no shutdown call) releases everything; then a second tp=2 LLM in a ``with`` block, and a
    tp=1 one, give the same tokens, and the ``with`` block's end releases the second."""
    llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=64, tensor_parallel_size=2)
    first = _tokens(llm)
    assert llm.generate("x", REGEX, use_tqdm=False)[0].outputs[0].text  # builds the grammar compiler
    workers, pool = list(llm.llm_engine.workers.procs), llm.llm_engine._grammars._pool
    assert all(p.is_alive() for p in workers) and torch.distributed.is_initialized()
    del llm
    gc.collect()
    _assert_released(workers, pool)

    with LLM(str(checkpoints["llama3"]), num_kv_blocks=64, tensor_parallel_size=2) as llm:
        assert _tokens(llm) == first
        assert llm.generate("x", REGEX, use_tqdm=False)[0].outputs[0].text
        workers, pool = list(llm.llm_engine.workers.procs), llm.llm_engine._grammars._pool
    _assert_released(workers, pool)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.shutdown()  # idempotent

    with LLM(str(checkpoints["llama3"]), num_kv_blocks=64) as one:
        assert _tokens(one) == first


def test_shutdown_of_a_single_process_llm(checkpoints):
    """tp=1: ``shutdown()`` stops the grammar threads; every call after it fails with a clear error, and a
    dropped LLM's finalizer does the same work."""
    llm = LLM(str(checkpoints["qwen2"]), num_kv_blocks=32)
    assert llm.generate("x", REGEX, use_tqdm=False)[0].outputs[0].text
    pool = llm.llm_engine._grammars._pool
    llm.shutdown()
    _assert_released([], pool)
    for call in (lambda: llm.generate("x", GREEDY, use_tqdm=False), lambda: llm.chat([{"role": "user", "content": "hi"}]),
                 llm.get_stats, llm.get_tokenizer):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    llm.shutdown()

    llm = LLM(str(checkpoints["qwen2"]), num_kv_blocks=32)
    assert llm.generate("x", REGEX, use_tqdm=False)[0].outputs[0].text
    pool = llm.llm_engine._grammars._pool
    del llm  # no cycle holds it: freed (and its finalizer run) at once, without a collection
    _assert_released([], pool)
