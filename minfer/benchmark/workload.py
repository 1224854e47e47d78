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


WORKLOAD_A_LONGEST = 2 * 1024  # the longest prompt + output workload A can draw (1,024 + 1,024)


def workload_a(num_requests: int = 256, max_model_len: int | None = None,
               vocab_size: int | None = None) -> tuple[list[dict], list[SamplingParams]]:
    """The nano-vllm offline benchmark, exactly: random prompts of 100-1024 ids < 10001, then
    (second loop) temperature 0.6, ignore_eos, 100-1024 new tokens.

    Fitted to a smaller model with the same draws (``fit_note`` says how): under a ``max_model_len``
    below 2,048 every prompt and output length is scaled by ``max_model_len / 2048``, so each request
    fits (the built-in model's 1,024: half as long); under a ``vocab_size`` of 10,001 or fewer the ids
    are taken modulo it (throughput does not depend on which ids a random prompt holds)."""
    random.seed(0)
    prompts = [{"prompt_token_ids": [random.randint(0, WORKLOAD_A_MAX_TOKEN_ID)
                                     for _ in range(random.randint(100, 1024))]} for _ in range(num_requests)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(100, 1024))
              for _ in range(num_requests)]
    if max_model_len is not None and max_model_len < WORKLOAD_A_LONGEST:
        for p, sp in zip(prompts, params):
            ids = p["prompt_token_ids"]
            del ids[max(1, len(ids) * max_model_len // WORKLOAD_A_LONGEST):]
            sp.max_tokens = max(1, sp.max_tokens * max_model_len // WORKLOAD_A_LONGEST)
    if vocab_size is not None and vocab_size <= WORKLOAD_A_MAX_TOKEN_ID:
        for p in prompts:
            p["prompt_token_ids"] = [t % vocab_size for t in p["prompt_token_ids"]]
    return prompts, params


def fit_note(max_model_len: int | None, vocab_size: int | None) -> str:
    """How ``workload_a`` changed the workload for such a model ("" when it did not)."""
    notes = []
    if max_model_len is not None and max_model_len < WORKLOAD_A_LONGEST:
        notes.append(f"lengths x {max_model_len}/{WORKLOAD_A_LONGEST} for max_model_len {max_model_len}")
    if vocab_size is not None and vocab_size <= WORKLOAD_A_MAX_TOKEN_ID:
        notes.append(f"ids mod {vocab_size}")
    return ", ".join(notes)


def fixed_workload(num_requests: int, input_len: int, output_len: int, seed: int = 0,
                   vocab_size: int = 10001) -> tuple[list[dict], list[SamplingParams]]:
    """Equal lengths for every request; token ids below min(10001, vocab_size)."""
    rng = random.Random(seed)
    top = min(WORKLOAD_A_MAX_TOKEN_ID, vocab_size - 1)
    prompts = [{"prompt_token_ids": [rng.randint(0, top) for _ in range(input_len)]} for _ in range(num_requests)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=output_len) for _ in range(num_requests)]
    return prompts, params
