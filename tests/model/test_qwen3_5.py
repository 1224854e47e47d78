"""Qwen3.5 beyond the generic HF comparisons (``ARCHS["qwen3_5"]`` runs through tests/engine's scenarios and
tensor parallelism): the state cache's lifecycle (slots follow input-batch rows: chunks carry the state, a
preempted or reused row starts afresh), what the engine turns off for a recurrent model (prefix hits, sample
forks), and a config's rope that the model cannot serve."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import assert_greedy_match, hf_greedy, kv_settings
from minfer import LLM, SamplingParams
from minfer.model.registry import model_config

PROMPTS = [[5], list(range(2, 70)), [(i * 7) % 300 + 2 for i in range(50)]]  # 68 tokens: past a 64-token chunk
NEW = 10
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("settings", [dict(num_kv_blocks=64, max_num_batched_tokens=13, max_num_seqs=2),
                                      dict(num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=1)])
def test_chunked_prefill_carries_the_state_across_chunks(checkpoints, settings):
    """Chunks of 13 tokens (mixed with decodes, two rows) and of exactly 64 (one row at a time: its state slot
    reused by the next sequence, which must start from zeros)."""
    path = checkpoints["qwen3_5"]
    llm = LLM(str(path), **kv_settings(path, settings))
    for prompt, out in zip(PROMPTS, _run(llm, PROMPTS)):
        ref, ref_logits = hf_greedy(path, prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)


def test_prefix_caching_and_forks_are_off_and_outputs_stay_exact(checkpoints, caplog):
    path = checkpoints["qwen3_5"]
    with caplog.at_level("INFO", logger="minfer"):
        llm = LLM(str(path), enable_prefix_caching=True, num_kv_blocks=64)
    assert "prefix caching off" in caplog.text
    first = _run(llm, PROMPTS[1:])
    again = _run(llm, PROMPTS[1:])  # the same prompts: no hit may resume the linear layers from a wrong state
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert llm.get_stats()["prefix_cache_hit_tokens"] == 0
    # n = 2 greedy samples each compute the prompt (no fork from sample 0): both equal the n = 1 output
    two = _run(llm, PROMPTS[2:], SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, n=2))[0]
    assert [c.token_ids for c in two.outputs] == [first[1].outputs[0].token_ids] * 2
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_an_abort_mid_prompt_frees_the_slot_for_the_next_sequence(checkpoints):
    """A request aborted with its state half written; the next request on its row must not read that state."""
    path = checkpoints["qwen3_5"]
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=1)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    engine.step()  # 16 of its 68 prompt tokens
    engine.abort_request("a")
    out = _run(llm, PROMPTS[2:])[0]
    ref, ref_logits = hf_greedy(path, PROMPTS[2], NEW)
    assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)


def test_unsupported_rope_is_refused_by_name(checkpoints, tmp_path):
    folder = shutil.copytree(checkpoints["qwen3_5"], tmp_path / "q")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        model_config(config)


def test_state_cache_holds_a_slot_per_row_and_a_spare(checkpoints):
    path = checkpoints["qwen3_5"]
    llm = LLM(str(path), num_kv_blocks=16, max_num_seqs=3)
    layers = llm.llm_engine.runner.state_layers
    assert len(layers) == 2
    for layer in layers:
        assert layer.conv_state.shape == (4, 2 * 2 * 16 + 4 * 16, 3)
        assert layer.rec_state.shape == (4, 4, 16, 16) and layer.rec_state.dtype == torch.float32
