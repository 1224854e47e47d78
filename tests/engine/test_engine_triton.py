"""The whole engine on the Triton kernels (interpreter on CPU) gives HF's greedy tokens."""
from __future__ import annotations

import pytest

from conftest import assert_greedy_match, hf_greedy
from minfer import LLM, SamplingParams

PROMPTS = [[5], list(range(2, 18)), list(range(3, 20)), [(i * 7) % 300 + 2 for i in range(40)]]
NEW = 6


@pytest.mark.parametrize("arch,kwargs", [
    ("llama3", dict(num_kv_blocks=64)),
    ("qwen3", dict(num_kv_blocks=64, max_num_batched_tokens=6, max_num_seqs=4, prompts=3)),  # chunks + decodes
    ("qwen2", dict(num_kv_blocks=4, prompts=3)),  # preemption + recompute through the prefix cache
    # one sequence at a time: the batch-1 matrix-vector kernels with a bias (two prompts: each runs alone, slowly)
    ("qwen2", dict(num_kv_blocks=64, max_num_seqs=1, prompts=2)),
    # Gated DeltaNet's conv and delta-rule kernels: chunks of 6 (state carried across them) beside decodes
    ("qwen3_5", dict(num_kv_blocks=64, max_num_batched_tokens=6, max_num_seqs=4, prompts=3)),
])
def test_triton_backend_matches_hf(checkpoints, arch, kwargs):
    kwargs = dict(kwargs)
    prompts = PROMPTS[:kwargs.pop("prompts", len(PROMPTS))]
    llm = LLM(str(checkpoints[arch]), attention_backend="triton", **kwargs)
    assert llm.llm_engine.runner.ops.name == "triton"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref, ref_logits = hf_greedy(checkpoints[arch], prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    if kwargs.get("num_kv_blocks") == 4:
        assert stats["num_preemptions"] > 0


def test_auto_backend_is_torch_on_cpu_and_triton_checks_block_size(checkpoints):
    assert LLM(str(checkpoints["llama3"]), num_kv_blocks=8).llm_engine.runner.ops.name == "torch"
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(checkpoints["llama3"]), num_kv_blocks=8, block_size=8, attention_backend="triton")


def test_startup_kernel_warm_up_runs_the_eager_path(checkpoints):
    """The GPU start-up warm-up (which compiles eager kernel variants before the first request)
    builds valid mixed decode + chunk steps; here under the interpreter, then the engine still
    matches HF (block 0, which the warm-up scribbles on, is rewritten before any sequence reads it)."""
    llm = LLM(str(checkpoints["llama3"]), attention_backend="triton", num_kv_blocks=64)
    runner = llm.llm_engine.runner
    runner.warm_up_kernels(runner.model, runner.forward, width=8)  # the GPU's 64 cost a minute interpreted
    prompt = list(range(3, 40))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    ref, ref_logits = hf_greedy(checkpoints["llama3"], prompt, 6)
    assert_greedy_match(out[0].outputs[0].token_ids, ref, ref_logits)
