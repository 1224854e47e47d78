"""Tensor parallelism on the CPU (gloo, float32): tp=2 gives tp=1's tokens and logprobs and HF's
greedy tokens, for every architecture and scheduling path; each rank loads only its shard; bad sizes
fail at construction; a dead worker fails the engine fast, naming its rank."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
import torch

from conftest import ARCHS, assert_greedy_match, assert_same_outputs, hf_greedy, kv_settings, make_checkpoint
from minfer import LLM, SamplingParams, StructuredOutputsParams
from minfer.model.registry import load_model_config
from minfer.distributed import TensorParallel
from minfer.engine.tp_workers import TensorParallelError
from minfer.model.loader import build_model
from minfer.ops import TorchOps

PROMPTS = [[5], list(range(2, 18)), list(range(3, 20)), [(i * 7) % 300 + 2 for i in range(50)]]
SHARED = [(i * 11) % 290 + 3 for i in range(40)]
NEW = 10
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=2)

SCENARIOS = {
    "default": dict(num_kv_blocks=64),
    # prompts in chunks of at most 6 tokens, and 4 blocks: the longest request just fits alone (preemption)
    "chunked_preempt": dict(num_kv_blocks=4, max_num_batched_tokens=6, max_num_seqs=4),
}


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_tp2_matches_tp1_and_hf(checkpoints, arch, scenario):
    prompts = PROMPTS + ([SHARED + [7, 8], SHARED + [9]] if scenario == "default" else [])
    settings = kv_settings(checkpoints[arch], SCENARIOS[scenario])
    one = _run(LLM(str(checkpoints[arch]), **settings), prompts)
    llm = LLM(str(checkpoints[arch]), tensor_parallel_size=2, **settings)
    try:
        two = _run(llm, prompts)
        assert_same_outputs(two, one)
        for prompt, out in zip(prompts, two):
            ref, ref_logits = hf_greedy(checkpoints[arch], prompt, NEW)
            assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
        stats = llm.get_stats()
        assert stats["tensor_parallel_size"] == 2
        if scenario == "default":  # the same prompts again: their blocks come from the prefix cache
            assert_same_outputs(_run(llm, prompts[-2:]), two[-2:])
            hits = llm.get_stats()["prefix_cache_hit_tokens"]  # none for a recurrent model (state_cache.py)
            assert hits == 0 if llm.llm_engine.runner.state_layers else hits >= 2 * 32
        else:
            assert stats["num_preemptions"] > 0
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    finally:
        llm.llm_engine.shutdown()


def test_tp2_sampling_features_match_tp1(checkpoints):
    """n > 1 with seeds, penalties, prompt logprobs and an 8-bit KV cache: rank 0 samples exactly as on one
    process, the workers only follow."""
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3, logprobs=1),
              SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=3, repetition_penalty=1.3,
                             presence_penalty=0.5),
              SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[1:4]]
    for kv in ("auto", "int8"):
        one = LLM(str(checkpoints["qwen2"]), num_kv_blocks=64, kv_cache_dtype=kv).generate(prompts, params,
                                                                                           use_tqdm=False)
        llm = LLM(str(checkpoints["qwen2"]), num_kv_blocks=64, kv_cache_dtype=kv, tensor_parallel_size=2)
        try:
            two = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        for x, y in zip(one, two):
            assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        plp_one, plp_two = one[2].prompt_logprobs, two[2].prompt_logprobs
        assert len(plp_one) == len(plp_two) == len(PROMPTS[3])
        for a, b in zip(plp_one[1:], plp_two[1:]):
            assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-4


def test_kv_heads_replicate_when_tp_exceeds_them(tmp_path):
    """One KV head (multi-query attention) over two ranks: both hold it, each with its query heads."""
    ckpt = make_checkpoint(tmp_path / "mqa", "llama3", kv_heads=1)
    one = _run(LLM(str(ckpt), num_kv_blocks=64), PROMPTS)
    llm = LLM(str(ckpt), num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert_same_outputs(_run(llm, PROMPTS), one)
    finally:
        llm.llm_engine.shutdown()
    for out, prompt in zip(one, PROMPTS):
        ref, ref_logits = hf_greedy(ckpt, prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "phi3"])
def test_each_rank_loads_only_its_shard(checkpoints, arch):
    """Resident parameter bytes per rank ≈ 1/N of the model (norms, replicated, are the only excess),
    and the shards together hold every weight."""
    cfg = load_model_config(checkpoints[arch])
    full = build_model(checkpoints[arch], cfg, torch.float32, torch.device("cpu"), 64, TorchOps())
    total = sum(p.numel() for p in full.parameters())
    replicated = sum(p.numel() for n, p in full.named_parameters() if "norm" in n)
    for size in (2, 4):
        shards = [build_model(checkpoints[arch], cfg, torch.float32, torch.device("cpu"), 64, TorchOps(),
                              TensorParallel(rank, size)) for rank in range(size)]
        for shard in shards:
            held = sum(p.numel() for p in shard.parameters())
            if size <= cfg.num_key_value_heads:  # (at 4 ranks, 2 KV heads are replicated: more than 1/4)
                assert held <= (total - replicated) / size + replicated, (size, held, total)
            assert held >= (total - replicated) / size, (size, held, total)
        # rank r's q rows and o_proj columns are the full model's r-th slices
        q = full.layers[0].self_attn.qkv_proj.weight[:cfg.num_attention_heads * cfg.head_dim]
        got = torch.cat([s.layers[0].self_attn.qkv_proj.weight[:s.layers[0].self_attn.q_size] for s in shards])
        assert torch.equal(got, q)
        o = torch.cat([s.layers[0].self_attn.o_proj.weight for s in shards], dim=1)
        assert torch.equal(o, full.layers[0].self_attn.o_proj.weight)
        emb = torch.cat([s.embed_tokens.weight for s in shards])[:cfg.vocab_size]
        assert torch.equal(emb, full.embed_tokens.weight)


class _RecordedSlice:
    """A safetensors slice that notes every index a loader reads it with."""

    def __init__(self, source, reads: list) -> None:
        self.source, self.reads = source, reads

    def __getitem__(self, index):
        self.reads.append(index)
        return self.source[index]


def test_phi3_ranks_read_only_their_rows_of_the_fused_tensors(checkpoints, monkeypatch):
    """Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj: at tp=2 each rank reads, from
    each, only its q heads, its KV heads and its intermediate rows (one row slice per shard, never the whole
    tensor), and those rows hold the same values as one process's model."""
    import minfer.model.loader as loader

    folder = checkpoints["phi3"]
    cfg = load_model_config(folder)
    reads: dict[str, list] = {}
    plain = loader._checkpoint_tensors

    def recorded(model_dir):
        for name, source, where in plain(model_dir):
            yield name, _RecordedSlice(source, reads.setdefault(name, [])), where

    monkeypatch.setattr(loader, "_checkpoint_tensors", recorded)
    full = build_model(folder, cfg, torch.float32, torch.device("cpu"), 64, TorchOps())
    d, i = cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    for rank in range(2):
        reads.clear()
        shard = build_model(folder, cfg, torch.float32, torch.device("cpu"), 64, TorchOps(), TensorParallel(rank, 2))
        qkv_rows = [(rank * q // 2, (rank + 1) * q // 2), (q + rank * kv // 2, q + (rank + 1) * kv // 2),
                    (q + kv + rank * kv // 2, q + kv + (rank + 1) * kv // 2)]
        gate_up_rows = [(rank * i // 2, (rank + 1) * i // 2), (i + rank * i // 2, i + (rank + 1) * i // 2)]
        for n in range(cfg.num_hidden_layers):
            for module, rows in (("self_attn.qkv_proj", qkv_rows), ("mlp.gate_up_proj", gate_up_rows)):
                name = f"model.layers.{n}.{module}.weight"
                assert [(r.start, r.stop) for r in reads[name]] == rows, (rank, name, reads[name])
                # one process's fused parameter stacks the whole matrices as the checkpoint does
                whole = full.layers[n].get_submodule(module).weight
                held = shard.layers[n].get_submodule(module).weight
                assert torch.equal(held, torch.cat([whole[a:b] for a, b in rows]))


@pytest.mark.parametrize("size", [0, 3, 8])
def test_bad_tensor_parallel_size_names_the_field(checkpoints, size):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(checkpoints["llama3"]), tensor_parallel_size=size)


def test_a_dead_worker_fails_the_engine_fast_and_names_its_rank(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=64, tensor_parallel_size=2)
    engine = llm.llm_engine
    worker = engine.workers.procs[0]
    try:
        _run(llm, PROMPTS[:1])
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()  # the watcher names the death while the engine is idle, before any step
        while engine.failure is None and time.monotonic() - started < 60:  # (a guard against a hang only)
            time.sleep(0.02)
        assert engine.failure is not None and "rank 1" in engine.failure and "SIGKILL" in engine.failure
        with pytest.raises(TensorParallelError, match="rank 1"):
            _run(llm, PROMPTS[:2])
    finally:
        engine.shutdown()
    assert not worker.is_alive()


def test_shutdown_stops_every_worker(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=64, tensor_parallel_size=2)
    procs = list(llm.llm_engine.workers.procs)
    assert all(p.is_alive() for p in procs)
    with open(f"/proc/{procs[0].pid}/comm") as f:
        assert f.read().strip() == "minfer-tp1"
    llm.llm_engine.shutdown()
    assert not any(p.is_alive() for p in procs)
    llm.llm_engine.shutdown()  # idempotent


def test_a_stuck_worker_fails_the_engine_within_the_time_limit(checkpoints, monkeypatch):
    """A worker that stops answering (SIGSTOP) without dying: the next collective on rank 0 gives up after
    MINFER_TP_TIMEOUT seconds and says so."""
    import minfer.engine.tp_workers as tp_workers

    monkeypatch.setattr(tp_workers, "TIMEOUT_S", 3.0)
    llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=64, tensor_parallel_size=2)
    engine = llm.llm_engine
    worker = engine.workers.procs[0]
    try:
        _run(llm, PROMPTS[:1])
        os.kill(worker.pid, signal.SIGSTOP)
        with pytest.raises(TensorParallelError, match="timed out"):  # raised, where a hang would never return
            _run(llm, PROMPTS[:2])
    finally:
        engine.shutdown()  # kills the stopped worker after its grace period
    assert not worker.is_alive()


def test_tp2_structured_outputs_match_tp1(checkpoints):
    """Constrained sampling stays on rank 0 (the bitmask, the matchers); the workers follow the same steps,
    prepared-ahead ones included, and the tokens equal one process's."""
    schema = {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 99}}
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured_outputs=StructuredOutputsParams(
                  json=schema, disable_any_whitespace=True)) for s in range(3)]
    params.append(SamplingParams(max_tokens=12, temperature=1.0, seed=9,
                                 structured_outputs=StructuredOutputsParams(regex="[a-c]{3,6}")))
    prompts = ["hello", "the", "a b", "x"]
    one = LLM(str(checkpoints["qwen2"]), num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(checkpoints["qwen2"]), num_kv_blocks=64, tensor_parallel_size=2)
    try:
        two = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in two]
    for o in one[:3]:
        assert o.outputs[0].finish_reason == "stop" and isinstance(json.loads(o.outputs[0].text), list)
    assert re.fullmatch("[a-c]{3,6}", one[3].outputs[0].text)
