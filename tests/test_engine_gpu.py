"""GPU engine checks (run on the accelerator machine with `pytest -m gpu`)."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_greedy_match, hf_greedy
from minfer import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5], list(range(2, 18)), list(range(3, 20)), [(i * 7) % 300 + 2 for i in range(50)]]


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("kwargs", [dict(num_kv_blocks=64), dict(num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=4),
                                    dict(num_kv_blocks=5)])
def test_triton_engine_on_gpu_matches_hf(checkpoints, arch, kwargs):
    assert torch.cuda.is_available()
    llm = LLM(str(checkpoints[arch]), device="cuda", dtype="float32", **kwargs)
    assert llm.llm_engine.runner.backend == "triton"
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref, ref_logits = hf_greedy(checkpoints[arch], prompt, 16)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_bf16_triton_and_torch_backends_agree(checkpoints):
    """Both GPU paths in bfloat16 produce the same greedy tokens on most prompts (rounding differs)."""
    prompts = [[(i * k) % 300 + 2 for i in range(20 + k)] for k in range(1, 13)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(checkpoints["llama3"]), device="cuda", dtype="bfloat16", num_kv_blocks=128,
                  attention_backend=backend)
        runs[backend] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                      params, use_tqdm=False)]
    same = sum(a == b for a, b in zip(runs["torch"], runs["triton"]))
    assert same >= len(prompts) * 3 // 4, f"only {same}/{len(prompts)} prompts agree"
