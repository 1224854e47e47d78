"""The hybrid KV cache through the engine: sliding-window layers give back the blocks their window has
passed (counted), prefix hits across a window boundary and preemption stay exact against HF, the cache
can be turned off, and the plan's memory arithmetic at 32k context on a Gemma-3-27B-shaped config."""
from __future__ import annotations

import torch

from conftest import assert_greedy_match, hf_greedy
from minfer import LLM, SamplingParams
from minfer.config import ModelConfig, cdiv
from minfer.engine.kv_cache import KVCacheSpec
from minfer.engine.kv_groups import plan_groups

WINDOW = 21  # conftest's qwen2_sw: layer 0 full attention, layer 1 a window of 21 (ends mid-block)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_sliding_group_blocks_are_given_back_as_decoding_goes(checkpoints):
    llm = LLM(str(checkpoints["qwen2_sw"]), num_kv_blocks=64)
    assert llm.get_stats()["kv_group_windows"] == [0, WINDOW]
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": [(i * 7) % 300 + 2 for i in range(100)]},
                       SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.requests["r"][0] if "r" in engine.requests else None
        if seq is None or seq.num_computed_tokens <= 101:  # the prompt's chunk held all its blocks
            continue
        full, sliding = llm.get_stats()["kv_group_blocks"]
        assert full == len(seq.block_tables[0]) >= cdiv(seq.num_computed_tokens, 16)
        assert sliding <= cdiv(WINDOW - 1, 16) + 2, (seq.num_computed_tokens, sliding)  # the window, not the length
        seen += 1
    assert seen > 30
    stats = llm.get_stats()
    assert stats["kv_group_blocks"] == [0, 0] and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_prefix_hit_across_the_window_boundary_is_exact(checkpoints):
    """A 70-token shared prefix: the hit covers 4 blocks, and the sliding group needs only the last
    two of them (its window starts inside block 2), so the hit must not depend on blocks 0-1."""
    path = checkpoints["qwen2_sw"]
    llm = LLM(str(path), num_kv_blocks=64)
    shared = [(i * 13) % 290 + 5 for i in range(70)]
    prompts = [shared + [7, 8], shared + [9], shared[:66] + [250]]
    outs = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert llm.get_stats()["prefix_cache_hit_tokens"] >= 2 * 64
    for prompt, out in zip(prompts, outs):
        ref, ref_logits = hf_greedy(path, prompt, 12)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)


def test_disabled_hybrid_cache_keeps_one_group_and_the_same_tokens(checkpoints):
    path = checkpoints["qwen2_sw"]
    prompts = [{"prompt_token_ids": [(i * 7) % 300 + 2 for i in range(60)]}, {"prompt_token_ids": [5, 6, 7]}]
    hybrid = LLM(str(path), num_kv_blocks=64).generate(prompts, GREEDY, use_tqdm=False)
    plain_llm = LLM(str(path), num_kv_blocks=64, disable_hybrid_kv_cache_manager=True)
    assert plain_llm.get_stats()["kv_group_windows"] == [0]
    plain = plain_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in hybrid] == [o.outputs[0].token_ids for o in plain]


def _gemma3_27b_like() -> ModelConfig:
    """The cache-relevant part of Gemma 3 27B: 62 layers, 5 local (window 1024) : 1 global, 16 KV heads of 128."""
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)]
    return ModelConfig.from_hf(dict(architectures=["Gemma3ForCausalLM"], vocab_size=262208, hidden_size=5376,
                                    intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                                    num_key_value_heads=16, head_dim=128, max_position_embeddings=131072,
                                    sliding_window=1024, layer_types=types))


def test_hybrid_plan_holds_4x_the_sequences_at_32k():
    """Bytes one decoding 32k-token sequence holds (its blocks x a block's bytes), full cache against hybrid:
    the sequences that fit in the same memory."""
    cfg, length = _gemma3_27b_like(), 32768
    full = KVCacheSpec.for_model(cfg, 16, torch.bfloat16)
    hybrid = KVCacheSpec.for_model(cfg, 16, torch.bfloat16, max_model_len=length)
    assert len(hybrid.kv_groups) > 1 and all(len(g.layers) <= hybrid.pages_per_block for g in hybrid.kv_groups)
    per_seq_full = cdiv(length, 16) * full.block_bytes
    blocks = sum(cdiv(length, 16) if not g.window else cdiv(g.window - 1, 16) + 2 for g in hybrid.kv_groups)
    per_seq_hybrid = blocks * hybrid.block_bytes
    assert per_seq_full / per_seq_hybrid >= 4.0, per_seq_full / per_seq_hybrid
    # every layer in exactly one group; the full-attention layers in full groups
    layers = sorted(i for g in hybrid.kv_groups for i in g.layers)
    assert layers == list(range(62))
    assert {i for g in hybrid.kv_groups if not g.window for i in g.layers} == {i for i in range(62) if (i + 1) % 6 == 0}


def test_plan_groups_keeps_one_group_when_windows_agree():
    assert [g.window for g in plan_groups([0] * 4, 16, 4096)] == [0]
    assert [g.window for g in plan_groups([64] * 4, 16, 4096)] == [64]  # Mistral: one sliding group
    assert [g.window for g in plan_groups([8192, 0], 16, 4096)] == [0]  # a window past the context is none
