"""Mixture-of-experts models (Qwen3-MoE, Mixtral) on the CPU reference path: greedy tokens and logprobs
equal HF transformers' on the same random weights (float32) under every scheduling path, mixed dense
and sparse layers, and tensor parallelism (each expert's MLP split across ranks)."""
from __future__ import annotations

import pytest
import torch

from conftest import MOE, assert_greedy_match, assert_same_outputs, hf_greedy, make_moe_checkpoint
from minfer import LLM, SamplingParams

PROMPTS = [[5], list(range(2, 18)), list(range(3, 20)), [(i * 7) % 300 + 2 for i in range(50)]]
SHARED = [(i * 11) % 290 + 3 for i in range(40)]
NEW = 10
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=2)

@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: make_moe_checkpoint(root / name, name) for name in MOE}


SCENARIOS = {
    "default": dict(num_kv_blocks=64),
    "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=6, max_num_seqs=4),
    "preempt": dict(num_kv_blocks=4),
}


@pytest.mark.parametrize("name", list(MOE))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_moe_greedy_matches_hf(moe_ckpts, name, scenario):
    llm = LLM(str(moe_ckpts[name]), **SCENARIOS[scenario])
    assert llm.llm_engine.model_config.moe_layers == ((1,) if name == "qwen3_moe_mixed" else (0, 1))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref, ref_logits = hf_greedy(moe_ckpts[name], prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
        if out.outputs[0].token_ids == ref:
            for step, entries in enumerate(out.outputs[0].logprobs):
                hf = torch.log_softmax(ref_logits[step], -1)
                assert max(abs(v - float(hf[t])) for t, v in entries.items()) < 1e-4
    stats = llm.get_stats()
    if scenario == "preempt":
        assert stats["num_preemptions"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_moe_prefix_cache_hits_keep_outputs_exact(moe_ckpts):
    llm = LLM(str(moe_ckpts["qwen3_moe"]), num_kv_blocks=64)
    prompts = [SHARED + [7, 8, 9], SHARED + [100]]
    first = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)
    second = llm.generate({"prompt_token_ids": prompts[1]}, GREEDY, use_tqdm=False)
    assert llm.get_stats()["prefix_cache_hit_tokens"] >= 32
    for prompt, out in zip(prompts, first + second):
        ref, ref_logits = hf_greedy(moe_ckpts["qwen3_moe"], prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_under_tensor_parallelism_equals_one_process(moe_ckpts, name):
    one = LLM(str(moe_ckpts[name]), num_kv_blocks=64).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    llm = LLM(str(moe_ckpts[name]), num_kv_blocks=64, tensor_parallel_size=2)
    try:
        two = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        held = sum(p.numel() for p in llm.llm_engine.runner.model.parameters())
    finally:
        llm.llm_engine.shutdown()
    assert_same_outputs(one, two)
    from minfer.model.registry import load_model_config
    from minfer.distributed import TensorParallel
    from minfer.model.loader import build_model
    from minfer.ops import TorchOps

    cfg = load_model_config(moe_ckpts[name])
    shard = build_model(moe_ckpts[name], cfg, torch.float32, torch.device("cpu"), 64, TorchOps(), TensorParallel(1, 2))
    full = build_model(moe_ckpts[name], cfg, torch.float32, torch.device("cpu"), 64, TorchOps())
    assert sum(p.numel() for p in shard.parameters()) == held  # both ranks hold the same share
    e0 = full.layers[0].mlp.w_down[0]
    assert torch.equal(shard.layers[0].mlp.w_down[0], e0[:, e0.shape[1] // 2:])  # rank 1: the second half of I


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_triton_moe_path_matches_the_reference(moe_ckpts, name):
    """The fused MoE kernels (in the interpreter), batch 1 through the one-token path included, give the
    reference ops' tokens and logprobs."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[1:3]]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(moe_ckpts[name]), num_kv_blocks=16, attention_backend=backend)
        outs[backend] = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts[:1], params,
                                                                                     use_tqdm=False)
    for fast, ref in zip(outs["triton"], outs["torch"]):
        assert fast.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(fast.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert max(abs(a[t] - b[t]) for t in a) < 1e-3


def test_block_fp8_moe_checkpoint_loads_and_matches_its_dequantized_reference(tmp_path):
    """A Qwen3-MoE checkpoint in the block-FP8 layout (attention and every expert e4m3 with
    weight_scale_inv): the experts are dequantized as they load, the attention layers stay FP8; HF's
    float model on the dequantized weights with e4m3-rounded attention inputs is the reference (HF's
    experts are not nn.Linear, so their inputs stay unrounded there as here)."""
    from fp8_checkpoints import fake_quant_reference, greedy, write_block_fp8, write_dequantized

    src = make_moe_checkpoint(tmp_path / "src", "qwen3_moe", scale=1.0)
    ckpt = write_block_fp8(src, tmp_path / "fp8")
    reference = fake_quant_reference(write_dequantized(ckpt, tmp_path / "deq"), block=True)
    llm = LLM(str(ckpt), num_kv_blocks=64)
    model = llm.llm_engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert model.layers[0].mlp.w_gate_up.dtype == torch.float32 and not model.layers[0].mlp.method._pending
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    agreed = 0
    for prompt, out in zip(PROMPTS, outs):
        ref, ref_logits = greedy(reference, prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits, tie_gap=0.05)
        agreed += out.outputs[0].token_ids == ref
    assert agreed >= len(PROMPTS) - 1
