"""Speculative decoding: greedy output is the target's token for token (against HF), whatever drafts it and
whatever the engine's settings; every other request feature keeps working through verified steps; nothing leaks."""
from __future__ import annotations

import time

import pytest

from conftest import assert_greedy_match, hf_greedy, make_checkpoint
from minfer import LLM, SamplingParams
from minfer.structured_outputs import StructuredOutputsParams

# prompts that repeat themselves, so n-gram lookup finds drafts (and random-weight models loop, which helps too)
LOOP = [7, 8, 9, 10, 11, 12]
PROMPTS = [LOOP * 3, [5], list(range(2, 18)) * 2, [(i * 7) % 300 + 2 for i in range(50)]]
NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
SCENARIOS = {
    "default": dict(num_kv_blocks=64),
    "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=4),
    "preempt": dict(num_kv_blocks=5),  # the longest request (66 tokens) just fits alone
    "prefix": dict(num_kv_blocks=64, enable_prefix_caching=True),
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """A draft that agrees with the target only by chance: another random model of the same vocabulary."""
    return str(make_checkpoint(tmp_path_factory.mktemp("draft") / "llama3", "llama3", seed=7, layers=1))


def _all_free(llm: LLM) -> bool:
    s = llm.get_stats()
    return s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["num_running"] == s["num_waiting"] == 0


def _spec(method: str, target: str, other: str) -> dict:
    if method == "ngram":
        return NGRAM
    return {"method": "draft_model", "num_speculative_tokens": 4, "model": target if method == "self" else other}


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("method", ["ngram", "self", "other"])
def test_greedy_equals_the_target(checkpoints, other_draft, method, scenario, async_scheduling):
    """n-gram drafts, the target drafting for itself (every draft right) and an unrelated draft (most wrong): the
    output is HF's greedy output in every case, and the counters say drafts were made and judged."""
    target = str(checkpoints["llama3"])
    llm = LLM(target, speculative_config=_spec(method, target, other_draft), async_scheduling=async_scheduling,
              **SCENARIOS[scenario])
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    if scenario == "prefix":  # a second round over the same prompts hits the prefix cache
        outs += llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS * 2, outs):
        ref, ref_logits = hf_greedy(checkpoints["llama3"], prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
        assert out.outputs[0].finish_reason == "length"
    stats = llm.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    if method == "self":  # the draft is the target: only a float near-tie could refuse a draft
        assert stats["spec_decode_acceptance_rate"] > 0.9
    if scenario == "preempt":
        assert stats["num_preemptions"] > 0
    if scenario == "prefix":
        assert stats["prefix_cache_hit_tokens"] > 0
    assert _all_free(llm)


def test_acceptance_counters(checkpoints):
    """vLLM's spec_decode counters: per-position acceptance never exceeds the drafts, and positions fall off."""
    target = str(checkpoints["llama3"])
    llm = LLM(target, speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3},
              num_kv_blocks=64)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    s = llm.get_stats()
    per_pos = s["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 3 and sum(per_pos) == s["spec_decode_num_accepted_tokens"]
    assert s["spec_decode_num_drafts"] >= per_pos[0] >= per_pos[1] >= per_pos[2]
    assert s["spec_decode_num_draft_tokens"] <= 3 * s["spec_decode_num_drafts"]
    assert 1.0 <= s["spec_decode_mean_acceptance_length"] <= 4.0


def test_sampling_features_through_verified_steps(checkpoints, other_draft):
    """n = 2, seeds, logprobs, penalties, min_tokens, stop ids and stop strings, through n-gram and draft-model
    verification: each request finishes as it says, seeded ones repeat themselves, nothing leaks."""
    target = str(checkpoints["llama3"])
    for spec in (NGRAM, _spec("other", target, other_draft)):
        llm = LLM(target, speculative_config=spec, num_kv_blocks=48)
        eos = next(iter(llm.llm_engine.eos_token_ids))
        params = [SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12),
                  SamplingParams(temperature=1.0, seed=5, max_tokens=10, logprobs=2),
                  SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=9, max_tokens=10, repetition_penalty=1.3),
                  SamplingParams(temperature=0, max_tokens=14, min_tokens=6, stop_token_ids=[eos]),
                  SamplingParams(temperature=0.9, seed=11, max_tokens=20, stop=["a"])]
        prompts = [{"prompt_token_ids": p} for p in (PROMPTS * 2)[:len(params)]]
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)
        for a, b, p in zip(first, again, params):
            assert len(a.outputs) == p.n
            for x, y in zip(a.outputs, b.outputs):
                assert x.token_ids == y.token_ids  # seeded (or greedy): the same draws whatever else ran
                assert len(x.token_ids) <= p.max_tokens
                if p.logprobs:
                    assert len(x.logprobs) == len(x.token_ids)
                    assert all(t in entry for t, entry in zip(x.token_ids, x.logprobs))
        assert len(first[3].outputs[0].token_ids) >= 6
        assert _all_free(llm)


