"""Greedy tokens and logprobs of the engine equal HF transformers' on the same weights (float32, CPU)."""
from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, assert_greedy_match, hf_greedy, kv_settings
from minfer import LLM, SamplingParams

# 1 token, exactly one block, one block + 1, several blocks (block_size 16)
PROMPTS = [[5], list(range(2, 18)), list(range(3, 20)), [(i * 7) % 300 + 2 for i in range(50)]]
NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)

SCENARIOS = {
    "default": dict(num_kv_blocks=64),
    # every prompt is split into chunks of at most 6 tokens, mixed with decodes of the others
    "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=6, max_num_seqs=4),
    # 4 blocks of 16 tokens: the longest request just fits alone, the others must take turns
    "preempt": dict(num_kv_blocks=4),
}


def _check_all_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_hf(checkpoints, arch, scenario):
    llm = LLM(str(checkpoints[arch]), **kv_settings(checkpoints[arch], SCENARIOS[scenario]))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref, ref_logits = hf_greedy(checkpoints[arch], prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
        assert out.outputs[0].finish_reason == "length"
    stats = llm.get_stats()
    if scenario == "preempt":
        assert stats["num_preemptions"] > 0
    _check_all_free(llm)


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "gemma2", "gemma3"])
def test_prefix_cache_hits_keep_outputs_exact(checkpoints, arch):
    llm = LLM(str(checkpoints[arch]), num_kv_blocks=64)
    shared = [(i * 11) % 290 + 3 for i in range(40)]
    prompts = [shared + [7, 8, 9], shared + [100], shared[:33] + [250, 251]]
    first = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["prefix_cache_hit_tokens"] >= 2 * 32, stats  # two full blocks of the shared prefix, twice
    for prompt, out in zip(prompts, first + rest):
        ref, ref_logits = hf_greedy(checkpoints[arch], prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
    # the same prompt again: everything but its last token comes from the cache
    again = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    _check_all_free(llm)


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "gemma2", "gemma3"])
def test_logprobs_match_hf_log_softmax(checkpoints, arch):
    llm = LLM(str(checkpoints[arch]), num_kv_blocks=64)
    prompt = PROMPTS[3]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                                                                     logprobs=3), use_tqdm=False)[0].outputs[0]
    _, ref_logits = hf_greedy(checkpoints[arch], prompt, NEW)
    assert len(out.logprobs) == NEW
    total = 0.0
    for tok, entry, logits in zip(out.token_ids, out.logprobs, ref_logits):
        ref = logits.log_softmax(-1)
        top = ref.topk(3).indices.tolist()
        assert set(top) | {tok} == set(entry)
        for t, lp in entry.items():
            assert abs(lp - float(ref[t])) < 1e-4
        total += float(ref[tok])
    assert abs(out.cumulative_logprob - total) < 1e-3


def test_text_prompts_and_eos_stop(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=64)
    tok = llm.get_tokenizer()
    out = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    ids = tok.encode("def fibonacci(n):")
    assert out.prompt_token_ids == ids and out.prompt == "def fibonacci(n):"
    ref, ref_logits = hf_greedy(checkpoints["llama3"], ids, NEW)
    assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
    assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
    # make the 3rd greedy token the stop token: generation ends there, the token is kept
    stop_id = ref[2]
    early = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=NEW, temperature=0,
                                                                   stop_token_ids=[stop_id]), use_tqdm=False)[0]
    first = ref.index(stop_id)
    assert early.outputs[0].token_ids == ref[:first + 1]
    assert early.outputs[0].finish_reason == "stop" and early.outputs[0].stop_reason == stop_id
    # min_tokens forbids that stop token until enough tokens exist
    later = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=NEW, temperature=0, min_tokens=NEW,
                                                                   stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert len(later.outputs[0].token_ids) == NEW and stop_id not in later.outputs[0].token_ids


@pytest.mark.parametrize("kwargs", [dict(num_kv_blocks=64), dict(num_kv_blocks=64, max_num_batched_tokens=7, max_num_seqs=2),
                                    dict(num_kv_blocks=4)])
def test_prompt_logprobs_match_hf(checkpoints, kwargs):
    """Teacher-forced logprobs of every prompt token, also when prompts are chunked or preempted."""
    from conftest import _hf_model

    llm = LLM(str(checkpoints["llama3"]), **kwargs)
    prompts = [PROMPTS[3][:48], PROMPTS[1], PROMPTS[3][:30]]  # with 4 blocks, the first one's growth preempts
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, prompt_logprobs=2, ignore_eos=True), use_tqdm=False)
    model = _hf_model(checkpoints["llama3"])
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for pos in range(1, len(prompt)):
            entry = got[pos]
            assert abs(entry[prompt[pos]] - float(ref[pos - 1, prompt[pos]])) < 1e-4
            assert set(ref[pos - 1].topk(2).indices.tolist()) <= set(entry)
    if kwargs["num_kv_blocks"] == 4:
        assert llm.get_stats()["num_preemptions"] > 0
    _check_all_free(llm)


@pytest.fixture(scope="module")
def phi3_beyond(checkpoints, tmp_path_factory):
    """phi3_longrope's weights with an original length of 16 and a context of 512: the engine's default
    max_model_len (512) is past the original length, so its table holds the long factors, and the
    attention factor comes from 512 / 16."""
    import json
    import shutil

    folder = shutil.copytree(checkpoints["phi3_longrope"], tmp_path_factory.mktemp("phi3") / "beyond")
    config = json.loads((folder / "config.json").read_text())
    rope = {k: v for k, v in config["rope_parameters"].items() if k != "attention_factor"}
    config |= dict(max_position_embeddings=512, original_max_position_embeddings=16,
                   rope_parameters=rope | {"original_max_position_embeddings": 16})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_phi3_longrope_beyond_the_original_length_matches_hf(phi3_beyond, scenario):
    """Prompts longer than the original length: HF rotates the whole prompt and every later token with the
    long factors, as the engine's one table does, whatever the chunking or preemption."""
    prompts = [list(range(3, 20)), PROMPTS[3][:30], PROMPTS[3]]
    llm = LLM(str(phi3_beyond), **SCENARIOS[scenario])
    assert llm.llm_engine.max_model_len == 512
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref, ref_logits = hf_greedy(phi3_beyond, prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
    _check_all_free(llm)


def test_phi3_longrope_within_max_model_len_matches_hf(phi3_beyond):
    """The same checkpoint with max_model_len 16 (the original length): every sequence stays within it,
    and the table holds the short factors, as HF's forward does for these sequences."""
    prompts = [[5], list(range(2, 7))]
    llm = LLM(str(phi3_beyond), max_model_len=16, num_kv_blocks=16)
    params = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref, ref_logits = hf_greedy(phi3_beyond, prompt, 11)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
