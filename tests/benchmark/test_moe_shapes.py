"""The MoE benchmark shapes: their parameter counts and bounds count what a token really reads (its
top-k experts), and a scaled-down random checkpoint of each loads and runs in minfer."""
from __future__ import annotations

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.benchmark.bounds import DecodeCost, batch1_bound
from minfer.benchmark.shapes import shape_config, write_random_checkpoint
from minfer.model.registry import model_config


@pytest.mark.parametrize("shape,total_b,active_b", [("qwen3-30b-a3b", 30.5, 3.3), ("mixtral-8x7b", 46.7, 12.9)])
def test_moe_shapes_count_total_and_active_parameters(shape, total_b, active_b):
    cfg = model_config(shape_config(shape))
    cost = DecodeCost.for_model(cfg)
    embedding = cfg.vocab_size * cfg.hidden_size  # untied: not read per token, but a parameter
    active = cost.weight_bytes / 2 + embedding
    total = active + (cost.num_experts - cost.top_k) * cost.expert_bytes / 2
    assert abs(total / 1e9 - total_b) < 0.1 and abs(active / 1e9 - active_b) < 0.1
    assert batch1_bound(DecodeCost.for_model(cfg, tp=2)) == pytest.approx(2 * batch1_bound(cost), rel=0.02)
    # a big batch touches (nearly) every expert: the step reads almost all the weights
    assert cost.step_weight_bytes(1) == cost.weight_bytes
    assert cost.step_weight_bytes(256) > 0.95 * (cost.weight_bytes + (cost.num_experts - cost.top_k) * cost.expert_bytes)


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_scaled_down_moe_shape_loads_and_runs(tmp_path, shape):
    small = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                 intermediate_size=64, moe_intermediate_size=64, num_experts=4, num_local_experts=4,
                 num_experts_per_tok=2)
    ckpt = write_random_checkpoint(shape, tmp_path / shape, dtype=torch.float32, layers=2, overrides=small)
    llm = LLM(str(ckpt), num_kv_blocks=16, skip_tokenizer_init=True)
    assert llm.llm_engine.model_config.moe_layers == (0, 1)
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