def test_structured_outputs_with_drafts(checkpoints):
    """Drafts pass through the grammar's masks: the output is valid JSON of the schema, and the matcher ends
    where the text does (a rejected draft rolled back)."""
    import json

    target = str(checkpoints["llama3"])
    llm = LLM(target, speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 4},
              num_kv_blocks=64)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputsParams(json=schema))
    out = llm.generate(["x"] * 2, params, use_tqdm=False)
    for o in out:
        value = json.loads(o.outputs[0].text)
        assert set(value) == {"a"} and isinstance(value["a"], int)
    assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0
    assert _all_free(llm)


def test_abort_mid_speculation(checkpoints):
    target = str(checkpoints["llama3"])
    llm = LLM(target, speculative_config=NGRAM, num_kv_blocks=64)
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort_request("0")
    engine.abort_request("2")
    while engine.has_unfinished_requests():
        engine.step()
    assert _all_free(llm)


def test_large_batches_do_not_speculate(checkpoints):
    """disable_by_batch_size: a step of that many sequences runs without drafts (and overlapped)."""
    target = str(checkpoints["llama3"])
    llm = LLM(target, num_kv_blocks=64, speculative_config={"method": "draft_model", "model": target,
                                                            "num_speculative_tokens": 2, "disable_by_batch_size": 2})
    llm.generate([{"prompt_token_ids": LOOP * 3}] * 4, GREEDY, use_tqdm=False)
    assert llm.get_stats()["spec_decode_num_drafts"] == 0
    llm.generate([{"prompt_token_ids": LOOP * 3}], GREEDY, use_tqdm=False)
    assert llm.get_stats()["spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("bad, field", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
    ("{not json", "JSON"),
])
def test_bad_configs_fail_at_construction(checkpoints, bad, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(checkpoints["llama3"]), speculative_config=bad, num_kv_blocks=8)


def test_draft_of_another_vocabulary_is_refused(checkpoints, tmp_path):
    import json
    import shutil

    draft = shutil.copytree(checkpoints["llama3"], tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 1}))
    with pytest.raises(ValueError, match="vocab"):
        LLM(str(checkpoints["llama3"]), num_kv_blocks=8,
            speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})


def test_a_sequence_whose_drafts_keep_missing_backs_off():
    """Two steps in a row without an accepted draft (every draft rejected, or none found) pause the sequence's
    drafting for 4 steps, then 8 (doubling); an accepted draft resets it, and while every running sequence waits,
    steps do not speculate."""
    from types import SimpleNamespace

    from minfer.engine.spec.speculator import Speculator
    from minfer.spec_config import SpeculativeConfig

    spec = Speculator(SpeculativeConfig.parse(NGRAM))
    a, b = SimpleNamespace(seq_id=1), SimpleNamespace(seq_id=2)
    spec.record(1, drafted=3, emitted=1)
    assert spec.active([a])  # one miss: still drafting
    spec.record(1, drafted=3, emitted=1)
    assert not spec.active([a]) and spec.active([a, b])  # paused; b still drafts, so the step speculates
    spec.steps += 4
    assert spec.active([a])
    spec.record(1, drafted=2, emitted=1)
    assert not spec.active([a]) and spec.resume_at[1] == spec.steps + 8
    spec.record(1, drafted=2, emitted=2)  # one accepted draft: back to normal
    assert spec.active([a]) and 1 not in spec.misses
    spec.record(2, drafted=0, emitted=1)  # no drafts: not a miss
    assert 2 not in spec.misses


