"""`minfer bench` under tensor parallelism (CPU, gloo): the bounds scale with the number of GPUs, a
tp=2 run reports it end to end, and the llama-3.1-70b shape is written file by file and loads."""
from __future__ import annotations

import json
import math

import pytest

from minfer import LLM, SamplingParams
from minfer.benchmark import shapes
from minfer.benchmark.bounds import DecodeCost, batch1_bound, throughput_bounds
from minfer.benchmark.offline import run_batch1
from minfer.benchmark.workload import WORKLOAD_A_BOUND, WORKLOAD_A_SUM_BOUND, workload_a
from minfer.cli import main as cli_main
from minfer.config import ModelConfig
from minfer.model.registry import load_model_config, model_config

SMALL = ["--num-kv-blocks", "32", "--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]


def _config(shape: str, **kw) -> ModelConfig:
    return model_config(shapes.shape_config(shape, **kw))


def _workload_a_lens() -> tuple[list[int], list[int]]:
    prompts, params = workload_a()
    return [len(p["prompt_token_ids"]) for p in prompts], [p.max_tokens for p in params]


@pytest.mark.parametrize("shape", ["llama-3.1-8b", "llama-3.1-70b", "qwen3-0.6b"])
def test_bounds_scale_with_tensor_parallel_size(shape):
    """Each GPU reads and computes 1/N (norms replicated: at most ~1e-4 of the bytes), so N GPUs bound N x higher."""
    cfg, (p, o) = _config(shape), _workload_a_lens()
    one, two = DecodeCost.for_model(cfg, 1), DecodeCost.for_model(cfg, 2)
    assert batch1_bound(two) / batch1_bound(one) == pytest.approx(2, rel=1e-3)
    b1, b2 = throughput_bounds(one, p, o), throughput_bounds(two, p, o)
    assert b2["gpus"] == 2
    for key in ("bound_tok_s", "sum_bound_tok_s"):
        assert b2[key] / b1[key] == pytest.approx(2, rel=1e-3)
    assert b2["byte_s"] == pytest.approx(b1["byte_s"] / 2, rel=1e-3)
    assert b2["flop_s"] == pytest.approx(b1["flop_s"] / 2, rel=1e-3)


def test_bounds_reproduce_benchmarks_md():
    """tp=1: workload.py's table (BENCHMARKS.md) within 1%; the batch-1 bounds (untied embedding not read);
    the 70B at tp=4: BENCHMARKS.md's 11,080 / 5,860 / 121 tok/s within 1%."""
    p, o = _workload_a_lens()
    for shape, bound in WORKLOAD_A_BOUND.items():
        b = throughput_bounds(DecodeCost.for_model(_config(shape)), p, o)
        assert b["bound_tok_s"] == pytest.approx(bound, rel=0.01)
        assert b["sum_bound_tok_s"] == pytest.approx(WORKLOAD_A_SUM_BOUND[shape], rel=0.01)
    for shape, tok_s in (("qwen3-0.6b", 3540), ("llama-3.2-1b", 1707), ("llama-3.1-8b", 281)):
        assert batch1_bound(DecodeCost.for_model(_config(shape))) == pytest.approx(tok_s, rel=0.002)
    c70 = DecodeCost.for_model(_config("llama-3.1-70b"), 4)
    b = throughput_bounds(c70, p, o)
    assert b["bound_tok_s"] == pytest.approx(11_080, rel=0.01)
    assert b["sum_bound_tok_s"] == pytest.approx(5_860, rel=0.01)
    assert batch1_bound(c70) == pytest.approx(121, rel=0.01)


def test_kv_heads_are_replicated_past_their_number():
    """8 KV heads over 16 GPUs: each holds one whole head (the KV bytes per GPU stop halving)."""
    cfg = _config("llama-3.1-8b")
    assert DecodeCost.for_model(cfg, 8).kv_bytes_per_token == DecodeCost.for_model(cfg, 16).kv_bytes_per_token
    assert DecodeCost.for_model(cfg, 4).kv_bytes_per_token == 2 * DecodeCost.for_model(cfg, 8).kv_bytes_per_token


def _tiny_bench(tmp_path, monkeypatch, parallel_flag: str) -> list[str]:
    """`minfer bench` arguments for a 2-layer stand-in of the 8B shape, written under ``tmp_path``, over 2 ranks or
    replicas (``parallel_flag``)."""
    tiny = dict(shapes.SHAPES["llama-3.1-8b"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=512)
    monkeypatch.setitem(shapes.SHAPES, "tiny-llama", tiny)
    return ["bench", "--shape", "tiny-llama", "--checkpoint-dir", str(tmp_path), "--quiet", parallel_flag, "2", *SMALL]


def test_bench_cli_tp2_end_to_end(tmp_path, monkeypatch):
    """`minfer bench --shape ... --tensor-parallel-size 2` on the CPU: the JSON names 2 GPUs, the per-GPU figure,
    and bounds from the rank-0 shard's bytes that equal the shape's share (`--batch1`: the 70B test below)."""
    base = _tiny_bench(tmp_path, monkeypatch, "--tensor-parallel-size")
    out = tmp_path / "a.json"
    assert cli_main(base + ["--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                            "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tensor_parallel_size"] == 2 and r["engine"]["tensor_parallel_size"] == 2
    assert r["output_tokens"] == 12 and r["output_tok_s_per_gpu"] == pytest.approx(r["output_tok_s"] / 2, abs=0.1)
    assert r["kv_cache_tokens"] == r["num_kv_blocks"] * 16
    cfg = load_model_config(tmp_path / "tiny-llama")
    expected = throughput_bounds(DecodeCost.for_model(cfg, 2, weight_element_bytes=4, kv_element_bytes=4),
                                 [8] * 3, [4] * 3)  # float32 on the CPU
    assert r["bounds"] == expected
    assert r["share_of_bound"] == pytest.approx(r["output_tok_s"] / expected["bound_tok_s"], abs=1e-4)  # rounded


def test_bench_cli_dp2_measures_the_replicas_together(tmp_path, monkeypatch, capsys):
    """`minfer bench --data-parallel-size 2`: every request runs once across the two replicas, the per-GPU figure
    halves, the bounds say they are twice one engine's; batch 1 with replicas is refused, naming why."""
    base = _tiny_bench(tmp_path, monkeypatch, "--data-parallel-size")
    out = tmp_path / "a.json"
    assert cli_main(base + ["--num-prompts", "6", "--input-len", "8", "--output-len", "4",
                            "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["data_parallel_size"] == 2 and r["output_tokens"] == 24 and r["requests"] == 6
    assert r["output_tok_s_per_gpu"] == pytest.approx(r["output_tok_s"] / 2, abs=0.1)
    assert r["bound_note"].startswith("2 x one engine's bounds") and "bounds" not in r and "share_of_bound" not in r
    assert cli_main(base + ["--batch1"]) != 0
    assert "data_parallel_size > 1 measures the replicas' throughput together: not with batch1" in \
        capsys.readouterr().err


def test_70b_shape_plan_is_streamed_and_a_scaled_version_loads(tmp_path, monkeypatch):
    """The full 70B's files (planned, not written); a 1-layer version with its head layout, written file by
    file, loads at tp=2 and runs batch 1 against the 2-GPU bound."""
    cfg = shapes.shape_config("llama-3.1-70b")
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == \
        (8192, 80, 64, 8, 128, 28672, 128256, False)
    assert cfg["rope_scaling"] == shapes.SHAPES["llama-3.1-8b"]["rope_scaling"]
    plan = shapes.plan_shards(cfg, 2, 2 << 30)  # the full-size 70B, nothing allocated
    sizes = [sum(math.prod(s) * 2 for s in shard.values()) for shard in plan]
    assert sum(sizes) == pytest.approx(141.1e9, rel=1e-3) and max(sizes) <= 2 << 30 and len(plan) == 82

    # 70B head layout (64 / 8 heads of 128), 1 layer, small hidden / MLP / vocabulary: a few MB
    small = dict(layers=1, overrides=dict(hidden_size=256, intermediate_size=512, vocab_size=1024))
    drawn, saved = [], []
    tensors = shapes.random_tensors
    monkeypatch.setattr(shapes, "random_tensors", lambda *a, **kw: (
        drawn.append(name) or (name, t) for name, t in tensors(*a, **kw)))
    save = shapes.save_file
    monkeypatch.setattr(shapes, "save_file", lambda tensors, *a, **kw: saved.append(
        (len(drawn), sum(t.numel() * t.element_size() for t in tensors.values()), list(tensors))) or
        save(tensors, *a, **kw))
    path = shapes.write_random_checkpoint("llama-3.1-70b", tmp_path / "70b", shard_bytes=1 << 20, **small)
    assert len(saved) > 2
    total = 0
    for n_drawn, nbytes, names in saved:  # each file is saved before the next one's tensors are drawn
        total += len(names)
        assert n_drawn == total and (nbytes <= 1 << 20 or len(names) == 1)
    assert shapes.write_random_checkpoint("llama-3.1-70b", tmp_path / "70b", shard_bytes=1 << 20, **small) == path
    assert len(saved) == len(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
                                 .values()))  # the second call reused the folder

    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=16, tensor_parallel_size=2)
    try:
        mc = llm.llm_engine.model_config
        assert (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, mc.num_hidden_layers) == (64, 8, 128, 1)
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        cost = DecodeCost.for_model(mc, 2, weight_element_bytes=4)  # float32 on the CPU
        assert DecodeCost.of_engine(llm).weight_bytes == cost.weight_bytes  # rank 0's shard, as computed
        b = run_batch1(llm, 4, 6)
        assert b["tensor_parallel_size"] == 2 and b["bound_tok_s"] == pytest.approx(batch1_bound(cost), rel=1e-3)
        assert b["weights_gib"] == pytest.approx(2 * b["weights_per_gpu_gib"], abs=1e-3)
        assert b["decode_tok_s_per_gpu"] == pytest.approx(b["decode_tok_s"] / 2, abs=0.1)
    finally:
        llm.llm_engine.shutdown()
    with pytest.raises(ValueError, match="layers"):
        shapes.shape_config("llama-3.1-70b", layers=0)


def test_cut_off_write_resumes_with_the_same_values(tmp_path, monkeypatch):
    """A write killed mid-way (a device call's time limit) keeps its whole files and writes only the rest;
    the folder then equals one written in one go. (The 70B's 141 GB take minutes.)"""
    from safetensors.torch import load_file

    small = dict(layers=2, overrides=dict(hidden_size=128, intermediate_size=256, vocab_size=512, head_dim=16,
                                          num_attention_heads=8, num_key_value_heads=4))
    ref = shapes.write_random_checkpoint("llama-3.1-70b", tmp_path / "ref", shard_bytes=100_000, **small)
    save, calls = shapes.save_file, []

    def cut(tensors, path, **kw):
        calls.append(path)
        if len(calls) == 3:
            with open(path, "wb") as f:  # half a file, then the kill
                f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
            raise KeyboardInterrupt
        save(tensors, path, **kw)

    monkeypatch.setattr(shapes, "save_file", cut)
    with pytest.raises(KeyboardInterrupt):
        shapes.write_random_checkpoint("llama-3.1-70b", tmp_path / "cut", shard_bytes=100_000, **small)
    assert not (tmp_path / "cut" / "config.json").exists()
    calls.clear()
    monkeypatch.setattr(shapes, "save_file", lambda tensors, path, **kw: calls.append(path) or save(tensors, path, **kw))
    path = shapes.write_random_checkpoint("llama-3.1-70b", tmp_path / "cut", shard_bytes=100_000, **small)
    files = sorted(p.name for p in ref.glob("*.safetensors"))
    assert len(calls) == len(files) - 2  # the two whole files were kept
    for name in files:
        a, b = load_file(str(ref / name)), load_file(str(path / name))
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
