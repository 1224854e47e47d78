"""`minfer bench` on tiny checkpoints: throughput, batch-1, HF comparison, plot, shape writer."""
from __future__ import annotations

import json

import pytest

from minfer import LLM, SamplingParams
from minfer.benchmark import shapes
from minfer.benchmark.offline import bench, write_outputs
from minfer.benchmark.workload import workload_a
from minfer.cli import main as cli_main

TINY = dict(num_kv_blocks=64, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)


def test_fixed_workload_bench_and_plot(checkpoints, tmp_path):
    result = bench(str(checkpoints["llama3"]), None, TINY, num_prompts=4, input_len=8, output_len=5, progress=False)
    assert result["requests"] == 4 and result["prompt_tokens"] == 32 and result["output_tokens"] == 20
    assert result["output_tok_s"] > 0 and result["num_preemptions"] == 0
    png = tmp_path / "bench.png"
    write_outputs(result, str(tmp_path / "bench.json"), str(png))
    assert json.loads((tmp_path / "bench.json").read_text())["output_tokens"] == 20
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batch1_mode_reports_bound_share(checkpoints):
    result = bench(str(checkpoints["qwen3"]), None, TINY, input_len=6, output_len=8, batch1=True)["batch1"]
    assert result["decode_tok_s"] > 0 and result["bound_tok_s"] > result["decode_tok_s"]
    assert 0 < result["share_of_bound"] < 1


def test_bench_reports_speculation(checkpoints):
    """With a speculative_config, both modes report the run's drafted and accepted tokens (the target drafting
    for itself: nearly every draft accepted)."""
    path = str(checkpoints["llama3"])
    kw = TINY | {"speculative_config": {"method": "draft_model", "model": path, "num_speculative_tokens": 3}}
    for result in (bench(path, None, kw, num_prompts=2, input_len=6, output_len=12, progress=False),
                   bench(path, None, kw, input_len=6, output_len=12, batch1=True)["batch1"]):
        spec = result["speculative"]
        assert spec["method"] == "draft_model" and spec["spec_decode_num_draft_tokens"] > 0
        assert spec["acceptance_rate"] > 0.9 and 1 < spec["mean_acceptance_length"] <= 4
    assert "speculative" not in bench(path, None, TINY, num_prompts=1, input_len=4, output_len=3, progress=False)


def test_compare_hf_same_requests(checkpoints):
    result = bench(str(checkpoints["llama3"]), None, TINY, num_prompts=2, input_len=6, output_len=3,
                   compare_hf=True, hf_num_prompts=2, hf_output_len=4, progress=False)
    c = result["compare_hf"]
    assert c["requests"] == 2 and c["minfer_output_tok_s"] > 0 and c["hf_output_tok_s"] > 0
    assert c["speedup"] == pytest.approx(c["minfer_output_tok_s"] / c["hf_output_tok_s"], rel=0.01)


def test_random_shape_checkpoint_is_a_loadable_sharded_hf_folder(tmp_path, monkeypatch):
    tiny = dict(shapes.SHAPES["qwen3-0.6b"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=512)
    monkeypatch.setitem(shapes.SHAPES, "tiny-qwen3", tiny)
    path = shapes.write_random_checkpoint("tiny-qwen3", tmp_path / "ck", shard_bytes=40_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=16)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="unknown shape"):
        shapes.write_random_checkpoint("gpt-5", tmp_path / "x")


def test_bench_cli_defaults_to_the_builtin_model(monkeypatch):
    """--model's help says the built-in model is the default; bench used to demand --model or --shape."""
    import minfer.benchmark.offline as offline
    from minfer.llm import builtin_model_path

    seen = {}
    monkeypatch.setattr(offline, "bench", lambda model, shape, kwargs, **kw: seen.update(model=model, kwargs=kwargs))
    monkeypatch.setattr(offline, "write_outputs", lambda *a: None)
    assert cli_main(["bench", "--quiet", "--num-prompts", "4"]) == 0
    assert seen["model"] == str(builtin_model_path()) and seen["kwargs"]["max_model_len"] == 1024


def test_a_cpu_run_past_the_limit_is_refused_before_anything_is_written(monkeypatch, tmp_path, capsys):
    """`bench --shape qwen3-0.6b` on a CPU wrote 11 GB and ran for hours without a word: it is refused at once,
    with its estimated time, unless --allow-slow."""
    import minfer.benchmark.offline as offline

    def no_checkpoint(*args, **kwargs):
        raise AssertionError("the shape's checkpoint was written before the run was estimated")

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(shapes, "shape_checkpoint", no_checkpoint)
    monkeypatch.setattr(offline, "bench", lambda *a, **kw: {"ran": True})
    monkeypatch.setattr(offline, "write_outputs", lambda *a: None)
    argv = ["bench", "--shape", "qwen3-0.6b", "--checkpoint-dir", str(tmp_path)]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "would take at least" in err and "at this CPU" in err and "--allow-slow" in err
    monkeypatch.setattr(shapes, "shape_checkpoint", lambda *a, **kw: tmp_path)
    assert cli_main(argv + ["--allow-slow"]) == 0
    assert "at least" in capsys.readouterr().err  # said, not refused


