"""Tensor parallelism on GPUs (NCCL; `pytest -m gpu` on a machine with 2 or more GPUs): tp=2 gives
HF's and tp=1's greedy tokens through the Triton ops, the decode CUDA graphs (all-reduces and the
logits gather captured) and the batch-1 one-token path."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_greedy_match, hf_greedy
from minfer import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

PROMPTS = [[5], list(range(2, 18)), list(range(3, 20)), [(i * 7) % 300 + 2 for i in range(50)]]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("kwargs", [dict(num_kv_blocks=64), dict(num_kv_blocks=64, enforce_eager=True),
                                    dict(num_kv_blocks=5, max_num_batched_tokens=8, max_num_seqs=4)])
def test_tp2_on_gpus_matches_tp1_and_hf(checkpoints, arch, kwargs):
    one = LLM(str(checkpoints[arch]), device="cuda", dtype="float32", **kwargs)
    ref_one = one.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    del one
    llm = LLM(str(checkpoints[arch]), device="cuda", dtype="float32", tensor_parallel_size=2, **kwargs)
    try:
        assert llm.llm_engine.runner.ops.name == "triton"
        assert (llm.llm_engine.runner.graphs is None) == bool(kwargs.get("enforce_eager"))
        batch = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        alone = llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, use_tqdm=False)  # batch 1: one-token path
        for prompt, out, base in zip(PROMPTS, batch, ref_one):
            ref, ref_logits = hf_greedy(checkpoints[arch], prompt, 16)
            assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
            assert out.outputs[0].token_ids == base.outputs[0].token_ids
        assert alone[0].outputs[0].token_ids == batch[1].outputs[0].token_ids
        stats = llm.get_stats()
        assert stats["tensor_parallel_size"] == 2 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    finally:
        llm.llm_engine.shutdown()