def test_constrained_batch_shrinking_into_speculation(checkpoints):
    """Constrained steps prepare the next step early (async scheduling); when the batch shrinks below
    disable_by_batch_size the prepared step is dropped and the speculative one scheduled afresh: every output
    still parses, nothing leaks."""
    import json

    target = str(checkpoints["llama3"])
    llm = LLM(target, num_kv_blocks=64, speculative_config={"method": "draft_model", "model": target,
                                                            "num_speculative_tokens": 3, "disable_by_batch_size": 2})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    params = [SamplingParams(max_tokens=8 + 12 * i, temperature=0,
                             structured_outputs=StructuredOutputsParams(json=schema)) for i in range(3)]
    outs = llm.generate(["x", "y", "z"], params, use_tqdm=False)
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert set(json.loads(o.outputs[0].text)) == {"a"}
    assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0
    assert _all_free(llm)


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_tensor_parallel_speculation(checkpoints, method):
    """tp = 2 (gloo processes): verify steps send the workers the same one-token rows, a draft model is split as
    the target is and its steps reach the workers too (Command.DRAFT), the collectives pair up, and greedy output
    is still HF's."""
    target = str(checkpoints["llama3"])
    llm = LLM(target, tensor_parallel_size=2, speculative_config=_spec(method, target, target), num_kv_blocks=64)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            ref, ref_logits = hf_greedy(checkpoints["llama3"], prompt, NEW)
            assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
        stats = llm.get_stats()
        assert stats["spec_decode_num_draft_tokens"] > 0
        if method == "self":
            assert stats["spec_decode_acceptance_rate"] > 0.9
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        LLM(target, tensor_parallel_size=2, num_kv_blocks=8, speculative_config={
            "method": "draft_model", "model": target, "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1})


def test_recurrent_models_refuse_speculation(checkpoints):
    with pytest.raises(ValueError, match="recurrent"):
        LLM(str(checkpoints["qwen3_5"]), speculative_config=NGRAM, num_kv_blocks=16)


def test_a_draft_catches_up_on_long_prompts_within_the_token_budget(checkpoints):
    """The draft's first step over a 50-token prompt, with a budget of 8 tokens a step: the catch-up runs in
    forwards of at most 8 tokens, and greedy output is still HF's with every draft of the self-draft accepted."""
    target = str(checkpoints["llama3"])
    llm = LLM(target, num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=4,
              speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3})
    draft = llm.llm_engine.speculator.drafter
    sizes = []
    step = draft._step
    draft._step = lambda seqs, rows, ids, prev, starts, q_lens, counts: (
        sizes.append(int(q_lens.sum())), step(seqs, rows, ids, prev, starts, q_lens, counts))[1]
    prompt = PROMPTS[3]
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    ref, ref_logits = hf_greedy(checkpoints["llama3"], prompt, NEW)
    assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
    assert max(sizes) <= 8 and sum(sizes) >= len(prompt)
    assert llm.get_stats()["spec_decode_acceptance_rate"] > 0.9


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss"])
def test_windowed_and_sink_targets(checkpoints, arch):
    """Targets with sliding-window layers on the hybrid KV cache (Gemma 3; gpt-oss with sinks too): verify rows
    read each group's tables, a self-draft reads the full group's; greedy output is HF's, every block comes back."""
    target = str(checkpoints[arch])
    llm = LLM(target, num_kv_blocks=64, speculative_config={"method": "draft_model", "model": target,
                                                            "num_speculative_tokens": 3})
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref, ref_logits = hf_greedy(checkpoints[arch], prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
    assert llm.get_stats()["spec_decode_acceptance_rate"] > 0.9
    assert _all_free(llm)


def test_a_draft_needs_a_full_attention_group(checkpoints):
    """A target whose every layer slides (Mistral with a window) frees the blocks a full-attention draft would
    read: refused at construction, saying why (n-gram still works there)."""
    target = str(checkpoints["mistral_sw"])
    with pytest.raises(ValueError, match="full-attention"):
        LLM(target, num_kv_blocks=16, speculative_config={"method": "draft_model", "model": target,
                                                          "num_speculative_tokens": 2})


def test_a_refused_configuration_under_tensor_parallelism_leaves_no_worker(checkpoints):
    """Refused on rank 0 once the runners are built (a model with recurrent layers): the workers, which know
    nothing of it, are stopped."""
    import multiprocessing

    with pytest.raises(ValueError, match="recurrent"):
        LLM(str(checkpoints["qwen3_5"]), num_kv_blocks=16, tensor_parallel_size=2, speculative_config=NGRAM)
    deadline = time.time() + 10
    while multiprocessing.active_children() and time.time() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()


def test_ngram_lookup_prefers_the_latest_occurrence_with_k_tokens_after_it():
    from minfer.engine.spec.ngram import ngram_draft

    assert ngram_draft([1, 2, 3, 9, 1, 2, 4, 5, 6, 1, 2], 3, 1, 2) == [4, 5, 6]  # the latest of two
    assert ngram_draft([5, 7, 7, 7, 7, 7], 3, 2, 2) == [7, 7, 7]  # a run: the latest hit overlaps the suffix
    assert ngram_draft([1, 2, 8, 1, 2], 3, 2, 2) == [8, 1, 2]
    assert ngram_draft([1, 2, 8, 9, 1, 2, 1, 2], 3, 2, 2) == [8, 9, 1]  # the latest has only 2 tokens after
    assert ngram_draft([1, 2, 3], 2, 1, 2) == []
