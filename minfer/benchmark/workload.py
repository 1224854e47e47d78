"""Benchmark workloads (BENCHMARKS.md) and the physical bounds their results are reported against."""
from __future__ import annotations

import random

from minfer.sampling_params import SamplingParams

# Output tok/s bounds of workload A on one H200 (BENCHMARKS.md): max(bytes/BW, FLOPs/peak) and the sum.
WORKLOAD_A_BOUND = {"qwen3-0.6b": 37_400, "llama-3.2-1b": 86_900, "llama-3.1-8b": 18_100}
WORKLOAD_A_SUM_BOUND = {"qwen3-0.6b": 33_600, "llama-3.2-1b": 57_300, "llama-3.1-8b": 10_700}
WORKLOAD_A_MAX_TOKEN_ID = 10_000  # prompt ids are randint(0, 10000): the model needs a larger vocabulary
# max_model_len of a benchmark run unless given: workload A's sequences stay under 2,048 tokens, and the shapes'
# own contexts (40k-128k) would size the block tables and the start-up memory profile for sequences never run.
BENCH_MAX_MODEL_LEN = 4096


def workload_a(num_requests: int = 256) -> tuple[list[dict], list[SamplingParams]]:
    """The nano-vllm offline benchmark, exactly: random prompts of 100-1024 ids < 10001, then
    (second loop) temperature 0.6, ignore_eos, 100-1024 new tokens."""
    random.seed(0)
    prompts = [{"prompt_token_ids": [random.randint(0, WORKLOAD_A_MAX_TOKEN_ID)
                                     for _ in range(random.randint(100, 1024))]} for _ in range(num_requests)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(100, 1024))
              for _ in range(num_requests)]
    return prompts, params


def fixed_workload(num_requests: int, input_len: int, output_len: int, seed: int = 0,
                   vocab_size: int = 10001) -> tuple[list[dict], list[SamplingParams]]:
    """Equal lengths for every request; token ids below min(10001, vocab_size)."""
    rng = random.Random(seed)
    top = min(WORKLOAD_A_MAX_TOKEN_ID, vocab_size - 1)
    prompts = [{"prompt_token_ids": [rng.randint(0, top) for _ in range(input_len)]} for _ in range(num_requests)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=output_len) for _ in range(num_requests)]
    return prompts, params
