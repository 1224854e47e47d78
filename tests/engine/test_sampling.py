"""Sampler: exact distributions, filters, penalties, and seeds that ignore batch composition."""
from __future__ import annotations

import pytest
import torch

from conftest import _hf_model
from minfer import LLM, SamplingParams
from minfer.engine.input_batch import SamplingMetadata
from minfer.engine.sampler import Sampler, uniform_noise
from minfer.ops import select_ops

CPU = torch.device("cpu")


def _sampler() -> Sampler:
    return Sampler(CPU, select_ops("torch", CPU, 16, 64))


def _meta(params: list[SamplingParams], seeds: list[int], tokens: list[int] | None = None,
          prompt_len: int = 1) -> SamplingMetadata:
    """Rows of a one-token prompt (``tokens``: prompt + output so far) with EOS id 1."""
    tokens = tokens or [0]
    return SamplingMetadata.from_params(params, seeds, [len(tokens) - prompt_len] * len(params), CPU,
                                        [list(tokens)] * len(params), [prompt_len] * len(params),
                                        [frozenset({1})] * len(params))


def test_noise_is_uniform_and_a_function_of_seed_and_counter():
    seeds = torch.tensor([1, 2, 1], dtype=torch.int64)
    counters = torch.tensor([0, 0, 1], dtype=torch.int64)
    u = uniform_noise(seeds, counters, 50_000)
    assert torch.all((u > 0) & (u < 1))
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    again = uniform_noise(seeds[[2, 0]], counters[[2, 0]], 50_000)
    assert torch.equal(again[1], u[0]) and torch.equal(again[0], u[2])


def test_samples_follow_softmax_of_scaled_logits():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    temp = 0.7
    n = 20_000
    params = [SamplingParams(temperature=temp)] * n
    out = _sampler()(logits.repeat(n, 1), _meta(params, list(range(n)))).result()
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=5).float() / n
    expected = (logits / temp).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


@pytest.mark.parametrize("kw,support", [
    (dict(top_k=2), {0, 1}),
    (dict(top_p=0.6), {0, 1}),          # probs ~ [.51, .19, .11, .02, .07] ... cumulative before 2nd < .6
    (dict(min_p=0.3), {0, 1}),          # keeps tokens with p >= 0.3 * p_max
    (dict(top_k=3, top_p=0.99), {0, 1, 2}),
    (dict(top_k=10**27, top_p=0.6), {0, 1}),  # k past the vocabulary (past int64 too) keeps it all; found by fuzzing
])
def test_filters_restrict_support(kw, support):
    logits = torch.tensor([2.0, 1.0, 0.4, -1.0, 0.0])
    n = 3000
    out = _sampler()(logits.repeat(n, 1), _meta([SamplingParams(temperature=1.0, **kw)] * n, list(range(n)))).result()
    assert set(out.token_ids) == support


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-30, 1e-9])
def test_tiny_top_p_keeps_the_most_likely_token(top_p):
    """A top_p that underflows to 0 in float32 must still keep the top token, never fall back to token 0."""
    logits = torch.tensor([-1.0, 0.5, 3.0, 2.9, 0.0])  # the most likely token is 2, not 0
    n = 200
    params = [SamplingParams(temperature=1.0, top_p=top_p)] * n + [SamplingParams(temperature=1.0, top_p=top_p,
                                                                                  top_k=2)]
    out = _sampler()(logits.repeat(n + 1, 1), _meta(params, list(range(n + 1)))).result()
    assert set(out.token_ids) == {2}


def test_penalties_match_definitions():
    logits = torch.tensor([[3.0, -2.0, 1.0, 0.5, 2.9, -0.1]])
    meta = _meta([SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)],
                 [0], tokens=[2, 3, 0, 0, 1], prompt_len=2)  # output tokens: 0 twice, 1 once; prompt: 2, 3
    out = _sampler()._apply_penalties(logits, meta)
    expected = torch.tensor([[3.0 / 2 - 0.5 - 0.5, -2.0 * 2 - 0.5 - 0.25, 1.0 / 2, 0.5 / 2, 2.9, -0.1]])
    assert torch.allclose(out, expected)


