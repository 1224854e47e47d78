"""GPU engine checks (run on the accelerator machine with `pytest -m gpu`)."""
from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, assert_greedy_match, hf_greedy, kv_settings
from minfer import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5], list(range(2, 18)), list(range(3, 20)), [(i * 7) % 300 + 2 for i in range(50)]]


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("kwargs", [dict(num_kv_blocks=64), dict(num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=4),
                                    dict(num_kv_blocks=5)])
def test_triton_engine_on_gpu_matches_hf(checkpoints, arch, kwargs):
    """Every architecture on the Triton kernels (sliding windows, soft-caps, the hybrid cache's groups in the
    decode graphs), default / chunked / preempting, against HF."""
    assert torch.cuda.is_available()
    llm = LLM(str(checkpoints[arch]), device="cuda", dtype="float32", **kv_settings(checkpoints[arch], kwargs))
    assert llm.llm_engine.runner.ops.name == "triton"
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):  # a short max_model_len (phi3_longrope: 64) ends the longest early
        n = min(16, llm.llm_engine.max_model_len - len(prompt))
        ref, ref_logits = hf_greedy(checkpoints[arch], prompt, n)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_bf16_triton_path_is_as_accurate_as_torch_path(checkpoints):
    """In bfloat16 both GPU paths round differently; measured against the float32 model, the Triton
    path's next-token logprobs must be no less accurate than the torch path's (and both close)."""
    prompts = [[(i * k) % 300 + 2 for i in range(20 + 7 * k)] for k in range(1, 13)]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    ref_llm = LLM(str(checkpoints["llama3"]), device="cuda", dtype="float32", num_kv_blocks=128)
    ref = [o.outputs[0].logprobs[0] for o in ref_llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                use_tqdm=False)]
    errors = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(checkpoints["llama3"]), device="cuda", dtype="bfloat16", num_kv_blocks=128,
                  attention_backend=backend)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        diffs = [abs(o.outputs[0].logprobs[0][t] - r[t]) for o, r in zip(outs, ref) for t in r
                 if t in o.outputs[0].logprobs[0]]
        errors[backend] = sum(diffs) / len(diffs)
    print("mean |logprob error| vs float32:", errors)
    assert errors["triton"] <= errors["torch"] * 1.25 + 0.01, errors
    assert errors["triton"] < 0.3, errors


def test_cuda_graph_decode_equals_eager(checkpoints):
    """Greedy outputs with decode graphs equal those with enforce_eager=True. In float32: a graph
    replays a padded batch, where cuBLAS and the split-K heuristic may order sums differently than
    the eager batch, so bf16 outputs of a random model (full of near-ties) are not comparable token
    for token, while any real fault (stale buffers, padding rows writing the cache) shows here."""
    prompts = [[(i * k) % 300 + 2 for i in range(5 + 9 * k)] for k in range(1, 20)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    results = {}
    for eager in (True, False):
        llm = LLM(str(checkpoints["qwen3"]), device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=32,
                  max_model_len=512, enforce_eager=eager)
        assert (llm.llm_engine.runner.graphs is None) == eager
        results[eager] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                       params, use_tqdm=False)]
    assert results[True] == results[False]


def test_async_scheduling_equals_sync_on_gpu(checkpoints):
    """The overlap's device side (pinned uploads, pending tokens copied from the previous step's
    draws into graph inputs, draws copied back behind an event) gives the synchronous outputs."""
    from test_async_scheduling import _mixed_requests

    results = {}
    for overlap in (False, True):
        llm = LLM(str(checkpoints["llama3"]), device="cuda", dtype="float32", num_kv_blocks=14,
                  max_num_batched_tokens=48, max_num_seqs=8, async_scheduling=overlap)
        prompts, params = _mixed_requests(next(iter(llm.llm_engine.eos_token_ids)))
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[overlap] = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
        stats = llm.get_stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_preemptions"] > 0
    assert results[True] == results[False]