def test_the_estimate_is_the_sum_bound_at_the_rates_given():
    from minfer.benchmark.bounds import DecodeCost, throughput_bounds
    from minfer.benchmark.offline import estimate_seconds
    from minfer.model.registry import model_config

    cfg = model_config(shapes.shape_config("qwen3-0.6b"))
    lens = ([100, 1000], [50, 500])
    fp32 = throughput_bounds(DecodeCost.for_model(cfg, 1, 4.0, 4.0), *lens, bandwidth=1e10, flop_s=1e11)
    seconds = estimate_seconds(cfg, *lens, flop_s=1e11, bandwidth=1e10)
    assert seconds == pytest.approx(fp32["byte_s"] + fp32["flop_s"], rel=1e-3)
    assert estimate_seconds(cfg, *lens, flop_s=2e11, bandwidth=2e10) == pytest.approx(seconds / 2, rel=1e-3)


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_prompts=0, input_len=8), "num_prompts"), (dict(input_len=0), "input_len"),
    (dict(input_len=8, output_len=0), "output_len"),
])
def test_bench_rejects_empty_workloads(checkpoints, kwargs, field):
    with pytest.raises(ValueError, match=field):
        bench(str(checkpoints["llama3"]), None, TINY, progress=False, **kwargs)


def test_workload_a_fits_a_small_model(checkpoints):
    """Workload A on a model with a small vocabulary and context (the built-in model: 4,096 and 1,024; the tiny
    test model: a few hundred and 128 here): the same draws, ids folded into the vocabulary, lengths scaled."""
    result = bench(str(checkpoints["llama3"]), None, TINY, num_prompts=4, progress=True)
    assert result["requests"] == 4 and result["num_preemptions"] == 0
    assert result["workload"] == "A (first 4; lengths x 128/2048 for max_model_len 128, ids mod 320)"
    prompts, params = workload_a(4, 128, 320)
    assert result["prompt_tokens"] == sum(len(p["prompt_token_ids"]) for p in prompts)
    assert result["output_tokens"] == sum(sp.max_tokens for sp in params)


def test_workload_a_scaled_to_a_context():
    full, full_params = workload_a()
    assert sum(len(p["prompt_token_ids"]) for p in full) == 142_827 and sum(sp.max_tokens for sp in full_params) == 133_966
    prompts, params = workload_a(256, 1024, 4096)
    lens = [(len(p["prompt_token_ids"]), sp.max_tokens) for p, sp in zip(prompts, params)]
    assert max(i + o for i, o in lens) <= 1024 and max(i for i, _ in lens) > 500
    assert all(t < 4096 for p in prompts for t in p["prompt_token_ids"])
    assert [i for i, _ in lens] == [len(p["prompt_token_ids"]) // 2 for p in full]


@pytest.mark.parametrize("argv,expected", [
    (["--batch1"], 512), (["--input-len", "8"], 128), (["--batch1", "--output-len", "32"], 32),
    (["--output-len", "32"], 32),
])
def test_cli_output_len_defaults(checkpoints, monkeypatch, argv, expected):
    """A batch-1 run measures 512 tokens unless told otherwise: 128 tokens last ~0.1 s on an H200, too short
    for a stable figure; fixed-length workloads keep 128."""
    import minfer.benchmark.offline as offline

    seen = {}
    monkeypatch.setattr(offline, "bench", lambda model, shape, kwargs, **kw: seen.update(kw) or {})
    monkeypatch.setattr(offline, "write_outputs", lambda *a: None)
    assert cli_main(["bench", "--quiet", "--model", str(checkpoints["llama3"])] + argv) == 0
    assert seen["output_len"] == expected
    if "--batch1" not in argv:  # --output-len alone asks for fixed lengths too (workload A ignored it)
        assert seen["input_len"] == (8 if "--input-len" in argv else 128)


def test_windowed_layers_read_at_most_their_window_in_the_bound():
    """A sliding-window layer's decoded token reads min(context, window) keys; a model whose layers all have a
    window wider than every context bounds exactly as one without."""
    from dataclasses import replace

    from minfer.benchmark.bounds import DecodeCost, _decode_context, _prefill_context, throughput_bounds

    assert _decode_context(100, 50, 0) == 100 * 50 + 50 * 49 / 2
    assert _decode_context(100, 50, 120) == sum(min(100 + t, 120) for t in range(50))
    assert _decode_context(300, 10, 120) == 10 * 120
    assert _prefill_context(50, 0) == _prefill_context(50, 64) == sum(range(1, 51))
    assert _prefill_context(50, 20) == sum(min(i + 1, 20) for i in range(50))
    cost = DecodeCost(1, 1e9, 1e9, 1e8, 1e5, 1e4)
    lens = ([500, 900], [400, 200])
    wide = throughput_bounds(replace(cost, window_shares=((0, 0.5), (4096, 0.5))), *lens)
    assert wide == throughput_bounds(cost, *lens)
    narrow = throughput_bounds(replace(cost, window_shares=((0, 0.5), (128, 0.5))), *lens)
    assert narrow["byte_s"] < wide["byte_s"] and narrow["kv_share_of_bytes"] < wide["kv_share_of_bytes"]