def test_repetition_penalty_matches_hf_processor(checkpoints):
    from transformers import RepetitionPenaltyLogitsProcessor

    model = _hf_model(checkpoints["llama3"])
    prompt = [5, 9, 12, 40, 41]
    ids = torch.tensor([prompt])
    proc = RepetitionPenaltyLogitsProcessor(1.5)
    with torch.no_grad():
        for _ in range(10):
            scores = proc(ids, model(ids).logits[:, -1].float())
            ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], 1)
    llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=32)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                                    repetition_penalty=1.5), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ids[0, len(prompt):].tolist()


def test_seeded_sampling_is_reproducible_and_batch_independent(checkpoints):
    llm = LLM(str(checkpoints["qwen3"]), num_kv_blocks=64)
    target = {"prompt_token_ids": [3, 4, 5, 6, 7]}
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (3, 20, 37)]
    mixed = llm.generate(others[:2] + [target] + others[2:],
                         [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True), params,
                          params, SamplingParams(temperature=0, max_tokens=5)], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].token_ids != alone  # same seed, other prompt: other tokens
    # a different seed gives a different sample; an engine with the same seed repeats unseeded runs
    other_seed = llm.generate(target, SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a = LLM(str(checkpoints["qwen3"]), num_kv_blocks=64, seed=7).generate(target, unseeded, use_tqdm=False)
    b = LLM(str(checkpoints["qwen3"]), num_kv_blocks=64, seed=7).generate(target, unseeded, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_seeded_sampling_survives_preemption(checkpoints):
    prompts = [{"prompt_token_ids": [(7 * i + k) % 300 + 2 for i in range(30)]} for k in range(4)]
    params = [SamplingParams(temperature=1.0, max_tokens=30, seed=k, ignore_eos=True) for k in range(4)]
    roomy = LLM(str(checkpoints["llama3"]), num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    tight_llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=5)
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    assert tight_llm.get_stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]


def test_n_samples_differ_and_share_the_prompt(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=64)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5,
                                                                       ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert llm.get_stats()["num_free_kv_blocks"] == llm.get_stats()["num_kv_blocks"]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_forked_samples_equal_independent_runs(checkpoints, kv_cache_dtype):
    """Samples 1..n-1 share sample 0's prompt blocks (copy on write): each must draw exactly what a
    separate request with its seed draws, and nothing may leak."""
    llm = LLM(str(checkpoints["qwen3"]), num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    prompt = {"prompt_token_ids": [(i * 13) % 300 + 2 for i in range(37)]}  # 2 full blocks + a shared partial one
    forked = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5, ignore_eos=True),
                          use_tqdm=False)[0]
    for i, sample in enumerate(forked.outputs):
        seed = 5 if i == 0 else hash((5, i)) & (2**63 - 1)
        alone = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=10, seed=seed, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
        assert sample.token_ids == alone.token_ids
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    greedy = llm.generate(prompt, SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_abort_before_fork_frees_everything(checkpoints):
    from minfer.config import EngineConfig
    from minfer.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama3"]), num_kv_blocks=32, max_num_batched_tokens=8,
                                    max_num_seqs=4))
    engine.add_request("r", {"prompt_token_ids": list(range(2, 30))}, SamplingParams(n=3, max_tokens=5))
    engine.step()  # a first chunk of sample 0's prompt: the other samples are not forked yet
    engine.abort_request("r")
    stats = engine.get_stats()
    assert not engine.has_unfinished_requests() and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_row_hash_on_host_equals_the_device_formula():
    """The sampler hashes rows in numpy (uint64) on the host; the tests' references hash torch int64
    tensors: both must give the same numbers, seeds up to 2**63 - 1 included."""
    import numpy as np

    from minfer.engine.sampler import row_hash

    seeds = [0, 1, 12345, 2**32 - 1, 2**32, 2**62 + 7, 2**63 - 1]
    counters = [0, 1, 7, 1000, 65535, 3, 2**20]
    host = row_hash(np.array(seeds, dtype=np.uint64), np.array(counters, dtype=np.uint64))
    dev = row_hash(torch.tensor(seeds, dtype=torch.int64), torch.tensor(counters, dtype=torch.int64))
    assert host.dtype == np.uint64 and host.max() < 2**32
    assert host.astype(np.int64).tolist() == dev.tolist()
