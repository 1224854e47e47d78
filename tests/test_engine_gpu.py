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
    """In bfloat16 the two GPU paths differ only by rounding: each prompt's next-token distribution
    agrees (torch's greedy token is among Triton's top 3, its logprob within 0.1). Whole greedy
    continuations are not compared: bf16 logits of a random model tie often, and a tie broken
    differently sends the two continuations apart for good."""
    prompts = [[(i * k) % 300 + 2 for i in range(20 + 7 * k)] for k in range(1, 13)]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=3)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(checkpoints["llama3"]), device="cuda", dtype="bfloat16", num_kv_blocks=128,
                  attention_backend=backend)
        runs[backend] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                            params, use_tqdm=False)]
    for ref, got in zip(runs["torch"], runs["triton"]):
        tok = ref.token_ids[0]
        assert tok in got.logprobs[0], (ref.logprobs[0], got.logprobs[0])
        assert abs(ref.logprobs[0][tok] - got.logprobs[0][tok]) < 0.1
