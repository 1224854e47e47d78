"""Async scheduling (step N+1 launched before step N completes) gives exactly the outputs of
synchronous stepping, and leaves no blocks behind, whatever stops, preempts or aborts."""
from __future__ import annotations

import pytest

from conftest import assert_greedy_match, hf_greedy
from minfer import LLM, SamplingParams
from minfer.config import EngineConfig
from minfer.engine.llm_engine import LLMEngine
from minfer.engine.sequence import PENDING_TOKEN
from test_engine_vs_hf import NEW, PROMPTS, SCENARIOS


def _all_free(llm: LLM) -> bool:
    s = llm.get_stats()
    return s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["num_running"] == s["num_waiting"] == 0


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_async_greedy_matches_hf(checkpoints, arch, scenario):
    llm = LLM(str(checkpoints[arch]), async_scheduling=True, **SCENARIOS[scenario])
    assert llm.llm_engine.config.async_scheduling
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref, ref_logits = hf_greedy(checkpoints[arch], prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
        assert out.outputs[0].finish_reason == "length"
    if scenario == "preempt":
        assert llm.get_stats()["num_preemptions"] > 0
    assert _all_free(llm)


def _mixed_requests(eos: int) -> tuple[list[dict], list[SamplingParams]]:
    """Requests that exercise every path the overlap touches: EOS and stop-id stops one step
    before the engine knows, n > 1 forks, logprobs, min_tokens, penalties, stop strings."""
    prompts, params = [], []
    for i in range(12):
        prompts.append({"prompt_token_ids": [(i * 13 + j * 7) % 290 + 3 for j in range(5 + 9 * i % 40)]})
        kw = dict(temperature=0.9, seed=100 + i, max_tokens=6 + 3 * i)
        if i % 3 == 0:
            kw.update(n=2)
        if i % 4 == 1:
            kw.update(logprobs=2)
        if i == 5:
            kw.update(min_tokens=4, stop_token_ids=[eos])
        if i == 7:
            kw.update(repetition_penalty=1.3, frequency_penalty=0.2)
        params.append(SamplingParams(**kw))
    return prompts, params


@pytest.mark.parametrize("kv", [dict(num_kv_blocks=64), dict(num_kv_blocks=12, max_num_batched_tokens=24, max_num_seqs=6)])
def test_async_equals_sync_on_mixed_requests(checkpoints, kv):
    path = str(checkpoints["llama3"])
    sync = LLM(path, async_scheduling=False, **kv)
    eos = next(iter(sync.llm_engine.eos_token_ids))
    prompts, params = _mixed_requests(eos)
    ref = sync.generate(prompts, params, use_tqdm=False)
    llm = LLM(path, async_scheduling=True, **kv)
    got = llm.generate(prompts, params, use_tqdm=False)
    for r, g in zip(ref, got):
        assert [(c.token_ids, c.finish_reason, c.stop_reason) for c in g.outputs] == \
            [(c.token_ids, c.finish_reason, c.stop_reason) for c in r.outputs], g.request_id
        for rc, gc in zip(r.outputs, g.outputs):
            assert PENDING_TOKEN not in gc.token_ids and (gc.logprobs is None) == (rc.logprobs is None)
            for got_lp, ref_lp in zip(gc.logprobs or [], rc.logprobs or []):  # batches differ: rounding does
                assert got_lp.keys() == ref_lp.keys()
                assert all(abs(got_lp[t] - ref_lp[t]) < 1e-4 for t in got_lp)
    assert {c.finish_reason for r in got for c in r.outputs} == {"length", "stop"}  # EOS ends some (fixed seeds)
    if kv["num_kv_blocks"] == 12:
        assert llm.get_stats()["num_preemptions"] > 0
    assert _all_free(llm)


def test_async_eos_stop_costs_no_extra_token(checkpoints):
    """A sequence that samples EOS at step N was already scheduled for step N+1; that work is
    dropped, and the output ends at the EOS exactly as without overlap."""
    path = str(checkpoints["llama3"])
    sync = LLM(path, num_kv_blocks=64, async_scheduling=False)
    prompt = {"prompt_token_ids": [7, 8, 9]}
    free = sync.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    stop_at = free[0].outputs[0].token_ids[4]  # make the 5th greedy token a stop token
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at])
    want = sync.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    llm = LLM(path, num_kv_blocks=64, async_scheduling=True)
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.token_ids[-1] == stop_at and len(got.token_ids) <= 5
    assert (got.finish_reason, got.stop_reason) == ("stop", stop_at)
    assert _all_free(llm)


def test_async_abort_while_a_step_is_in_flight(checkpoints):
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama3"]), num_kv_blocks=32, async_scheduling=True))
    engine.add_request("a", {"prompt_token_ids": list(range(3, 30))}, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": list(range(5, 12))}, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None  # a launched, not yet completed step
    engine.abort_request("a")
    seen = set()
    while engine.has_unfinished_requests():
        seen |= {o.request_id for o in engine.step()}
    assert seen == {"b"}
    engine.step()  # completes nothing more, launches nothing
    stats = engine.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_running"] == 0


def test_async_scheduling_flag_is_validated(checkpoints):
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model=str(checkpoints["llama3"]), async_scheduling="yes")
    assert LLM(str(checkpoints["llama3"]), num_kv_blocks=8).llm_engine.config.async_scheduling  # the default
