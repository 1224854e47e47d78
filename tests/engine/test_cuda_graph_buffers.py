"""The decode-graph runner's static buffers and padding rows, checked on the CPU without capture.

On a GPU the same buffers are captured and replayed (tests/engine/test_engine_gpu.py compares graphs
with enforce_eager); here the runner executes its buffers eagerly, which exercises the padding
rows (slot -1, context 1) and the bucket choice through the Triton interpreter.
"""
from __future__ import annotations

from conftest import assert_greedy_match, hf_greedy
from minfer import LLM, SamplingParams
from minfer.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from minfer.config import cdiv


def test_bucket_sizes():
    assert graph_batch_sizes(256)[:5] == [1, 2, 4, 8, 16] and graph_batch_sizes(256)[-1] == 256
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1) == [1]


def test_padded_decode_buffers_match_hf(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), attention_backend="triton", num_kv_blocks=64, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=128)
    runner = llm.llm_engine.runner
    graphs = DecodeGraphs(runner.model, 8, cdiv(128, 16), 16, runner.device)  # not captured
    calls = []
    real_run = graphs.run
    graphs.run = lambda *a: calls.append(len(a[0])) or real_run(*a)
    runner.graphs = graphs
    prompts = [[5, 6, 7], list(range(2, 20)), list(range(30, 63))]  # 3 decodes run in the bucket of 4
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref, ref_logits = hf_greedy(checkpoints["llama3"], prompt, 6)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
    assert calls and set(calls) == {3}  # every decode step went through the buffers, one padding row
    assert int(graphs.slot_mapping[0, 3]) == -1 and int(graphs.context_lens[3]) == 1
